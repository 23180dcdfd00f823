//! Installs what building and testing memprof needs, skipping what is already there.
//!
//! The eBPF crate is built with nightly (`-Z build-std=core`) and linked by bpf-linker, which must
//! be built against an LLVM as new as nightly's. Debian's LLVM is too old and prebuilt linkers
//! cannot be downloaded, so bpf-linker is built against the LLVM shared library nightly ships
//! (see ../shared/notes/toolchain.md).

use std::{
    env, fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

use crate::{run, run_with};

/// Debian packages the tasks use: compilers for the test fixtures and the demo, bpftool to check
/// that no probe is left behind, the Prometheus server the daemon test scrapes with, the
/// headless Chromium the report tests open the HTML report in, and libc6-dbg, the C library's
/// detached debug info, which the symbol tests read glibc's file and line from, and Go, whose
/// `go tool pprof` the pprof tests read memprof's profiles with, and openssl and curl, with which
/// the HTTP tests make a certificate and fetch over TLS; jemalloc, tcmalloc (gperftools) and
/// mimalloc, which the allocator tests link and preload; redis-server, a real program on jemalloc;
/// LLVM's 100 MB library, which the unwinding tests load; llvm-objdump, with which `test` reads each
/// BPF program's stack (xtask/bpf_stack_depth.py).
const PACKAGES: &[&str] = &[
    "gcc",
    "libc6-dev",
    "g++",
    "bpftool",
    "prometheus",
    "chromium",
    "libc6-dbg",
    "golang-go",
    "openssl",
    "curl",
    "libjemalloc-dev",
    "libgoogle-perftools-dev",
    // tests/tests/peaks.rs: heaptrack counts temporary allocations as memprof does.
    "heaptrack",
    // tests/tests/blind_spots.rs: runtimes whose heaps memprof names as blind spots.
    "openjdk-17-jdk-headless",
    "nodejs",
    // tests/tests/postgres.rs: a real forking server.
    "postgresql",
    // tests/tests/nginx.rs: a server whose workers run before memprof attaches.
    "nginx",
    "libmimalloc-dev",
    "redis-server",
    // tests/tests/install.rs: Debian's checker of packages, run on the .deb.
    "lintian",
    "libllvm14",
    "llvm",
    "musl-tools",
    // tests/tests/usdt.rs: <sys/sdt.h>, with which a fixture fires otel_memory USDT probes.
    "systemtap-sdt-dev",
    // tests/tests/image.rs: reads and copies the OCI archive of `cargo xtask image`, as podman would.
    "skopeo",
    // The virtual environment kubernetes-validate is installed in (see `kubernetes_validate`).
    "python3-venv",
    // tests/tests/untraced_spared.rs: kills memprof at the moment it closes a probe link.
    "bpftrace",
];
/// Go releases besides Debian 12's Go 1.19 whose runtimes lay out their heap sampler otherwise
/// (tests/tests/go_sampler.rs): Debian 13's packages of them, by the suite that serves each. They
/// are downloaded and unpacked into `target/go-toolchains/<release>`, not installed: a Debian 13
/// package does not install on Debian 12, and Go's toolchain runs from any directory.
const GO_TOOLCHAINS: [(&str, &str); 2] = [("1.24", "trixie"), ("1.27", "trixie-backports")];

const BPF_LINKER_VERSION: &str = "0.13.0";

/// mdBook, which `cargo xtask docs` builds the book with, pinned; without its dev server and file
/// watcher, which the book's build does not use and which would double its compile time.
pub const MDBOOK: &str = "mdbook";
const MDBOOK_VERSION: &str = "0.5.4";

/// kubernetes-validate from PyPI, which tests/tests/manifests.rs checks deploy/'s Kubernetes
/// manifests with against the API server's schemas (it ships them: no cluster, no network).
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

pub fn all() -> anyhow::Result<()> {
    debian_packages(PACKAGES)?;
    go_toolchains()?;
    rust_src()?;
    bpf_linker()?;
    kubernetes_validate()?;
    tracefs()
}

/// The kernel's tracing file system, where bpftrace reads the tracepoints the tests that kill
/// memprof at a system call use (tests/tests/untraced_spared.rs): a machine may boot without it.
fn tracefs() -> anyhow::Result<()> {
    const TRACEFS: &str = "/sys/kernel/tracing";
    if Path::new(TRACEFS).join("available_events").exists() {
        return Ok(());
    }
    eprintln!("xtask: mounting tracefs on {TRACEFS}");
    run("mount", &["-t", "tracefs", "nodev", TRACEFS])
}

/// Where tests/tests/manifests.rs finds the validator: a virtual environment of Debian's python3,
/// the version pinned.
fn kubernetes_validate() -> anyhow::Result<()> {
    let venv =
        PathBuf::from(env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache/memprof/kubernetes-validate");
    let version = KUBERNETES_VALIDATE.rsplit('=').next().unwrap_or_default();
    if crate::output(Command::new(venv.join("bin/kubernetes-validate")).arg("--version")).is_ok_and(|v| v == version) {
        return Ok(());
    }
    eprintln!("xtask: installing {KUBERNETES_VALIDATE} in {}", venv.display());
    // Debian's python by its path: another on PATH (pyenv's) may lack venv.
    run_with(Command::new("/usr/bin/python3").args(["-m", "venv"]).arg(&venv))?;
    run_with(Command::new(venv.join("bin/pip")).args(["install", "-q", KUBERNETES_VALIDATE]))
}

/// cargo-fuzz, for `cargo xtask fuzz` (its targets build with the nightly toolchain the eBPF crate
/// needs too).
pub fn cargo_fuzz() -> anyhow::Result<()> {
    if succeeds("cargo", &["fuzz", "--version"]) {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-fuzz");
    run("cargo", &["install", "--locked", "cargo-fuzz"])
}

/// mdBook from crates.io, unless this version is already installed.
pub fn mdbook() -> anyhow::Result<()> {
    if output(MDBOOK, &["--version"]).is_ok_and(|v| v == format!("mdbook v{MDBOOK_VERSION}")) {
        return Ok(());
    }
    eprintln!("xtask: installing mdbook {MDBOOK_VERSION}");
    run(
        "cargo",
        &[
            "install",
            "--locked",
            "mdbook",
            "--version",
            MDBOOK_VERSION,
            "--no-default-features",
            "--features",
            "search",
        ],
    )
}

fn succeeds(program: &str, args: &[&str]) -> bool {
    Command::new(program).args(args).output().map(|o| o.status.success()).unwrap_or(false)
}

fn output(program: &str, args: &[&str]) -> anyhow::Result<String> {
    crate::output(Command::new(program).args(args))
}

pub fn debian_packages(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing Debian packages: {}", missing.join(" "));
    run("apt-get", &["update", "-q"])?;
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(&missing);
    run("apt-get", &args)
}

/// Each of `GO_TOOLCHAINS` not unpacked yet: its `go` and `src` packages fetched through apt lists
/// of their own (`target/go-toolchains/apt`), which leave the machine's apt sources alone.
fn go_toolchains() -> anyhow::Result<()> {
    let dir = crate::root().join("target/go-toolchains");
    let missing: Vec<_> = GO_TOOLCHAINS.iter().filter(|(release, _)| !dir.join(release).exists()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let apt = dir.join("apt");
    std::fs::create_dir_all(apt.join("lists/partial"))?;
    let suites: String =
        GO_TOOLCHAINS.iter().map(|(_, suite)| format!("deb http://deb.debian.org/debian {suite} main\n")).collect();
    std::fs::write(apt.join("sources.list"), suites)?;
    let options = [
        format!("Dir::Etc::sourcelist={}", apt.join("sources.list").display()),
        "Dir::Etc::sourceparts=-".to_string(),
        format!("Dir::State::Lists={}", apt.join("lists").display()),
        "Dir::State::status=/dev/null".to_string(),
    ];
    // In `apt`, where `apt-get download` leaves the packages (`run_with` runs in the root).
    let apt_get = |args: &[String]| -> anyhow::Result<()> {
        let mut command = Command::new("apt-get");
        for option in &options {
            command.args(["-o", option]);
        }
        let status = command.args(args).current_dir(&apt).status()?;
        if !status.success() {
            bail!("`apt-get {}` failed ({status})", args.join(" "));
        }
        Ok(())
    };
    apt_get(&["update".into(), "-q".into()])?;
    for (release, suite) in missing {
        eprintln!("xtask: downloading Go {release} from Debian's {suite} into {}", dir.display());
        let packages = ["go", "src"].map(|part| format!("golang-{release}-{part}/{suite}"));
        apt_get(&[["download".to_string(), "-q".into()].as_slice(), &packages].concat()).with_context(|| {
            format!("Debian's {suite} serves no golang-{release}: update GO_TOOLCHAINS in xtask/src/setup.rs to a release it serves")
        })?;
        let partial = dir.join(format!(".{release}.partial"));
        let _ = std::fs::remove_dir_all(&partial);
        for entry in std::fs::read_dir(&apt)? {
            let deb = entry?.path();
            if deb.extension().is_some_and(|extension| extension == "deb") {
                run_with(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial))?;
                std::fs::remove_file(&deb)?;
            }
        }
        std::fs::rename(&partial, dir.join(release))?;
    }
    Ok(())
}

/// Whether dpkg has `package` installed: its status ends in ` installed` (`install ok installed`),
/// where one it knows but has not installed ends in `not-installed`.
fn installed(package: &str) -> bool {
    output("dpkg-query", &["-W", "-f=${Status}", package]).is_ok_and(|status| status.ends_with(" installed"))
}

fn nightly_sysroot() -> anyhow::Result<PathBuf> {
    Ok(PathBuf::from(
        output("rustc", &["+nightly", "--print", "sysroot"])
            .context("the nightly toolchain is needed for the eBPF crate")?,
    ))
}

fn rust_src() -> anyhow::Result<()> {
    if nightly_sysroot()?.join("lib/rustlib/src/rust/library/core").exists() {
        return Ok(());
    }
    run("rustup", &["component", "add", "rust-src", "--toolchain", "nightly"])
}

fn bpf_linker() -> anyhow::Result<()> {
    if succeeds("bpf-linker", &["--version"]) {
        return Ok(());
    }
    let lib = nightly_sysroot()?.join("lib");
    let llvm = fs::read_dir(&lib)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libLLVM.so.")))
        .with_context(|| format!("no libLLVM.so.* in {}", lib.display()))?;
    let version = llvm.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("libLLVM.so.")).unwrap_or("");
    let major = version.split('.').next().unwrap_or("");
    // bpf-linker's build script only runs `llvm-config --version` and links -lLLVM from lib/; the
    // binary keeps an rpath to this directory, so it must stay where it is.
    let shim = PathBuf::from(env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache/memprof/llvm-shim");
    fs::create_dir_all(shim.join("bin"))?;
    fs::create_dir_all(shim.join("lib"))?;
    let llvm_config = shim.join("bin/llvm-config");
    fs::write(&llvm_config, format!("#!/bin/sh\necho {}\n", version.split('-').next().unwrap_or(version)))?;
    fs::set_permissions(&llvm_config, fs::Permissions::from_mode(0o755))?;
    // libLLVM.so for the link, and the library's own name for the rpath lookup at run time.
    for name in [std::ffi::OsStr::new("libLLVM.so"), llvm.file_name().unwrap_or_default()] {
        let link = shim.join("lib").join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&llvm, &link)?;
    }
    eprintln!("xtask: building bpf-linker {BPF_LINKER_VERSION} against nightly's LLVM {major} (a few minutes, once)");
    let feature = format!("llvm-{major}");
    let status = Command::new("cargo")
        .args([
            "+nightly",
            "install",
            "--force",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            &feature,
        ])
        .env("LLVM_PREFIX", &shim)
        .status()?;
    if !status.success() {
        bail!("building bpf-linker failed ({status})");
    }
    Ok(())
}
