//! Debian's PostgreSQL 15 under `memprof attach --follow-forks`: the postmaster forks a backend
//! per session, which memprof follows (or counts missed), named and symbolized.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use memprof_tests::{free_port, memprof_bin, released};

const BIN: &str = "/usr/lib/postgresql/15/bin";
const SESSIONS: u64 = 5;

/// A private cluster in a directory of its own, run by user postgres; stopped and removed when
/// dropped.
struct Cluster {
    dir: PathBuf,
    port: u16,
}

/// Runs `command` as user postgres; panics with its output when it fails.
fn as_postgres(command: &str) -> String {
    let output = Command::new("su").args(["postgres", "-c", command]).output().expect("starting su");
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "`{command}` failed: {text}");
    text
}

impl Cluster {
    fn start() -> Self {
        assert!(Path::new(BIN).join("initdb").exists(), "PostgreSQL 15 is missing: run `cargo xtask setup`");
        let dir = std::env::temp_dir().join(format!("memprof-postgres-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the cluster's directory");
        let status = Command::new("chown").arg("postgres").arg(&dir).status().expect("starting chown");
        assert!(status.success(), "chown postgres {}", dir.display());
        let cluster = Self { dir, port: free_port() };
        let data = cluster.dir.join("data");
        as_postgres(&format!("{BIN}/initdb -D {} -A trust", data.display()));
        // No forks but the sessions': no autovacuum workers, no parallel query workers.
        let options = format!(
            "-p {} -k {} -c listen_addresses= -c autovacuum=off -c max_parallel_workers_per_gather=0",
            cluster.port,
            cluster.dir.display()
        );
        as_postgres(&format!(
            "{BIN}/pg_ctl -D {} -o '{options}' -l {}/log -w start",
            data.display(),
            cluster.dir.display()
        ));
        cluster
    }

    fn postmaster(&self) -> u32 {
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).expect("reading postmaster.pid");
        pid.lines().next().and_then(|line| line.trim().parse().ok()).expect("a pid in postmaster.pid")
    }

    /// One session: connects, sleeps a moment, allocates in the backend, disconnects.
    fn session(&self, n: u64) {
        let sql = format!(
            "select pg_sleep(0.3); select length(repeat(chr(120), 3000000)); \
             create temp table t{n} as select g from generate_series(1, 1000) g;"
        );
        as_postgres(&format!("psql -h {} -p {} -d postgres -qAt -c \"{sql}\"", self.dir.display(), self.port));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = Command::new("su")
            .args(["postgres", "-c", &format!("{BIN}/pg_ctl -D {} -m immediate stop", data.display())])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn every_postgres_session_is_followed_or_counted_and_each_backend_is_named_and_symbolized() {
    let cluster = Cluster::start();
    let postmaster = cluster.postmaster();
    let pid = postmaster.to_string();
    // At default settings: the unwind tables grow to postgres's 42 libraries.
    let mut memprof = Command::new(memprof_bin());
    memprof
        .args(["attach", "--pid", &pid, "--max-rate", "off", "--follow-forks", "--json", "--interval", "1"])
        .stdin(Stdio::null());
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |memprof| {
        for n in 0..SESSIONS {
            cluster.session(n);
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(memprof.id() as i32, libc::SIGINT) };
    });
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();

    let forks = &report["forks"];
    let (followed, missed) = (forks["followed"].as_u64().unwrap(), forks["missed"].as_u64().unwrap());
    // The checkpointer, the background writer, the WAL writer and the launchers were there
    // before memprof: followed from the attach.
    let at_attach = forks["at_attach"].as_u64().unwrap();
    assert!(at_attach >= 4, "postgres's background processes are followed: {forks}");
    assert_eq!(
        followed + missed,
        SESSIONS + at_attach,
        "every session's backend is followed or counted missed: {forks}"
    );
    assert!(followed > 0, "{forks}\n{}", outcome.stderr);
    let children = report["children"].as_array().expect("children");
    assert_eq!(children.len() as u64, followed, "{forks}");
    for child in children {
        assert_eq!(child["comm"], "postgres", "named by its comm: {child}");
        assert_eq!(child["parent"], postmaster, "{child}");
        assert_eq!(child["exe"], format!("{BIN}/postgres"), "{child}");
        for frame in child["stacks"].as_array().expect("stacks").iter().flat_map(|s| s["frames"].as_array().unwrap()) {
            // Debian's postgres has no symbols for its static functions (`postgres+0x...`): the
            // file is what a stripped binary's frame can be symbolized to.
            assert_ne!(frame["module"], "[anonymous]", "every frame is in a file the child mapped: {child}");
        }
    }
}
