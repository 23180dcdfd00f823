//! Booting a kernel with virtme-ng over this machine's root file system, under QEMU's software
//! emulation: this machine's KVM is paravirtual and cannot run a stock kernel.
//!
//! The guest sees the host's files read-only, except the directories passed to it. It prints
//! nothing to the host's terminal unless vng runs verbose, and vng's exit code is not the guest
//! script's (it returned 255 for Debian's kernels with the script done), so everything the guest
//! has to say it writes into files.

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::debian::path_str;

/// The version verified to boot Debian's kernels here.
const VIRTME_NG: &str = "virtme-ng==1.42";

/// vng, installed once into a virtual environment of Debian's own Python (whatever Python comes
/// first on PATH, pyenv's say): its scripts call each other by name, so it runs with the
/// environment's bin directory first on PATH.
pub fn vng() -> anyhow::Result<PathBuf> {
    let venv = PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache/memprof/virtme-ng");
    let vng = venv.join("bin/vng");
    let works = Command::new(&vng).arg("--version").output().is_ok_and(|out| out.status.success());
    if !works {
        eprintln!("xtask: installing {VIRTME_NG} into {}", venv.display());
        crate::run("/usr/bin/python3", &["-m", "venv", path_str(&venv)?])?;
        crate::run(path_str(&venv.join("bin/pip"))?, &["install", "-q", VIRTME_NG])?;
    }
    Ok(vng)
}

/// One boot of `vmlinuz` running `script`.
pub struct Boot<'a> {
    pub vng: &'a Path,
    pub vmlinuz: &'a Path,
    /// Shared with the guest, writable: the script's results.
    pub out: &'a Path,
    /// Writable in the guest, their writes kept from the host (the test fixtures' build
    /// directories).
    pub scratch: &'a [PathBuf],
    /// Run in the guest as root.
    pub script: &'a Path,
    /// The boot is killed after this long.
    pub limit: Duration,
}

impl Boot<'_> {
    /// Boots, runs the script and waits for the machine to end; what vng printed goes into
    /// `out/vng.log`. Returns whether the machine ended within the limit.
    pub fn run(&self) -> anyhow::Result<bool> {
        let log = std::fs::File::create(self.out.join("vng.log"))?;
        let bin = self.vng.parent().context("vng is in a directory")?;
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        let mut vng = Command::new(self.vng)
            .arg("--run")
            .arg(self.vmlinuz)
            // A single emulated CPU: the matrix boots its kernels side by side, one per core.
            .args(["--disable-kvm", "--qemu-opts=-cpu max", "--cpus", "1", "--memory", "3G"])
            .arg(format!("--rwdir={}", self.out.display()))
            .args(self.scratch.iter().map(|dir| format!("--overlay-rwdir={}", dir.display())))
            .arg("--exec")
            .arg(self.script)
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Its own process group, so that QEMU goes with vng when the limit is reached.
            .process_group(0)
            .spawn()
            .context("starting vng")?;
        let deadline = Instant::now() + self.limit;
        while vng.try_wait()?.is_none() {
            if Instant::now() > deadline {
                // SAFETY: signals the process group of our own child, which is still running.
                unsafe { libc::kill(-(vng.id() as i32), libc::SIGKILL) };
                vng.wait()?;
                return Ok(false);
            }
            thread::sleep(Duration::from_millis(500));
        }
        Ok(true)
    }
}
