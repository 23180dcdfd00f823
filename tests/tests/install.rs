//! The Debian package: `cargo xtask deb` makes it from the binary under test, lintian finds no
//! error in it, `dpkg -i` installs it, the installed memprof traces a process exactly, its
//! maintainer scripts start nothing on install, restart a running daemon on upgrade and stop it on
//! remove, and `dpkg --purge` takes it all away.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use memprof_tests::{attach_with, fixture, memprof, site, succeeds, total, xtask_package, Waiting};

/// What the package installs, beside the binary.
const FILES: [&str; 8] = [
    "/lib/systemd/system/memprof.service",
    "/etc/memprof/memprof.toml",
    "/usr/share/man/man1/memprof-attach.1.gz",
    "/usr/share/bash-completion/completions/memprof",
    "/usr/share/doc/memprof/LICENSE-APACHE",
    "/usr/share/doc/memprof/changelog.gz",
    "/usr/share/memprof/memprof.rules.yml",
    "/usr/share/memprof/grafana-dashboard.json",
];

/// `cargo xtask deb` into a directory of the test's own: the package's path and the directory.
fn build_deb(test: &str) -> (String, PathBuf) {
    let out = std::env::temp_dir().join(format!("memprof-deb-{test}-{}", std::process::id()));
    // The binary under test, packaged as it is: not built again.
    let deb = xtask_package("deb", &out);
    assert!(deb.ends_with(".deb"), "{deb}");
    (deb, out)
}

#[test]
fn the_deb_installs_a_working_memprof_and_removes_it() {
    let (deb, out) = build_deb("install");
    let deb = deb.as_str();
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

/// Debian's own checker finds no error (its warnings are printed for whoever reads the log), and
/// the package ships the alerting rules and the dashboard as they are in deploy/, with its
/// maintainer scripts.
#[test]
fn the_deb_is_lintian_clean_and_ships_rules_dashboard_and_maintainer_scripts() {
    let (deb, out) = build_deb("lintian");
    let lintian = Command::new("lintian")
        .args(["--no-tag-display-limit", &deb])
        .output()
        .expect("lintian (cargo xtask setup installs it)");
    let tags = String::from_utf8_lossy(&lintian.stdout);
    eprintln!("lintian:\n{tags}{}", String::from_utf8_lossy(&lintian.stderr));
    assert!(!tags.lines().any(|line| line.starts_with("E:")), "lintian errors:\n{tags}");
    assert!(lintian.status.success(), "lintian: {}", lintian.status);

    let contents = succeeds(Command::new("dpkg-deb").args(["-c", &deb]));
    let unpacked = out.join("unpacked");
    succeeds(Command::new("dpkg-deb").args(["-x", &deb]).arg(&unpacked));
    for (shipped, source) in [
        ("usr/share/memprof/memprof.rules.yml", "memprof.rules.yml"),
        ("usr/share/memprof/grafana-dashboard.json", "grafana-dashboard.json"),
    ] {
        assert!(contents.contains(&format!("./{shipped}\n")), "{shipped} is not in the package:\n{contents}");
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(source);
        assert_eq!(std::fs::read(unpacked.join(shipped)).unwrap(), std::fs::read(repo).unwrap(), "{shipped}");
    }
    let info = succeeds(Command::new("dpkg-deb").args(["-I", &deb]));
    for script in ["postinst", "prerm", "postrm", "md5sums", "conffiles"] {
        assert!(info.lines().any(|line| line.split_whitespace().any(|word| word == script)), "no {script}:\n{info}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The maintainer scripts, run as dpkg runs them, in a mount namespace of their own where
/// /run/systemd/system exists (systemd is running, as far as they can tell), with systemctl and
/// the deb-systemd helpers replaced by stand-ins that log their arguments: what would each step
/// do to the service?
#[test]
fn the_maintainer_scripts_start_nothing_restart_on_upgrade_and_stop_on_remove() {
    let (deb, out) = build_deb("scripts");
    let control = out.join("control");
    succeeds(Command::new("dpkg-deb").args(["-e", &deb]).arg(&control));
    let stubs = out.join("stubs");
    std::fs::create_dir_all(&stubs).unwrap();
    let log = out.join("calls.log");
    // The helper's questions (was the unit installed or enabled before?) answered no, as on a
    // first install; the rest of its work and systemd's succeed.
    for (tool, answer) in [
        ("systemctl", ""),
        ("deb-systemd-invoke", ""),
        ("deb-systemd-helper", "case $1 in debian-installed|--quiet) exit 1;; esac\n"),
    ] {
        let stub = stubs.join(tool);
        std::fs::write(&stub, format!("#!/bin/sh\necho \"{tool} $*\" >> '{}'\n{answer}", log.display())).unwrap();
        std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = format!("{}:{}", stubs.display(), std::env::var("PATH").unwrap_or_default());
    // What one script, called with dpkg's arguments, asked of systemd and its helpers.
    let calls = |script: &str, args: &[&str]| -> Vec<String> {
        let _ = std::fs::remove_file(&log);
        let run = "mount -t tmpfs memprof-test /run && mkdir -p /run/systemd/system && exec \"$0\" \"$@\"";
        succeeds(
            Command::new("unshare")
                .args(["--mount", "sh", "-c", run])
                .arg(control.join(script))
                .args(args)
                .env("PATH", &path)
                .env_remove("DPKG_ROOT"),
        );
        std::fs::read_to_string(&log).unwrap_or_default().lines().map(str::to_string).collect()
    };
    let invoked = |calls: &[String]| -> Vec<String> {
        calls.iter().filter(|call| call.starts_with("deb-systemd-invoke")).cloned().collect()
    };

    // A first install: the unit known to systemd, not enabled, not started.
    let install = calls("postinst", &["configure"]);
    assert!(install.contains(&"systemctl --system daemon-reload".to_string()), "{install:?}");
    assert!(!install.contains(&"deb-systemd-helper enable memprof.service".to_string()), "{install:?}");
    assert_eq!(invoked(&install), Vec::<String>::new(), "a first install starts nothing");
    // An upgrade from 0.0.9: restarted if it was running (try-restart leaves a stopped one be).
    let upgrade = calls("postinst", &["configure", "0.0.9"]);
    assert_eq!(invoked(&upgrade), ["deb-systemd-invoke try-restart memprof.service"], "{upgrade:?}");
    // The old package's prerm before an upgrade leaves the daemon running; a removal stops it.
    assert_eq!(invoked(&calls("prerm", &["upgrade", "0.1.1"])), Vec::<String>::new());
    assert_eq!(invoked(&calls("prerm", &["remove"])), ["deb-systemd-invoke stop memprof.service"]);
    assert_eq!(calls("postrm", &["remove"]), ["systemctl --system daemon-reload"]);
    assert!(calls("postrm", &["purge"]).contains(&"deb-systemd-helper purge memprof.service".to_string()));
    let _ = std::fs::remove_dir_all(&out);
}
