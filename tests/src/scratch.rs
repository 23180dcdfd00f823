//! Directories for a test's files, removed with all they hold when the test is done.

use std::path::{Path, PathBuf};

/// `memprof-GROUP-PID-NAME` under the temporary directory, made empty, and removed when dropped:
/// whether the test passes or panics, nothing of it is left in /tmp. Keep it alive as long as
/// anything uses a path in it (a daemon reading its config, a browser its profile).
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(group: &str, name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("memprof-{group}-{}-{name}", std::process::id()));
        // What an earlier process of the same pid left would pass for this test's files.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.0.join(name)
    }

    /// The path of `name` in the directory, as a command's argument.
    pub fn file(&self, name: &str) -> String {
        self.join(name).to_str().expect("a UTF-8 path").to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
