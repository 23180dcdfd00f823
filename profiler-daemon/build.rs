//! Builds the eBPF object with nightly and bpf-linker (`cargo xtask setup` installs both) so the
//! daemon can embed it.
fn main() -> anyhow::Result<()> {
    // aya-build watches the eBPF crate only; the shared types are compiled into the object too.
    println!("cargo:rerun-if-changed={}/../profiler-common", env!("CARGO_MANIFEST_DIR"));
    // aya-build relays every line the inner cargo prints as a warning: keep only the real ones.
    // SAFETY: the build script is single-threaded here.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    let package = aya_build::Package {
        name: "profiler-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../profiler-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Nightly)
}
