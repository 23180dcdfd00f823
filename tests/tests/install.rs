//! The Debian package: `cargo xtask deb` makes it from the binary under test, `dpkg -i` installs
//! it, the installed memprof traces a process exactly, and `dpkg --purge` takes it all away.

use std::{path::Path, process::Command};

use memprof_tests::{attach_with, fixture, memprof, memprof_bin, site, total, Waiting};

/// What the package installs, beside the binary.
const FILES: [&str; 5] = [
    "/lib/systemd/system/memprof.service",
    "/etc/memprof/memprof.toml",
    "/usr/share/man/man1/memprof-attach.1.gz",
    "/usr/share/bash-completion/completions/memprof",
    "/usr/share/doc/memprof/LICENSE-APACHE",
];

fn succeeds(command: &mut Command) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
    assert!(out.status.success(), "{command:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_deb_installs_a_working_memprof_and_removes_it() {
    let out = std::env::temp_dir().join(format!("memprof-deb-{}", std::process::id()));
    // The binary under test, packaged as it is: not built again.
    let deb = succeeds(
        Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .args(["xtask", "deb", "--out"])
            .arg(&out)
            .env("MEMPROF_BIN", memprof_bin()),
    );
    let deb = deb.trim();
    assert!(deb.ends_with(".deb"), "{deb}");
    // Without man-db's trigger, which rebuilds its index of every page (40 s on a busy 2-core
    // machine): dpkg leaves it pending for the next run, and `man` finds pages without it.
    succeeds(Command::new("dpkg").args(["--no-triggers", "-i", deb]));

    let installed = Path::new("/usr/bin/memprof");
    let version = succeeds(Command::new(installed).arg("--version"));
    assert_eq!(version, memprof(&["--version"]).stdout, "the package holds the binary under test");
    let sections = succeeds(Command::new("readelf").args(["-S", "-W"]).arg(installed));
    assert!(!sections.contains(".debug_info") && !sections.contains(".symtab"), "stripped: {sections}");
    for file in FILES {
        assert!(Path::new(file).exists(), "{file} is not installed");
    }
    let unit = std::fs::read_to_string(FILES[0]).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/memprof daemon --config /etc/memprof/memprof.toml"), "{unit}");
    let page = succeeds(Command::new("man").args(["-P", "cat", "memprof-attach"]).env("MANWIDTH", "100"));
    assert!(page.contains("-p, --pid"), "{page}");

    let mut target = Waiting::start(&fixture("lifecycle"), &["prior"]);
    let pid = target.pid();
    let outcome = attach_with(Command::new(installed), &mut target, pid, &["--duration", "2"]);

    succeeds(Command::new("dpkg").args(["--no-triggers", "--purge", "memprof"]));
    let _ = std::fs::remove_dir_all(&out);
    assert!(!installed.exists() && FILES.iter().all(|f| !Path::new(f).exists()), "dpkg --purge left files behind");

    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "after_attach"), (320, 10), "{report}");
    assert_eq!(total(&report, "unknown_frees"), 100);
}
