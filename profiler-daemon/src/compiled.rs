//! C programs compiled for a unit test, and the commands it runs on them.

use std::{fs, path::PathBuf, process::Command};

/// `command`'s standard output; the test fails if it does.
pub fn run(command: &mut Command) -> String {
    let output = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(output.status.success(), "{command:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

/// A binary compiled for one test, deleted with its directory when dropped.
pub struct Binary {
    pub dir: PathBuf,
    pub path: PathBuf,
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Compiles `source` with `cc` and `flags` in a directory of its own, named after `test`.
pub fn compile(test: &str, source: &str, flags: &[&str]) -> Binary {
    let dir = std::env::temp_dir().join(format!("memprof-compiled-{}-{test}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let binary = Binary { path: dir.join("fixture"), dir };
    fs::write(binary.dir.join("fixture.c"), source).unwrap();
    run(Command::new("cc").args(flags).arg(binary.dir.join("fixture.c")).arg("-o").arg(&binary.path));
    binary
}
