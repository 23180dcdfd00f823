//! `cargo xtask man` and `cargo xtask deb`: the man pages, and a Debian package holding the
//! stripped binary, the systemd unit, the config, the man pages, shell completions, the alerting
//! rules and the Grafana dashboard, with maintainer scripts (deploy/debian) that start nothing on
//! install and restart a running daemon on upgrade. Lintian finds no error in it
//! (tests/tests/install.rs).
//!
//! Both take the binary in `MEMPROF_BIN` when it is set (the tests do: the package is made from
//! the binary under test, never rebuilt), else build the release binary.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
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
    let deb = build_deb(&out_dir(args, "target/deb")?)?;
    // Its path alone on stdout, for scripts (dpkg-deb's line went to stderr).
    println!("{}", deb.display());
    Ok(())
}

/// The package, built into `out`: its path.
pub fn build_deb(out: &Path) -> anyhow::Result<PathBuf> {
    let binary = binary()?;
    let stage = out.join("staging");
    let _ = fs::remove_dir_all(&stage);
    let version = version(&binary)?;
    let arch = output(Command::new("dpkg").arg("--print-architecture"))?;

    let bin = stage.join("usr/bin/memprof");
    fs::create_dir_all(bin.parent().expect("a directory"))?;
    // Stripped of debug info, symbols and the compilers' names (.comment), which nothing reads.
    run_with(Command::new("objcopy").args(["--strip-all", "--remove-section=.comment"]).arg(&binary).arg(&bin))?;

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
    // For Prometheus and Grafana to load: memprof reads neither.
    for file in ["memprof.rules.yml", "grafana-dashboard.json"] {
        write(&stage.join("usr/share/memprof").join(file), &fs::read(root().join("deploy").join(file))?)?;
    }
    let doc = stage.join("usr/share/doc/memprof");
    for license in ["LICENSE-MIT", "LICENSE-APACHE"] {
        write(&doc.join(license), &fs::read(root().join(license))?)?;
    }
    write(&doc.join("copyright"), copyright()?.as_bytes())?;
    let changelog = doc.join("changelog");
    write(&changelog, changelog_entry(&version, &binary)?.as_bytes())?;
    run_with(Command::new("gzip").args(["-9", "-n"]).arg(&changelog))?;

    let control = format!(
        "Package: memprof\nVersion: {version}\nArchitecture: {arch}\nMaintainer: {MAINTAINER}\n\
         Depends: {}\nSection: devel\nPriority: optional\nInstalled-Size: {}\n\
         Description: eBPF heap profiler for running processes\n \
         memprof puts uprobes on the allocators of running processes and reports\n \
         which call stacks hold how much memory, leak candidates and double frees,\n \
         as tables, JSON, pprof, flame graphs and HTML, or as Prometheus metrics\n \
         from its daemon (memprof.service).\n",
        depends(&binary)?,
        installed_kib(&stage)?,
    );
    // Checksums of every file, for debsums and `dpkg --verify`; written before DEBIAN/ has
    // anything else, which must not be in them.
    let md5sums = output(
        Command::new("sh")
            .arg("-c")
            .arg("find . -type f -printf '%P\\0' | LC_ALL=C sort -z | xargs -0 md5sum")
            .current_dir(&stage),
    )?;
    write(&stage.join("DEBIAN/md5sums"), format!("{md5sums}\n").as_bytes())?;
    write(&stage.join("DEBIAN/control"), control.as_bytes())?;
    write(&stage.join("DEBIAN/conffiles"), b"/etc/memprof/memprof.toml\n")?;
    for script in ["postinst", "prerm", "postrm"] {
        let path = stage.join("DEBIAN").join(script);
        write(&path, &fs::read(root().join("deploy/debian").join(script))?)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
    }

    let deb = out.join(format!("memprof_{version}_{arch}.deb"));
    // Its "building package" line to stderr: `deb` prints the package's path alone on stdout.
    run_with(
        Command::new("dpkg-deb")
            // gzip: far faster than xz on a busy 2-core machine, for a somewhat larger package
            // (docs: performance.md#measurements-behind-design-choices).
            .args(["--root-owner-group", "-Zgzip", "--build"])
            .arg(&stage)
            .arg(&deb)
            .stdout(std::io::stderr()),
    )?;
    fs::remove_dir_all(&stage)?;
    Ok(deb)
}

/// The package's maintainer: the name and address the project's commits carry.
const MAINTAINER: &str = "memprof maintainers <maintainers@users.noreply.a-seed-6193dea8.example>";

/// debian/copyright in Debian's machine-readable format, with the MIT license's text and the
/// Apache license's in /usr/share/common-licenses.
fn copyright() -> anyhow::Result<String> {
    let mit = fs::read_to_string(root().join("LICENSE-MIT"))?;
    let (notice, terms) = mit.split_once("\n\n").context("LICENSE-MIT: a copyright line, then the terms")?;
    let notice = notice.trim_start_matches("Copyright (c) ");
    // A license's text is a field's continuation: each line indented, an empty one as " .".
    let terms: String =
        terms.lines().map(|line| if line.is_empty() { " .\n".to_string() } else { format!(" {line}\n") }).collect();
    Ok(format!(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\
         Upstream-Name: memprof\n\
         Comment: The binary holds the Rust crates it is built from, linked statically, each\n \
         under its own license (MIT, Apache-2.0, ISC, BSD, Zlib, CDDL-1.0, Unicode-3.0):\n \
         `cargo tree -p profiler-daemon -e normal -f '{{p}} {{l}}'` in the source lists them.\n\
         \n\
         Files: *\n\
         Copyright: {notice}\n\
         License: MIT or Apache-2.0\n\
         \n\
         License: MIT\n{terms}\
         \n\
         License: Apache-2.0\n \
         On Debian systems the full text of the Apache License 2.0 is in\n \
         /usr/share/common-licenses/Apache-2.0, and in LICENSE-APACHE beside this file.\n"
    ))
}

/// The changelog of a native package: one entry, for this version, naming the commit the binary
/// was built from and dated by it (one binary makes one package whenever it is packaged); now
/// when git does not know the commit.
fn changelog_entry(version: &str, binary: &Path) -> anyhow::Result<String> {
    let line = output(Command::new(binary).arg("--version"))?;
    // `memprof 0.1.0 (commit 47f957810fb6)`.
    let commit = line.rsplit_once("(commit ").map(|(_, rest)| rest.trim_end_matches(')')).unwrap_or("HEAD");
    let date = output(Command::new("git").args(["log", "-1", "--format=%cD", commit, "--"]).current_dir(root()))
        .or_else(|_| output(Command::new("date").arg("-R")))?;
    Ok(format!("memprof ({version}) unstable; urgency=medium\n\n  * {line}.\n\n -- {MAINTAINER}  {date}\n"))
}

/// `MEMPROF_BIN`, or the release binary, built.
pub fn binary() -> anyhow::Result<PathBuf> {
    match std::env::var_os("MEMPROF_BIN") {
        Some(bin) => Ok(PathBuf::from(bin)),
        None => build_memprof(),
    }
}

pub fn out_dir(args: &[String], default: &str) -> anyhow::Result<PathBuf> {
    let out = match args {
        [] => root().join(default),
        [flag, dir] if flag == "--out" => PathBuf::from(dir),
        _ => bail!("usage: cargo xtask man|deb|image [--out DIR]"),
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
