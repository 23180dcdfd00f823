//! Headless Chromium, for the tests that open memprof's HTML as a user's browser does.

use std::{
    process::Command,
    sync::atomic::{AtomicUsize, Ordering},
};

use crate::Scratch;

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

/// A fresh Chromium profile directory, removed when dropped.
pub fn chromium_profile() -> Scratch {
    static PROFILES: AtomicUsize = AtomicUsize::new(0);
    Scratch::new("chromium", &PROFILES.fetch_add(1, Ordering::Relaxed).to_string())
}

/// `chromium` with its profile in `profile`, and its temporary directory too: Chromium makes an
/// `org.chromium.Chromium.*` directory for its singleton socket under $TMPDIR and leaves it
/// behind, where it now goes with the profile.
pub fn command(profile: &Scratch) -> Command {
    let mut command = Command::new("chromium");
    command.arg(format!("--user-data-dir={}", profile.path().display())).env("TMPDIR", profile.path());
    command
}

/// Headless Chromium with `args` in a fresh profile: its stdout.
pub fn chromium(args: &[&str]) -> String {
    let profile = chromium_profile();
    let output = command(&profile)
        .args(CHROMIUM)
        .args(args)
        .output()
        .expect("starting chromium (installed by `cargo xtask setup`)");
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
