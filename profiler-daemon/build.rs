//! Builds the eBPF object with nightly and bpf-linker (`cargo xtask setup` installs both) so the
//! daemon can embed it, and records the commit built for `--version`.

use std::{path::Path, process::Command};

fn main() -> anyhow::Result<()> {
    commit();
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

/// Sets MEMPROF_COMMIT: the commit checked out (git's short hash), or MEMPROF_COMMIT from the
/// environment for a build outside git (a source tarball: a packager says which commit it is).
fn commit() {
    println!("cargo:rerun-if-env-changed=MEMPROF_COMMIT");
    let from_git = git(&["rev-parse", "--short=12", "HEAD"]);
    let commit = std::env::var("MEMPROF_COMMIT").ok().or(from_git).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=MEMPROF_COMMIT={commit}");
    // Built again when HEAD moves: a new commit on the branch, or another branch checked out.
    for file in ["HEAD", "packed-refs"] {
        rerun_if_git_file_changed(file);
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        rerun_if_git_file_changed(&branch);
    }
}

fn rerun_if_git_file_changed(name: &str) {
    if let Some(path) = git(&["rev-parse", "--path-format=absolute", "--git-path", name]) {
        if Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}

/// What `git ARGS` prints in this crate's directory, when it succeeds.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}
