//! Developer tasks: `cargo xtask setup | demo | test | kernels | bench | soak | fuzz | pause | man | deb | image | docs`.
//!
//! Each installs what it needs first (see `setup`), so a fresh machine needs nothing else.

mod bench;
mod benchmarks;
mod demo;
mod docs;
mod fuzz;
mod image;
mod kernels;
mod package;
mod pause;
mod setup;
mod soak;
mod suite;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

/// What `cargo xtask help` prints.
const USAGE: &str = "usage: cargo xtask <setup|demo|test|kernels|bench|soak|fuzz|pause|man|deb|image|docs>\n  \
setup  install the toolchain pieces and packages memprof needs\n  \
demo   build memprof and watch it find the leak in a bundled program\n  \
test   formatting, lints, unit and end-to-end tests (as root)\n  \
kernels  the core end-to-end tests on Debian's 6.1 and 6.12 kernels, each booted under QEMU (as root; 10-15 minutes)\n  \
bench [--only daemon|services|rest|loop|workloads]  the cost of tracing, memprof beside heaptrack, valgrind and bpftrace; writes BENCHMARKS.md (--only daemon: the daemon's own cost alone, its section rewritten; services: real services; rest: the daemon at rest with 1,000 idle processes and 65,536 stacks; loop: the malloc/free loop's table; workloads: the other workloads' table)\n  \
soak --minutes N  the daemon tracing churning processes for N minutes: are its memory, descriptors and maps flat? (BENCHMARKS.md)\n  \
fuzz --seconds N  each cargo-fuzz target (ELF/DWARF readers) for N seconds (BENCHMARKS.md)\n  \
pause  how long --inspect holds a process still, 16 MiB to 1 GiB of heap (BENCHMARKS.md)\n  \
man [--out DIR]  the man pages, generated from the command line (target/man)\n  \
deb [--out DIR]  a Debian package: stripped binary, systemd unit, config, man pages, completions (target/deb)\n  \
image [--out DIR]  the container image memprof:VERSION, an OCI archive of the package's files (target/image)\n  \
docs  the book (docs/) built into target/book, its links and the code's `docs:` references checked";

fn main() -> anyhow::Result<()> {
    let task = std::env::args().nth(1).unwrap_or_default();
    // `cargo xtask kernels --help` would otherwise boot the kernels: no task takes a help flag.
    if std::env::args().skip(2).any(|arg| arg == "--help" || arg == "-h") {
        println!("{USAGE}");
        return Ok(());
    }
    match task.as_str() {
        "setup" => {
            setup::all()?;
            setup::cargo_fuzz()?;
            setup::mdbook()
        }
        "demo" => {
            setup::all()?;
            demo::run()
        }
        "test" => {
            setup::all()?;
            test()
        }
        "kernels" => {
            setup::all()?;
            kernels::run()
        }
        "bench" => {
            setup::all()?;
            bench::run(&std::env::args().skip(2).collect::<Vec<_>>())
        }
        "soak" => {
            setup::all()?;
            soak::run(&std::env::args().skip(2).collect::<Vec<_>>())
        }
        "fuzz" => {
            setup::all()?;
            fuzz::run(&std::env::args().skip(2).collect::<Vec<_>>())
        }
        "pause" => {
            setup::all()?;
            pause::run()
        }
        "man" => package::man(&std::env::args().skip(2).collect::<Vec<_>>()),
        "deb" => package::deb(&std::env::args().skip(2).collect::<Vec<_>>()),
        "image" => image::image(&std::env::args().skip(2).collect::<Vec<_>>()),
        "docs" => {
            setup::all()?;
            docs::run()
        }
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        "" => {
            eprintln!("{USAGE}");
            std::process::exit(2)
        }
        other => {
            eprintln!("xtask: no task {other:?}; the tasks are:\n{USAGE}");
            std::process::exit(2)
        }
    }
}

/// The repository root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Runs a command in the repository root, failing with its name if it fails.
fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    run_with(Command::new(program).args(args))
}

fn run_with(command: &mut Command) -> anyhow::Result<()> {
    let status = command.current_dir(root()).status().with_context(|| format!("starting {command:?}"))?;
    if !status.success() {
        bail!("`{command:?}` failed ({status})");
    }
    Ok(())
}

/// What a command prints, trimmed; its failure is an error naming it, with what it said.
fn output(command: &mut Command) -> anyhow::Result<String> {
    let out = command.output().with_context(|| format!("starting {command:?}"))?;
    if !out.status.success() {
        bail!("`{command:?}` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Compiles a C file.
fn compile_c(source: &Path, out: &Path, flags: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("cc").args(flags).arg("-o").arg(out).arg(source).status().context("starting cc")?;
    if !status.success() {
        bail!("compiling {} failed", source.display());
    }
    Ok(())
}

/// Builds the release binary and returns its path.
fn build_memprof() -> anyhow::Result<PathBuf> {
    run("cargo", &["build", "--release", "--package", "profiler-daemon"])?;
    Ok(root().join("target/release/memprof"))
}

fn test() -> anyhow::Result<()> {
    run("cargo", &["fmt", "--all", "--check"])?;
    run(
        "cargo",
        &["clippy", "--release", "--workspace", "--exclude", "profiler-ebpf", "--all-targets", "--", "-D", "warnings"],
    )?;
    let bpf_target = ["--target", "bpfel-unknown-none", "-Z", "build-std=core"];
    run_with(
        Command::new("cargo")
            .args(["+nightly", "clippy", "--release", "--package", "profiler-ebpf"])
            .args(bpf_target)
            .args(["--", "-D", "warnings"])
            // As aya-build compiles it: for this host's architecture.
            .env("CARGO_ENCODED_RUSTFLAGS", format!("--cfg=bpf_target_arch=\"{}\"", std::env::consts::ARCH)),
    )?;
    let memprof = build_memprof()?;
    check_bpf_stack()?;
    // The end-to-end tests run this binary against real processes: they need root.
    // SAFETY: setting a variable before any thread of ours starts.
    unsafe { std::env::set_var("MEMPROF_BIN", &memprof) };
    suite::run()
}

/// Kernels before 6.13 give a BPF program 512 bytes of stack for its whole chain of calls, each
/// frame rounded up to 32 bytes, which 6.18's verifier does not check alike: the object
/// `build_memprof` embedded is checked here as 6.1 counts.
fn check_bpf_stack() -> anyhow::Result<()> {
    let builds = std::fs::read_dir(root().join("target/release/build")).context("reading target/release/build")?;
    let object = builds
        .filter_map(|entry| Some(entry.ok()?.path().join("out/profiler-ebpf")))
        .filter_map(|path| Some((std::fs::metadata(&path).ok()?.modified().ok()?, path)))
        .max()
        .map(|(_, path)| path)
        .context("no profiler-ebpf object under target/release/build: build memprof first")?;
    run("python3", &["xtask/bpf_stack_depth.py", &object.to_string_lossy()])
}
