//! Builds the eBPF object with nightly and bpf-linker (`cargo xtask setup` installs both) so the
//! daemon can embed it.
fn main() -> anyhow::Result<()> {
    // aya-build watches the eBPF crate only; the shared types are compiled into the object too.
    println!("cargo:rerun-if-changed={}/../profiler-common", env!("CARGO_MANIFEST_DIR"));
    let package = aya_build::Package {
        name: "profiler-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../profiler-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Nightly)
}
