//! The programs tests run: C, C++, Rust and Go fixtures compiled once per change, the bench's
//! workloads, and a root directory of a program's own.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Mutex,
};

use crate::{memprof_bin, workspace};

static COMPILE: Mutex<()> = Mutex::new(());

/// Compiles `tests/fixtures/NAME.c` and returns the executable.
pub fn fixture(name: &str) -> PathBuf {
    fixture_with(&format!("{name}.c"), name, &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"])
}

/// Compiles the fixture source `file` with the flags given into the executable `name` (each
/// build its own name: tests run side by side).
pub fn fixture_with(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    fixture_compiled("cc", file, name, flags)
}

/// Compiles the fixture source `file` with `musl-gcc -static` and the flags given: musl's libc
/// is built without unwind tables.
pub fn fixture_musl(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    let flags: Vec<&str> = ["-static"].iter().chain(flags).copied().collect();
    fixture_compiled("musl-gcc", file, name, &flags)
}

/// `fixture_musl` without the symbols of its C library's `mmap` (`objcopy --strip-symbol`): a
/// static program whose mapping calls memprof finds no wrapper of, as one whose symbols are
/// stripped, but whose allocator memprof still finds.
pub fn fixture_musl_unnamed_mmap(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    let flags: Vec<&str> = ["-static"].iter().chain(flags).copied().collect();
    let source = workspace().join("tests/fixtures").join(file);
    compiled_without("musl-gcc", &source, name, &flags, &["mmap", "__mmap"])
}

/// A root directory of its own for `program`, as a container has: copies of the C library, the
/// dynamic loader and the program (as `/NAME`). Copies, not links: each is a different inode from
/// the host's file, as a container's libc is, so probes must be placed through the process's view.
/// The caller removes it.
pub fn own_root(program: &Path, name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("memprof-root-{}-{name}", std::process::id()));
    for (from, to) in [
        (Path::new("/lib/x86_64-linux-gnu/libc.so.6"), "lib/x86_64-linux-gnu/libc.so.6"),
        (Path::new("/lib64/ld-linux-x86-64.so.2"), "lib64/ld-linux-x86-64.so.2"),
        (program, name),
    ] {
        let to = root.join(to);
        std::fs::create_dir_all(to.parent().expect("a file under the root")).expect("creating the root's directories");
        std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copying {} into the root: {e}", from.display()));
    }
    root
}

/// Compiles the fixture source `file` with `compiler` (`cc`, `g++`, `rustc`) and `flags` into
/// `target/fixtures/NAME` (an executable, or a shared library with `-shared`).
pub fn fixture_compiled(compiler: &str, file: &str, name: &str, flags: &[&str]) -> PathBuf {
    compiled(compiler, &workspace().join("tests/fixtures").join(file), name, flags)
}

/// Compiles `bench/FILE`, a workload `cargo xtask` measures memprof with, with `cc FLAGS` into
/// the executable `name`: for a test that needs the same workload.
pub fn bench_program(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    compiled("cc", &workspace().join("bench").join(file), name, flags)
}

/// `bench/heapbench.c` holding `mib` MiB of live blocks, once it says it has built them. It waits
/// for its stdin to close, so it ends with the test that holds it, whatever happens.
pub fn start_heapbench(mib: u64) -> Child {
    let heapbench = bench_program("heapbench.c", "heapbench", &["-O2", "-pthread"]);
    let mut target = Command::new(&heapbench)
        .arg(mib.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting heapbench");
    let mut built = String::new();
    BufReader::new(target.stdout.as_mut().expect("piped")).read_line(&mut built).expect("reading heapbench");
    assert_eq!(built, "built\n");
    target
}

/// Compiles `source` with `compiler` and `flags` into `target/fixtures/NAME`, unless it was built
/// so already and no fixture source changed since: built again, it would be renamed over the file
/// a test running beside this one executes (whose exe then reads "(deleted)", and whose probes,
/// placed by path, would land on the new file).
fn compiled(compiler: &str, source: &Path, name: &str, flags: &[&str]) -> PathBuf {
    compiled_without(compiler, source, name, flags, &[])
}

/// `compiled`, with the symbols `unnamed` taken out of the program's symbol table.
fn compiled_without(compiler: &str, source: &Path, name: &str, flags: &[&str], unnamed: &[&str]) -> PathBuf {
    let _guard = COMPILE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = workspace().join("target/fixtures");
    std::fs::create_dir_all(&dir).expect("creating target/fixtures");
    // Several test binaries compile at once: one at a time, across processes too.
    let lock = std::fs::File::create(dir.join(".lock")).expect("creating target/fixtures/.lock");
    lock.lock().expect("locking target/fixtures");
    let out = dir.join(name);
    let stamp = dir.join(format!(".{name}.command"));
    let mut command = format!("{compiler} {} {}", flags.join(" "), source.display());
    if !unnamed.is_empty() {
        command += &format!(" without the symbols {}", unnamed.join(" "));
    }
    if is_built(&out, &stamp, &command, source) {
        return out;
    }
    let partial = dir.join(format!(".{name}.{}", std::process::id()));
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(&partial)
        .arg(source)
        .status()
        .unwrap_or_else(|e| panic!("starting {compiler}: {e}"));
    assert!(status.success(), "compiling {} with {compiler} failed", source.display());
    for symbol in unnamed {
        let status = Command::new("objcopy")
            .arg(format!("--strip-symbol={symbol}"))
            .arg(&partial)
            .status()
            .unwrap_or_else(|e| panic!("starting objcopy: {e}"));
        assert!(status.success(), "objcopy could not take {symbol} out of {}", partial.display());
    }
    std::fs::rename(&partial, &out).expect("moving the fixture into place");
    std::fs::write(&stamp, &command).expect("writing the fixture's command");
    out
}

/// Whether `out` was built by `command` after the last change to `source` and the files beside
/// it (the headers it includes).
fn is_built(out: &Path, stamp: &Path, command: &str, source: &Path) -> bool {
    let modified = |path: &Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let Some(built) = modified(out) else { return false };
    let sources = source.parent().and_then(|dir| std::fs::read_dir(dir).ok()).into_iter().flatten().flatten();
    let newest = sources.filter(|e| e.path().is_file()).filter_map(|e| modified(&e.path())).max();
    std::fs::read_to_string(stamp).is_ok_and(|was| was == command) && newest.is_some_and(|newest| newest <= built)
}

/// Builds the Rust fixture crate `tests/fixtures/NAME` (its own crates from crates.io, in release
/// mode as a service ships) and returns its binary `bin`.
pub fn fixture_crate(name: &str, bin: &str) -> PathBuf {
    let _guard = COMPILE.lock().unwrap_or_else(|e| e.into_inner());
    let target = workspace().join("target/fixtures").join(name);
    let manifest = workspace().join("tests/fixtures").join(name).join("Cargo.toml");
    let status = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["build", "--release", "--quiet", "--locked", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .status()
        .unwrap_or_else(|e| panic!("starting cargo: {e}"));
    assert!(status.success(), "building {} failed", manifest.display());
    target.join("release").join(bin)
}

/// Builds the Go fixture module `tests/fixtures/NAME` with Debian's `go` into
/// `target/fixtures/NAME`, linked by the system's linker (so that it maps the C library, as a Go
/// program using cgo or the system's resolver does), its build cache under `target/go-cache` (a
/// rebuild is a cache hit), offline: the fixtures use the standard library only.
pub fn fixture_go(name: &str) -> PathBuf {
    build_go("go", name, name, &["-ldflags=-linkmode=external"], "1")
}

/// `fixture_go` built as most Go services are, without cgo: a static binary with no C library,
/// into `target/fixtures/NAME-pure`.
pub fn fixture_go_pure(name: &str) -> PathBuf {
    build_go("go", name, &format!("{name}-pure"), &[], "0")
}

/// `fixture_go_pure` without its symbol table (`-ldflags=-s`, as a stripped package is), into
/// `target/fixtures/NAME-stripped`.
pub fn fixture_go_stripped(name: &str) -> PathBuf {
    build_go("go", name, &format!("{name}-stripped"), &["-ldflags=-s"], "0")
}

/// `fixture_go` (cgo, the system's linker) stripped: its Go code has no CFI at all, into
/// `target/fixtures/NAME-cgo-stripped`.
pub fn fixture_go_cgo_stripped(name: &str) -> PathBuf {
    build_go("go", name, &format!("{name}-cgo-stripped"), &["-ldflags=-s -linkmode=external"], "1")
}

/// `fixture_go_stripped` built by Go `release` (`1.27`), one of those `cargo xtask setup`
/// unpacks into `target/go-toolchains` beside Debian 12's Go 1.19, into
/// `target/fixtures/NAME-goRELEASE`.
pub fn fixture_go_release_stripped(name: &str, release: &str) -> PathBuf {
    let root = workspace().join(format!("target/go-toolchains/{release}/usr/lib/go-{release}"));
    let go = root.join("bin/go");
    build_go(go.to_str().unwrap(), name, &format!("{name}-go{release}"), &["-ldflags=-s"], "0")
}

fn build_go(go: &str, name: &str, out_name: &str, flags: &[&str], cgo: &str) -> PathBuf {
    let _guard = COMPILE.lock().unwrap_or_else(|e| e.into_inner());
    let target = workspace().join("target");
    let out = target.join("fixtures").join(out_name);
    // A toolchain outside its installed place finds its standard library by GOROOT.
    let goroot = Path::new(go).parent().and_then(Path::parent).filter(|root| root.join("src").exists());
    let mut command = Command::new(go);
    if let Some(goroot) = goroot {
        command.env("GOROOT", goroot);
    }
    let status = command
        .arg("build")
        .args(flags)
        .arg("-o")
        .arg(&out)
        .arg(".")
        .current_dir(workspace().join("tests/fixtures").join(name))
        .env("GOCACHE", target.join("go-cache"))
        .env("GOPATH", target.join("go-path"))
        .env("GOPROXY", "off")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=mod")
        .env("CGO_ENABLED", cgo)
        .status()
        .unwrap_or_else(|e| panic!("starting {go} (Debian's, installed by `cargo xtask setup`): {e}"));
    assert!(status.success(), "building the Go fixture {name} failed");
    out
}

/// Compiles the C++ fixture `file` with `g++ FLAGS` into the executable `name`.
pub fn fixture_cpp(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    fixture_compiled("g++", file, name, flags)
}

/// Compiles the Rust fixture `file` (a crate root) with `rustc FLAGS` into the executable `name`.
pub fn fixture_rust(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    fixture_compiled("rustc", file, name, flags)
}

/// Compiles the C fixture `file` with `cc -shared -fPIC FLAGS` into the shared library `name`.
pub fn fixture_lib(file: &str, name: &str, flags: &[&str]) -> PathBuf {
    let all: Vec<&str> = ["-shared", "-fPIC"].iter().chain(flags).copied().collect();
    fixture_compiled("cc", file, name, &all)
}

/// `cargo xtask WHAT --out OUT` on the binary under test (packaged as it is, not built again):
/// what it prints, the path of what it made.
pub fn xtask_package(what: &str, out: &Path) -> String {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.args(["xtask", what, "--out"]).arg(out).env("MEMPROF_BIN", memprof_bin());
    succeeds(&mut command).trim().to_string()
}

/// Runs `command`, which must succeed: its standard output.
pub fn succeeds(command: &mut Command) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
    assert!(out.status.success(), "{command:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}
