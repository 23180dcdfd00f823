//! `cargo xtask man` and `cargo xtask deb`: the man pages, and a Debian package holding the
//! stripped binary, the systemd unit, the config, the man pages and shell completions.
//!
//! Both take the binary in `MEMPROF_BIN` when it is set (the tests do: the package is made from
//! the binary under test, never rebuilt), else build the release binary.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

use crate::{build_memprof, output, root, run_with};

/// `cargo xtask man [--out DIR]`: memprof.1 and one page per subcommand, into DIR
/// (default target/man).
pub fn man(args: &[String]) -> anyhow::Result<()> {
    let out = out_dir(args, "target/man")?;
    man_pages(&binary()?, &out)?;
    eprintln!("xtask: man pages in {}", out.display());
    Ok(())
}

/// `cargo xtask deb [--out DIR]`: DIR/memprof_VERSION_ARCH.deb (default DIR: target/deb).
pub fn deb(args: &[String]) -> anyhow::Result<()> {
    let out = out_dir(args, "target/deb")?;
    let binary = binary()?;
    let stage = out.join("staging");
    let _ = fs::remove_dir_all(&stage);
    let version = version(&binary)?;
    let arch = output(Command::new("dpkg").arg("--print-architecture"))?;

    let bin = stage.join("usr/bin/memprof");
    fs::create_dir_all(bin.parent().expect("a directory"))?;
    // Stripped: 75 MB of debug info and symbols become about a fifth of that.
    run_with(Command::new("objcopy").arg("--strip-all").arg(&binary).arg(&bin))?;

    // The unit in deploy/ names the binary where a manual install puts it.
    let unit = fs::read_to_string(root().join("deploy/memprof.service"))?.replace("/usr/local/bin/", "/usr/bin/");
    write(&stage.join("lib/systemd/system/memprof.service"), unit.as_bytes())?;
    write(&stage.join("etc/memprof/memprof.toml"), &fs::read(root().join("deploy/memprof.toml"))?)?;

    let man = stage.join("usr/share/man/man1");
    man_pages(&bin, &man)?;
    for page in fs::read_dir(&man)? {
        run_with(Command::new("gzip").args(["-9", "-n"]).arg(page?.path()))?;
    }
    for (shell, path) in [
        ("bash", "usr/share/bash-completion/completions/memprof"),
        ("zsh", "usr/share/zsh/vendor-completions/_memprof"),
        ("fish", "usr/share/fish/vendor_completions.d/memprof.fish"),
    ] {
        let script = output(Command::new(&bin).args(["completions", shell]))?;
        write(&stage.join(path), format!("{script}\n").as_bytes())?;
    }
    let doc = stage.join("usr/share/doc/memprof");
    for license in ["LICENSE-MIT", "LICENSE-APACHE"] {
        write(&doc.join(license), &fs::read(root().join(license))?)?;
    }
    write(&doc.join("copyright"), b"memprof is licensed under the MIT license or the Apache License 2.0, at your option:\nsee LICENSE-MIT and LICENSE-APACHE in this directory.\n")?;

    let control = format!(
        "Package: memprof\nVersion: {version}\nArchitecture: {arch}\nMaintainer: memprof maintainers\n\
         Depends: {}\nSection: devel\nPriority: optional\nInstalled-Size: {}\n\
         Description: eBPF heap profiler for running processes\n memprof puts uprobes on the allocators of running processes and reports which call\n \
         stacks hold how much memory, leak candidates and double frees, as tables, JSON, pprof,\n \
         flame graphs and HTML, or as Prometheus metrics from its daemon (memprof.service).\n",
        depends(&binary)?,
        installed_kib(&stage)?,
    );
    write(&stage.join("DEBIAN/control"), control.as_bytes())?;
    write(&stage.join("DEBIAN/conffiles"), b"/etc/memprof/memprof.toml\n")?;

    let deb = out.join(format!("memprof_{version}_{arch}.deb"));
    // Its "building package" line to stderr: stdout is the package's path alone, for scripts.
    run_with(
        Command::new("dpkg-deb")
            // gzip: a second where xz takes ten on a busy 2-core machine, for a package 30% larger.
            .args(["--root-owner-group", "-Zgzip", "--build"])
            .arg(&stage)
            .arg(&deb)
            .stdout(std::io::stderr()),
    )?;
    fs::remove_dir_all(&stage)?;
    println!("{}", deb.display());
    Ok(())
}

/// `MEMPROF_BIN`, or the release binary, built.
fn binary() -> anyhow::Result<PathBuf> {
    match std::env::var_os("MEMPROF_BIN") {
        Some(bin) => Ok(PathBuf::from(bin)),
        None => build_memprof(),
    }
}

fn out_dir(args: &[String], default: &str) -> anyhow::Result<PathBuf> {
    let out = match args {
        [] => root().join(default),
        [flag, dir] if flag == "--out" => PathBuf::from(dir),
        _ => bail!("usage: cargo xtask man|deb [--out DIR]"),
    };
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    Ok(out)
}

fn man_pages(binary: &Path, dir: &Path) -> anyhow::Result<()> {
    run_with(Command::new(binary).arg("man").arg(dir))
}

/// The package version: the binary's (`memprof 0.1.0 (commit ...)`).
fn version(binary: &Path) -> anyhow::Result<String> {
    let line = output(Command::new(binary).arg("--version"))?;
    line.split_whitespace().nth(1).map(str::to_string).with_context(|| format!("no version in `{line}`"))
}

/// The C library the binary needs, from the newest symbol version it links (GLIBC_2.34), and
/// libgcc_s, which Rust's unwinder links.
fn depends(binary: &Path) -> anyhow::Result<String> {
    let symbols = output(Command::new("objdump").arg("-T").arg(binary))?;
    let newest = symbols
        .split_whitespace()
        // `(GLIBC_2.34)` or `GLIBC_2.34`, by binutils' version.
        .filter_map(|word| word.trim_start_matches('(').trim_end_matches(')').strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
            Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
        })
        .max()
        .context("the binary links no versioned C library symbol")?;
    Ok(format!("libc6 (>= {}.{}), libgcc-s1", newest.0, newest.1))
}

fn installed_kib(stage: &Path) -> anyhow::Result<String> {
    let du = output(Command::new("du").args(["-sk", "--exclude=DEBIAN"]).arg(stage))?;
    du.split_whitespace().next().map(str::to_string).context("du printed nothing")
}

fn write(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    fs::create_dir_all(path.parent().expect("a file in a directory"))?;
    fs::write(path, data).with_context(|| format!("writing {}", path.display()))
}
