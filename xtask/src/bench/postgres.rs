//! A second real service: Debian's PostgreSQL 15 under `pgbench -C -S` (a new session for each
//! select-only transaction, 4 clients), untraced and under `memprof attach --follow-forks` on its
//! postmaster in each mode: every session is a backend forked, traced from its fork if memprof
//! attaches before it ends, that fills its caches with many allocations; and under `memprof
//! attach` on the postmaster alone, whose backends are not traced. heaptrack has no row: it
//! follows one process.

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

type Mode = (&'static str, Option<&'static [&'static str]>);

/// One table: the benchmark with a session per transaction or with its sessions kept, and the
/// modes it is run under.
struct Table {
    per_transaction: bool,
    modes: &'static [Mode],
}

const TABLES: [Table; 2] = [
    Table {
        per_transaction: true,
        modes: &[
            ("none", None),
            ("memprof attach --follow-forks --max-rate off (exact)", Some(&["--follow-forks", "--max-rate", "off"])),
            (
                "memprof attach --follow-forks --sample-bytes 524288",
                Some(&["--follow-forks", "--sample-bytes", "524288"]),
            ),
            ("memprof attach --follow-forks --growth", Some(&["--follow-forks", "--growth"])),
            ("memprof attach --max-rate off (the postmaster alone)", Some(&["--max-rate", "off"])),
        ],
    },
    // Its 4 sessions kept (no `-C`): their backends live for the whole run.
    Table {
        per_transaction: false,
        modes: &[
            ("none", None),
            ("memprof attach --max-rate off (the postmaster alone)", Some(&["--max-rate", "off"])),
        ],
    },
];

/// What one mode of a table measured.
#[derive(Clone, Default)]
struct Runs {
    /// Transactions a second, in order.
    tps: Vec<f64>,
    /// Its sessions over its runs, when it follows the backends.
    backends: Backends,
}

pub struct Measured {
    /// Each table's modes, as `TABLES` has them.
    tables: Vec<Vec<Runs>>,
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

    /// Select-only transactions a second over `seconds` from 4 clients on 2 threads, a new
    /// session for each when `per_transaction`.
    fn pgbench(&self, seconds: u64, per_transaction: bool) -> anyhow::Result<f64> {
        let connect = if per_transaction { "-C " } else { "" };
        let dir = self.dir.display();
        let text = as_postgres(&format!("pgbench -h {dir} -p {PORT} {connect}-c 4 -j 2 -S -T {seconds} postgres"))?;
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

/// Interleaved runs of every mode of every table on one cluster: A B C D E F G A B C ...
pub fn measure(memprof: &Path, dir: &Path, size: Size) -> anyhow::Result<Measured> {
    let seconds = if size.quick { 3 } else { 15 };
    let cluster = Cluster::start(dir).context("starting a PostgreSQL cluster")?;
    let date = run("date", &["-u", "+%Y-%m-%d %H:%M UTC"])?.trim().to_string();
    let load_before = load_average();
    let mut tables: Vec<Vec<Runs>> = TABLES.iter().map(|table| vec![Runs::default(); table.modes.len()]).collect();
    let report = dir.join("postgres-report.json");
    for _ in 0..size.runs {
        for (table, measured) in TABLES.iter().zip(&mut tables) {
            for (mode, runs) in table.modes.iter().zip(measured.iter_mut()) {
                let tps = one_run(memprof, &cluster, seconds, table.per_transaction, mode, &report, runs)
                    .with_context(|| format!("pgbench under {}", mode.0))?;
                runs.tps.push(tps);
            }
        }
    }
    Ok(Measured { tables, seconds, date, load: (load_before, load_average()) })
}

/// One run of pgbench under `mode`, whose report's backends are added to `runs`.
fn one_run(
    memprof: &Path,
    cluster: &Cluster,
    seconds: u64,
    per_transaction: bool,
    (name, options): &Mode,
    report: &Path,
    runs: &mut Runs,
) -> anyhow::Result<f64> {
    let tracer = match options {
        Some(options) => {
            let all: Vec<&str> = ["--json"].iter().chain(options.iter()).copied().collect();
            Some(attach(memprof, cluster.postmaster()?, report, &all)?)
        }
        None => None,
    };
    let tps = cluster.pgbench(seconds, per_transaction)?;
    if let Some(tracer) = tracer {
        tracer.stop()?;
        if follows(options) {
            runs.backends.add(report).context("reading memprof's report")?;
        }
    }
    let connect = if per_transaction { "-C " } else { "" };
    eprintln!("xtask bench: pgbench {connect}-S under {name:<65} {tps:>9.0} tps");
    Ok(tps)
}

/// Whether a mode's memprof follows the postmaster's backends.
fn follows(options: &Option<&[&str]>) -> bool {
    options.is_some_and(|options| options.contains(&"--follow-forks"))
}

#[derive(Clone, Copy, Default)]
struct Backends {
    followed: u64,
    missed: u64,
}

impl Backends {
    /// Adds the `forks` of the final report in `path` (the last JSON line).
    fn add(&mut self, path: &Path) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(path)?;
        let last = text.lines().last().context("no report")?;
        let report: serde_json::Value = serde_json::from_str(last)?;
        let count = |name: &str| report["forks"][name].as_u64().with_context(|| format!("no forks.{name}"));
        self.followed += count("followed")?;
        self.missed += count("missed")?;
        Ok(())
    }
}

pub fn render(measured: &Measured) -> String {
    let mut out = format!(
        "\nDebian's PostgreSQL 15 (glibc) under `pgbench -C -S -c 4 -j 2 -T {}` (a new session, so a \
         backend forked, for each select-only transaction; fsync off), `memprof attach` on its \
         postmaster, with `--follow-forks` but in the last row. The modes' runs interleaved, {} rounds; the median of each. Measured {}, \
         load average {} before, {} after. heaptrack has no row: it follows one process, and each \
         session has a backend of its own.\n\n",
        measured.seconds,
        measured.tables[0][0].tps.len(),
        measured.date,
        measured.load.0,
        measured.load.1,
    );
    render_table(&mut out, &TABLES[0], &measured.tables[0]);
    out.push_str(
        "\nA backend missed (`forks.missed` in memprof's report) was gone before its probes were \
         attached: its session ran untraced, but with the breakpoints its fork copied from the traced \
         postmaster's links, which trap at each call until memprof has the kernel take them out at \
         its next interval. In the last row the postmaster alone is traced: it has children, so \
         `attach` gives it perf-event uprobes, which the kernel takes out of a backend at its first \
         call to each. A backend followed costs about the same in every mode that traces calls: \
         most of its calls are frees of blocks the postmaster allocated, which trap in all of them; \
         sampled mode can sit below exact mode because it follows more backends (\"Real services: \
         where the time goes\").\n",
    );
    out.push_str(
        "\nThe same, its 4 sessions kept for the whole run (`pgbench -S` without `-C`), in the same \
         rounds: the backends, forked once the postmaster was traced, lose the breakpoints their fork \
         copied at their first call to each.\n\n",
    );
    render_table(&mut out, &TABLES[1], &measured.tables[1]);
    out
}

fn render_table(out: &mut String, table: &Table, measured: &[Runs]) {
    out.push_str(
        "| mode | transactions/s (runs) | median | traced ÷ untraced | backends followed, missed (all runs) |\n\
         |---|---|---:|---:|---:|\n",
    );
    let untraced = median(&measured[0].tps);
    for ((name, options), runs) in table.modes.iter().zip(measured) {
        let list: Vec<String> = runs.tps.iter().map(|r| format!("{r:.0}")).collect();
        let median = median(&runs.tps);
        let backends = match options {
            None => String::new(),
            options if follows(options) => format!("{}, {}", runs.backends.followed, runs.backends.missed),
            Some(_) => "not followed".to_string(),
        };
        let _ = writeln!(out, "| {name} | {} | {median:.0} | {:.2} | {backends} |", list.join(", "), median / untraced);
    }
}
