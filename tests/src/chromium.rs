//! Headless Chromium, for the tests that open memprof's HTML as a user's browser does.

use std::{
    path::PathBuf,
    process::Command,
    sync::atomic::{AtomicUsize, Ordering},
};

/// Headless Chromium as root, with no network of its own.
pub const CHROMIUM: [&str; 8] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
];

/// A fresh Chromium profile directory.
pub fn chromium_profile() -> PathBuf {
    static PROFILES: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "memprof-chromium-{}-{}",
        std::process::id(),
        PROFILES.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Headless Chromium with `args` in a fresh profile: its stdout.
pub fn chromium(args: &[&str]) -> String {
    let profile = chromium_profile();
    let output = Command::new("chromium")
        .args(CHROMIUM)
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("starting chromium (installed by `cargo xtask setup`)");
    let _ = std::fs::remove_dir_all(&profile);
    assert!(output.status.success(), "chromium failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

/// The DOM of `url` after its scripts ran.
pub fn dom(url: &str) -> String {
    chromium(&["--dump-dom", url])
}

/// The serialized element `<section id="ID">`.
pub fn section<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom.find(&format!("<section id=\"{id}\">")).unwrap_or_else(|| panic!("no section {id}: {dom}"));
    let end = dom[start..].find("</section>").unwrap();
    &dom[start..start + end]
}
