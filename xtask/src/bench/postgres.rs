//! A second real service: Debian's PostgreSQL 15 under `pgbench -C -S` (a new session for each
//! select-only transaction, 4 clients), untraced and under `memprof attach --follow-forks` on its
//! postmaster in each mode: every session is a backend forked, traced from its fork, that fills
//! its caches with many allocations. heaptrack has no row: it follows one process.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

use super::services::{attach, load_average, median};
use super::Size;

const BIN: &str = "/usr/lib/postgresql/15/bin";
/// The bench's cluster listens on a Unix socket only, in its own directory, on this port number.
const PORT: &str = "5499";

const MODES: [(&str, Option<&[&str]>); 4] = [
    ("none", None),
    ("memprof attach --follow-forks --max-rate off (exact)", Some(&["--max-rate", "off"])),
    ("memprof attach --follow-forks --sample-bytes 524288", Some(&["--sample-bytes", "524288"])),
    ("memprof attach --follow-forks --growth", Some(&["--growth"])),
];

pub struct Measured {
    /// Transactions a second, each mode's runs in order.
    runs: Vec<Vec<f64>>,
    seconds: u64,
    /// When, as `date -u` prints it, and the load average before and after.
    date: String,
    load: (String, String),
}

/// A cluster of its own, run by user postgres; stopped when dropped.
struct Cluster {
    dir: PathBuf,
}

impl Cluster {
    fn start(parent: &Path) -> anyhow::Result<Self> {
        let dir = parent.join("postgres");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        run("chown", &["postgres", &dir.display().to_string()])?;
        let data = dir.join("data");
        let cluster = Self { dir };
        as_postgres(&format!("{BIN}/initdb -D {} -A trust", data.display()))?;
        // CPU-bound: what memprof adds is not hidden behind the disk.
        as_postgres(&format!(
            "{BIN}/pg_ctl -D {} -w -l {}/log -o \"-k {} -p {PORT} -c listen_addresses='' -c fsync=off -c synchronous_commit=off\" start",
            data.display(),
            cluster.dir.display(),
            cluster.dir.display()
        ))?;
        as_postgres(&format!("pgbench -h {} -p {PORT} -q -i -s 10 postgres", cluster.dir.display()))?;
        Ok(cluster)
    }

    /// The postmaster's pid, the first line of its pid file.
    fn postmaster(&self) -> anyhow::Result<u32> {
        let text = std::fs::read_to_string(self.dir.join("data/postmaster.pid"))?;
        text.lines().next().and_then(|line| line.trim().parse().ok()).context("postmaster.pid has no pid")
    }

    /// Select-only transactions a second over `seconds`, each in a session of its own, from 4
    /// clients on 2 threads.
    fn pgbench(&self, seconds: u64) -> anyhow::Result<f64> {
        let text =
            as_postgres(&format!("pgbench -h {} -p {PORT} -C -c 4 -j 2 -S -T {seconds} postgres", self.dir.display()))?;
        text.lines()
            .find_map(|line| line.strip_prefix("tps = ")?.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("pgbench printed no tps: {text}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = as_postgres(&format!("{BIN}/pg_ctl -D {} -m immediate stop", data.display()));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program).args(args).output().with_context(|| format!("starting {program}"))?;
    if !output.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn as_postgres(command: &str) -> anyhow::Result<String> {
    run("su", &["postgres", "-c", command])
}

/// Interleaved runs of every mode on one cluster: A B C D A B C D ...
pub fn measure(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<Measured> {
    let seconds = if size.quick { 3 } else { 15 };
    let cluster = Cluster::start(dir).context("starting a PostgreSQL cluster")?;
    let date = run("date", &["-u", "+%Y-%m-%d %H:%M UTC"])?.trim().to_string();
    let load_before = load_average();
    let mut runs = vec![Vec::new(); MODES.len()];
    for _ in 0..size.runs {
        for ((name, options), runs) in MODES.iter().zip(&mut runs) {
            let tracer = match options {
                Some(options) => {
                    let all: Vec<&str> = ["--follow-forks"].iter().chain(options.iter()).copied().collect();
                    Some(attach(memprof, cluster.postmaster()?, &all)?)
                }
                None => None,
            };
            let tps = cluster.pgbench(seconds).with_context(|| format!("pgbench under {name}"))?;
            if let Some(tracer) = tracer {
                tracer.stop()?;
            }
            eprintln!("xtask bench: pgbench -S under {name:<52} {tps:>9.0} tps");
            runs.push(tps);
        }
    }
    Ok(Measured { runs, seconds, date, load: (load_before, load_average()) })
}

pub fn render(measured: &Measured) -> String {
    let mut out = format!(
        "\nDebian's PostgreSQL 15 (glibc) under `pgbench -C -S -c 4 -j 2 -T {}` (a new session, so a \
         backend forked, for each select-only transaction; fsync off), `memprof attach --follow-forks` \
         on its postmaster. The modes' runs interleaved, {} rounds; the median of each. Measured {}, \
         load average {} before, {} after. heaptrack has no row: it follows one process, and each \
         session has a backend of its own.\n\n",
        measured.seconds,
        measured.runs[0].len(),
        measured.date,
        measured.load.0,
        measured.load.1,
    );
    out.push_str("| mode | transactions/s (runs) | median | traced ÷ untraced |\n|---|---|---:|---:|\n");
    let untraced = median(&measured.runs[0]);
    for ((name, _), runs) in MODES.iter().zip(&measured.runs) {
        let list: Vec<String> = runs.iter().map(|r| format!("{r:.0}")).collect();
        let median = median(runs);
        let _ = writeln!(out, "| {name} | {} | {median:.0} | {:.2} |", list.join(", "), median / untraced);
    }
    out
}
