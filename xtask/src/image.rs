//! `cargo xtask image`: memprof's container image, `memprof:VERSION`, as an OCI archive that
//! `podman load`, `skopeo copy oci-archive:...` and containerd's `ctr images import` take.
//!
//! No base image can be fetched here (only package registries are reachable), so the image is
//! one layer made by hand: the .deb's files, and the shared libraries its binary loads (the C
//! library, libgcc_s and the dynamic linker), copied from this Debian system. Nothing else: no
//! shell, no package manager. Files, times and owners are fixed, so one binary, on one build
//! machine, makes one image, digest for digest.

use std::{fs, path::Path, process::Command};

use anyhow::Context as _;
use serde_json::json;

use crate::{output, package, run_with};

/// `cargo xtask image [--out DIR]`: DIR/memprof_VERSION.oci.tar (default DIR: target/image).
pub fn image(args: &[String]) -> anyhow::Result<()> {
    let out = package::out_dir(args, "target/image")?;
    let deb = package::build_deb(&out)?;
    let work = out.join("work");
    let _ = fs::remove_dir_all(&work);
    let rootfs = work.join("rootfs");
    fs::create_dir_all(&rootfs)?;
    run_with(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&rootfs))?;
    let version = output(Command::new("dpkg-deb").arg("-f").arg(&deb).arg("Version"))?;
    fs::remove_file(&deb)?;
    shared_libraries(&rootfs)?;
    // The API's socket directory, where the DaemonSet mounts an emptyDir.
    fs::create_dir_all(rootfs.join("run/memprof"))?;

    let layout = work.join("layout");
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs)?;
    let layer_tar = work.join("layer.tar");
    run_with(
        Command::new("tar")
            .args(["--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner", "-cf"])
            .arg(&layer_tar)
            .arg("-C")
            .arg(&rootfs)
            .arg("."),
    )?;
    let diff_id = sha256(&layer_tar)?;
    run_with(Command::new("gzip").args(["-9", "-n"]).arg(&layer_tar))?;
    let layer = blob(&blobs, &fs::read(work.join("layer.tar.gz"))?)?;

    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "Entrypoint": ["/usr/bin/memprof"],
            "Cmd": ["daemon", "--config", "/etc/memprof/memprof.toml"],
            "ExposedPorts": {"9464/tcp": {}},
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
    });
    let config = blob(&blobs, &serde_json::to_vec(&config)?)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", &config),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar+gzip", &layer)],
    });
    let manifest = blob(&blobs, &serde_json::to_vec(&manifest)?)?;
    let name = format!("memprof:{version}");
    let mut entry = descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
    // The name podman gives the image it loads, and containerd's.
    entry["annotations"] = json!({"org.opencontainers.image.ref.name": name, "io.containerd.image.name": name});
    let index =
        json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [entry]});
    fs::write(layout.join("index.json"), serde_json::to_vec(&index)?)?;
    fs::write(layout.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;

    let archive = out.join(format!("memprof_{version}.oci.tar"));
    run_with(
        Command::new("tar")
            .args(["--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner", "-cf"])
            .arg(&archive)
            .arg("-C")
            .arg(&layout)
            .arg("."),
    )?;
    fs::remove_dir_all(&work)?;
    eprintln!(
        "xtask: image {name} in {} (podman load -i, or skopeo copy oci-archive:FILE docker://REGISTRY/{name})",
        archive.display()
    );
    println!("{}", archive.display());
    Ok(())
}

/// Copies into `rootfs` each shared library memprof loads, at the path the dynamic linker finds
/// it at (ldd's answer for this system).
fn shared_libraries(rootfs: &Path) -> anyhow::Result<()> {
    let ldd = output(Command::new("ldd").arg(rootfs.join("usr/bin/memprof")))?;
    for line in ldd.lines() {
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or `/lib64/ld-linux-x86-64.so.2 (0x...)`;
        // linux-vdso is the kernel's, in no file.
        let Some(path) = line.split_whitespace().find(|word| word.starts_with('/')) else { continue };
        let inside = rootfs.join(path.trim_start_matches('/'));
        fs::create_dir_all(inside.parent().context("a library in a directory")?)?;
        // The file itself, not the symlink the path may be.
        fs::copy(fs::canonicalize(path)?, &inside).with_context(|| format!("copying {path}"))?;
    }
    Ok(())
}

/// A blob of the layout, by its digest.
struct Blob {
    digest: String,
    size: usize,
}

fn blob(blobs: &Path, data: &[u8]) -> anyhow::Result<Blob> {
    let file = blobs.join("incoming");
    fs::write(&file, data)?;
    let digest = sha256(&file)?;
    fs::rename(&file, blobs.join(&digest))?;
    Ok(Blob { digest, size: data.len() })
}

fn descriptor(media_type: &str, blob: &Blob) -> serde_json::Value {
    json!({"mediaType": media_type, "digest": format!("sha256:{}", blob.digest), "size": blob.size})
}

fn sha256(file: &Path) -> anyhow::Result<String> {
    let sum = output(Command::new("sha256sum").arg(file))?;
    sum.split_whitespace().next().map(str::to_string).context("sha256sum printed nothing")
}
