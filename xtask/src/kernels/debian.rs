//! Debian's kernels: the newest package of a series the archive serves, downloaded and unpacked
//! into `target/kernels/<release>/` (nothing is installed into /boot).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

/// A kernel series the matrix boots, as Debian names its image packages.
pub struct Series {
    /// The series, as users know it ("6.1").
    pub name: &'static str,
    /// Who runs it, for the report.
    pub runs_it: &'static str,
    /// `apt-cache search --names-only` pattern for its image packages.
    pattern: &'static str,
    /// The package's kernel release and a key that sorts its builds oldest first, or None for a
    /// package of another flavour (cloud, rt, debug symbols, unsigned).
    parse: fn(&str) -> Option<(String, Build)>,
}

/// Sorts the builds of a series, oldest first: (patch or ABI number, Debian release it was built for).
type Build = (u32, u32);

pub const SERIES: [Series; 2] = [
    Series {
        name: "6.1",
        runs_it: "Debian 12",
        pattern: r"^linux-image-6\.1\.0-[0-9]+-amd64$",
        parse: |package| {
            let release = package.strip_prefix("linux-image-")?;
            let abi = release.strip_prefix("6.1.0-")?.strip_suffix("-amd64")?;
            Some((release.to_string(), (abi.parse().ok()?, 0)))
        },
    },
    Series {
        name: "6.12",
        runs_it: "the 6.12 LTS: Debian 13, RHEL 10",
        pattern: r"^linux-image-6\.12\.[0-9]+\+deb[0-9]+-amd64$",
        parse: |package| {
            let release = package.strip_prefix("linux-image-")?;
            let (patch, debian) = release.strip_prefix("6.12.")?.strip_suffix("-amd64")?.split_once("+deb")?;
            Some((release.to_string(), (patch.parse().ok()?, debian.parse().ok()?)))
        },
    },
];

/// An unpacked kernel package.
pub struct Kernel {
    /// `uname -r` of the kernel, as its package names it.
    pub release: String,
    pub vmlinuz: PathBuf,
}

/// The newest kernel of `series` the package lists name, unpacked under `dir` (once: an
/// unpacked release is reused). The lists are refreshed when they name none, or a package that
/// is gone from the archive.
pub fn newest(series: &Series, dir: &Path) -> anyhow::Result<Kernel> {
    match newest_release(series).and_then(|release| fetch(dir, &release)) {
        Ok(kernel) => Ok(kernel),
        Err(why) => {
            eprintln!("xtask: {why:#}; refreshing the package lists");
            crate::run("apt-get", &["update", "-q"])?;
            fetch(dir, &newest_release(series)?)
        }
    }
}

fn fetch(dir: &Path, release: &str) -> anyhow::Result<Kernel> {
    match unpacked(dir, release) {
        Some(kernel) => Ok(kernel),
        None => unpack(dir, release),
    }
}

/// The kernel release of the newest image package of `series` in the package lists.
fn newest_release(series: &Series) -> anyhow::Result<String> {
    let names = crate::output(Command::new("apt-cache").args(["search", "--names-only", series.pattern]))?;
    names
        .lines()
        .filter_map(|line| (series.parse)(line.split_whitespace().next()?))
        .max_by_key(|(_, key)| *key)
        .map(|(release, _)| release)
        .with_context(|| {
            format!(
                "the Debian archive serves no {} kernel any more (no package matches {}): update the series in \
                 xtask/src/kernels/debian.rs, and the book's kernel table (docs/src/reference/kernels.md), to what it serves now",
                series.name, series.pattern
            )
        })
}

/// The kernel of `release` if it is unpacked under `dir`.
fn unpacked(dir: &Path, release: &str) -> Option<Kernel> {
    let vmlinuz = dir.join(release).join(format!("boot/vmlinuz-{release}"));
    vmlinuz.exists().then(|| Kernel { release: release.to_string(), vmlinuz })
}

/// Downloads the image package of `release` and unpacks it into `dir/<release>` (unpacked
/// beside it first: an interrupted unpack leaves no half kernel to be reused).
fn unpack(dir: &Path, release: &str) -> anyhow::Result<Kernel> {
    let package = format!("linux-image-{release}");
    let downloads = dir.join("debs");
    fs::create_dir_all(&downloads)?;
    eprintln!("xtask: downloading {package}");
    let status = Command::new("apt-get").args(["download", "-q", &package]).current_dir(&downloads).status()?;
    if !status.success() {
        bail!("`apt-get download {package}` failed ({status})");
    }
    let deb = fs::read_dir(&downloads)?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(&format!("{package}_")) && name.ends_with(".deb"))
        })
        .with_context(|| format!("apt-get download left no {package}_*.deb in {}", downloads.display()))?;
    let partial = dir.join(format!(".{release}.partial"));
    let _ = fs::remove_dir_all(&partial);
    crate::run("dpkg-deb", &["-x", path_str(&deb)?, path_str(&partial)?])?;
    fs::rename(&partial, dir.join(release))?;
    fs::remove_file(&deb)?;
    unpacked(dir, release).with_context(|| format!("{package} holds no boot/vmlinuz-{release}"))
}

pub fn path_str(path: &Path) -> anyhow::Result<&str> {
    match path.to_str() {
        Some(text) => Ok(text),
        None => bail!("{} is not UTF-8", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::SERIES;

    #[test]
    fn image_packages_of_other_flavours_are_not_taken() {
        let [one, twelve] = &SERIES;
        assert_eq!((one.parse)("linux-image-6.1.0-56-amd64"), Some(("6.1.0-56-amd64".into(), (56, 0))));
        assert_eq!((one.parse)("linux-image-6.1.0-56-amd64-dbg"), None);
        assert_eq!((one.parse)("linux-image-6.1.0-56-cloud-amd64"), None);
        assert_eq!(
            (twelve.parse)("linux-image-6.12.117+deb12-amd64"),
            Some(("6.12.117+deb12-amd64".into(), (117, 12)))
        );
        assert_eq!((twelve.parse)("linux-image-6.12.117+deb12-rt-amd64"), None);
        assert_eq!((twelve.parse)("linux-image-6.12.117+deb12-amd64-unsigned"), None);
    }
}
