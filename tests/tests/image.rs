//! The container image: `cargo xtask image` makes an OCI archive of the package's files that
//! skopeo reads and copies (checking every digest), named as deploy/daemonset.yaml names it, whose
//! root holds all the binary needs to run: memprof runs chrooted into it.

use std::{path::Path, process::Command};

use memprof_tests::{memprof, succeeds, xtask_package};
use serde_json::Value;

/// The blob `digest` (`sha256:HEX`) of the layout unpacked in `layout`, as JSON.
fn blob(layout: &Path, digest: &str) -> Value {
    let file = layout.join("blobs/sha256").join(digest.strip_prefix("sha256:").unwrap());
    serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap()
}

#[test]
fn the_image_is_a_valid_oci_archive_whose_memprof_runs() {
    let out = std::env::temp_dir().join(format!("memprof-image-{}", std::process::id()));
    let archive = xtask_package("image", &out);
    let archive = archive.as_str();
    let version = env!("CARGO_PKG_VERSION");
    assert!(archive.ends_with(&format!("memprof_{version}.oci.tar")), "{archive}");

    // skopeo reads it as podman would, and a copy checks each blob against its digest.
    let config: Value = serde_json::from_str(&succeeds(Command::new("skopeo").args([
        "inspect",
        "--config",
        &format!("oci-archive:{archive}"),
    ])))
    .unwrap();
    assert_eq!(config["config"]["Entrypoint"], serde_json::json!(["/usr/bin/memprof"]));
    assert_eq!(config["config"]["Cmd"], serde_json::json!(["daemon", "--config", "/etc/memprof/memprof.toml"]));
    assert_eq!(config["architecture"], "amd64");
    succeeds(
        Command::new("skopeo")
            .args(["copy", "--quiet", &format!("oci-archive:{archive}")])
            .arg(format!("dir:{}", out.join("copy").display())),
    );

    let layout = out.join("layout");
    std::fs::create_dir_all(&layout).unwrap();
    succeeds(Command::new("tar").args(["-xf", archive, "-C"]).arg(&layout));
    let index: Value = serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let entry = &index["manifests"][0];
    let name = format!("memprof:{version}");
    assert_eq!(entry["annotations"]["org.opencontainers.image.ref.name"], name.as_str());
    let daemonset =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml")).unwrap();
    assert!(daemonset.contains(&format!("image: {name}\n")), "deploy/daemonset.yaml runs another image");
    let manifest = blob(&layout, entry["digest"].as_str().unwrap());
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "{manifest}");

    // Its one layer is a root memprof runs in: the binary finds its libraries there.
    let rootfs = out.join("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    let layer =
        layout.join("blobs/sha256").join(layers[0]["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap());
    succeeds(Command::new("tar").arg("-xzf").arg(&layer).arg("-C").arg(&rootfs));
    for file in
        ["etc/memprof/memprof.toml", "usr/share/memprof/memprof.rules.yml", "usr/share/memprof/grafana-dashboard.json"]
    {
        assert!(rootfs.join(file).is_file(), "{file} is not in the image");
    }
    let inside = succeeds(Command::new("chroot").arg(&rootfs).args(["/usr/bin/memprof", "--version"]));
    assert_eq!(inside, memprof(&["--version"]).stdout, "the image holds the binary under test");
    let _ = std::fs::remove_dir_all(&out);
}
