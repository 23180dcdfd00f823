//! The command line.

use std::{ffi::OsString, num::NonZeroU32, path::PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{
    commands::moment::{self, Moment},
    format::{Flame, Format},
    heap::leak::{LeakSettings, DEFAULT_LEAK},
    heap::sampling::Sampling,
    heap::{
        capture::Precopy,
        filter::Filters,
        heuristics::Heuristics,
        suppressions::SuppressionArgs,
        wrappers::{wrapper_name, WrapperArgs},
    },
    kernel::settings::{LoadSettings, MAX_MAP_ENTRIES},
    kernel::shared::ProbeLinks,
    unwind::UnwindMode,
};

/// The version and the commit it was built from (build.rs).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("MEMPROF_COMMIT"), ")");

const EXAMPLES: &str = "\
Examples:
  memprof attach -p 1234                      a table of the stacks holding memory, every 5 s
  memprof attach -p 1234 --duration 60 -o heap.html --format html
  memprof run ./server --port 8080            trace a command from its first allocation
  memprof run --interval 1 --fail-on-leak-bytes 0 ./soak-test
                                              a CI gate on leaks
  memprof daemon --comm '^nginx$'             Prometheus metrics on 127.0.0.1:9464
  memprof snapshot -p 1234 -o before.pb.gz    a pprof profile, for go tool pprof
  memprof inspect -p 1234                     lost blocks as memcheck says, from the daemon
  memprof diff before.json after.json         growth per allocation site

Needs root, or the capabilities CAP_SYS_ADMIN, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH
(docs: install.md#permissions in memprof's book). MEMPROF_LOG=debug logs more.";

#[derive(Debug, Parser)]
#[command(
    name = "memprof",
    version = VERSION,
    about = "eBPF heap profiler: outstanding allocations per call stack, leaks and double frees",
    after_help = EXAMPLES
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Trace the allocator of a running process.
    #[command(after_help = "\
Examples:
  memprof attach -p 1234                        report every 5 s until Ctrl-C
  memprof attach -p 1234 --duration 30 --json   one JSON object per line
  memprof attach -p 1234 --duration 60 --format html -o heap.html")]
    Attach {
        /// The process to trace.
        #[arg(short, long, allow_negative_numbers = true, value_parser = pid)]
        pid: NonZeroU32,
        #[command(flatten)]
        trace: TraceArgs,
    },
    /// Trace many processes and serve Prometheus metrics and an HTTP API.
    #[command(after_help = "\
Examples:
  memprof daemon --comm '^nginx$' --comm '^redis-server$'
  memprof daemon --cgroup /system.slice/api.service --listen 0.0.0.0:9464
  memprof daemon --config /etc/memprof/memprof.toml   (SIGHUP reloads it)")]
    Daemon(DaemonArgs),
    /// Start a command with probes attached before its first allocation; exit with its exit code
    /// (100 instead when --fail-on-leak-bytes finds a leak).
    #[command(after_help = "\
Examples:
  memprof run ./app --its-own-flag   everything after the command is the command's
  memprof run --json -o heap.json -- ./app
  memprof run --interval 1 --fail-on-leak-bytes 0 ./soak-test")]
    Run {
        #[command(flatten)]
        trace: TraceArgs,
        /// Exit with code 100 when the leak candidates hold more than BYTES when the command ends
        /// (a CI gate), whatever the command's own exit code; the report is written as asked. The
        /// gate is not judged when processes the leak rule has no verdict on yet (traced for fewer
        /// than --leak-window intervals) hold more than BYTES, or when memprof cannot go on (see
        /// --on-error): a command that exits 0 then makes memprof exit 1.
        #[arg(long, value_name = "BYTES", allow_negative_numbers = true, value_parser = whole("bytes", 0, u64::MAX))]
        fail_on_leak_bytes: Option<u64>,
        /// What happens to the command when memprof cannot go on once it started it (a full
        /// disk, probes that cannot be attached): continue (it runs on untraced) or stop (it gets
        /// SIGTERM). Either way memprof waits for it and exits with its exit code. An output that
        /// cannot be created is refused before the command starts.
        #[arg(long, value_enum, default_value_t = OnError::Continue)]
        on_error: OnError,
        /// The command and its arguments: memprof's options come before it.
        #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
        command: Vec<OsString>,
    },
    /// Write a process's heap profile to a file, from the memprof daemon that traces it, or else
    /// by attaching for a while; the process keeps running.
    #[command(after_help = "\
Examples:
  memprof snapshot -p 1234 -o heap.pb.gz          pprof, for go tool pprof
  memprof snapshot -p 1234 -o heap.json           a JSON report, for memprof diff
  memprof snapshot -p 1234 -o heap.pb.gz --duration 30   attaching: trace 30 s first")]
    Snapshot(SnapshotArgs),
    /// Class the blocks of a process the memprof daemon traces as valgrind's memcheck would
    /// (definitely, indirectly, possibly lost, reachable), with C++ objects by type; the process
    /// is held still for a moment and keeps running.
    #[command(after_help = "\
Examples:
  memprof inspect -p 1234                      a table: each stack's blocks by class
  memprof inspect -p 1234 --json               the JSON report, with \"reachability\" per stack
  memprof inspect -p 1234 --format pprof -o lost.pb.gz
Without a daemon tracing the process: memprof attach -p 1234 --inspect --duration 10")]
    Inspect(InspectArgs),
    /// Compare two snapshots (JSON reports or pprof profiles): growth in use per allocation site.
    #[command(after_help = "\
Examples:
  memprof snapshot -p 1234 -o before.json; sleep 600; memprof snapshot -p 1234 -o after.json
  memprof diff before.json after.json                 the sites that grew most first
  memprof diff before.pb.gz after.pb.gz --format json")]
    Diff(DiffArgs),
    /// Print a shell's completion script, e.g. `memprof completions bash > /etc/bash_completion.d/memprof`.
    #[command(after_help = "\
Examples:
  memprof completions bash > /etc/bash_completion.d/memprof
  memprof completions zsh > \"${fpath[1]}/_memprof\"
  memprof completions fish > ~/.config/fish/completions/memprof.fish")]
    Completions { shell: clap_complete::Shell },
    /// Write the man pages, memprof.1 and one per subcommand, into DIR (`cargo xtask man`).
    #[command(hide = true)]
    Man { dir: PathBuf },
    /// Write the book's command-line page, DIR/cli.md: every command's --help (`cargo xtask docs`).
    #[command(hide = true)]
    CliReference { dir: PathBuf },
    /// Render a recording (`attach`/`run --record FILE`) in any format, as the session would have,
    /// at any moment, filtered, as flame graphs of bytes, allocations or temporary allocations.
    #[command(after_help = "\
Examples:
  memprof report heap.rec --at peak                   the stacks that held the peak
  memprof report heap.rec --at 30 --focus '^parse_'   30 s in, stacks through parse_*
  memprof report heap.rec --flame allocations -o allocations.svg")]
    Report(ReportArgs),
}

#[derive(Debug, Args, Clone)]
pub struct ReportArgs {
    /// The recording.
    pub recording: PathBuf,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Stacks shown per report in the table [default: the session's --top].
    #[arg(long, allow_negative_numbers = true, value_parser = stacks)]
    pub top: Option<usize>,
    /// Fold this function into the allocator too, as the session folded the wrappers it knew:
    /// stacks through it start at its caller. Repeatable.
    #[arg(long = "wrapper", value_name = "NAME", value_parser = wrapper_name)]
    pub wrappers: Vec<String>,
    #[command(flatten)]
    pub filters: Filters,
    #[command(flatten)]
    pub suppress: SuppressionArgs,
    /// The moment shown: final (the end), peak (each process when it had the most bytes in use),
    /// or SECONDS after tracing began (the interval nearest them) [default: every report in table
    /// and json, the end in other formats].
    #[arg(long, value_name = "peak|final|SECONDS", allow_negative_numbers = true, value_parser = moment::moment)]
    pub at: Option<Moment>,
    /// Draw a flame graph of this (folded stacks with --format folded).
    #[arg(long, value_enum, value_name = "WHAT")]
    pub flame: Option<Flame>,
}

/// A path, or the empty one (clap's own parser refuses it), which says "none".
fn path_or_none(value: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(value))
}

/// The daemon's API socket unless told otherwise (`access.socket`), where `inspect` and
/// `snapshot` ask: it serves root everything, checked by the kernel (docs: daemon/securing.md#securing-the-listener).
pub const DAEMON_SOCKET: &str = "/run/memprof/api.sock";

#[derive(Debug, Args, Clone)]
pub struct SnapshotArgs {
    /// The process.
    #[arg(short, long, allow_negative_numbers = true, value_parser = pid)]
    pub pid: NonZeroU32,
    /// The file to write.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// pprof (gzip-compressed profile.proto) or json [default: from the file name, .pb.gz or .json].
    #[arg(long, value_enum)]
    pub format: Option<SnapshotFormat>,
    /// The memprof daemon to ask first: its socket, or http://HOST:PORT on this host.
    #[arg(long, value_name = "SOCKET|URL", default_value = DAEMON_SOCKET)]
    pub daemon: String,
    /// Log in to the daemon as USER (its web config's basic auth); the password is read from the
    /// environment variable MEMPROF_DAEMON_PASSWORD.
    #[arg(long, value_name = "USER")]
    pub daemon_user: Option<String>,
    /// Seconds to trace when no daemon traces the process.
    #[arg(long, default_value_t = 10.0, allow_negative_numbers = true, value_parser = positive_seconds)]
    pub duration: f64,
    #[command(flatten)]
    pub maps: LoadSettings,
}

#[derive(Debug, Args, Clone)]
pub struct InspectArgs {
    /// The process.
    #[arg(short, long, allow_negative_numbers = true, value_parser = pid)]
    pub pid: NonZeroU32,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Stacks shown in the table.
    #[arg(long, default_value_t = 10, allow_negative_numbers = true, value_parser = stacks)]
    pub top: usize,
    /// The memprof daemon that traces the process: its socket, or http://HOST:PORT on this host.
    #[arg(long, value_name = "SOCKET|URL", default_value = DAEMON_SOCKET)]
    pub daemon: String,
    /// Log in to the daemon as USER (its web config's basic auth); the password is read from the
    /// environment variable MEMPROF_DAEMON_PASSWORD.
    #[arg(long, value_name = "USER")]
    pub daemon_user: Option<String>,
    /// memcheck's leak-check heuristics the daemon uses, as for `attach --inspect-heuristics`:
    /// all, none, or a comma list of stdstring, length64, newarray and multipleinheritance
    /// [default: all].
    #[arg(long, value_name = "SET", default_value_t = Heuristics::ALL, hide_default_value = true)]
    pub inspect_heuristics: Heuristics,
}

/// `run --on-error`: the command's fate when memprof cannot go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnError {
    /// The command runs on untraced.
    Continue,
    /// The command gets SIGTERM.
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SnapshotFormat {
    Pprof,
    Json,
}

#[derive(Debug, Args, Clone)]
pub struct DiffArgs {
    /// The earlier snapshot.
    pub old: PathBuf,
    /// The later snapshot.
    pub new: PathBuf,
    /// table, or json for programs.
    #[arg(long, value_enum, default_value_t = DiffFormat::Table)]
    pub format: DiffFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiffFormat {
    Table,
    Json,
}

#[derive(Debug, Args, Clone)]
pub struct TraceArgs {
    /// Seconds between reports (at least 0.1).
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true, value_parser = interval)]
    pub interval: f64,
    /// Stop after this many seconds.
    #[arg(long, allow_negative_numbers = true, value_parser = positive_seconds)]
    pub duration: Option<f64>,
    /// Stacks shown per report in the table.
    #[arg(long, default_value_t = 10, allow_negative_numbers = true, value_parser = stacks)]
    pub top: usize,
    /// Only count allocations outstanding for at least this many seconds.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = non_negative_seconds)]
    pub min_age: f64,
    /// Intervals the leak rule looks back over (docs: guide/leaks.md#leak-candidates).
    #[arg(long, default_value_t = DEFAULT_LEAK.window, allow_negative_numbers = true, value_parser = leak_window)]
    pub leak_window: usize,
    /// Lowest leak score (0 to 1) of a leak candidate.
    #[arg(long, default_value_t = DEFAULT_LEAK.threshold, allow_negative_numbers = true, value_parser = leak_threshold)]
    pub leak_threshold: f64,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Also record every interval's report to FILE, written as the session goes (it survives a
    /// killed memprof up to its last interval); `memprof report FILE` renders it in any format.
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// Trace the children the process forks too, each in a section of its own: `--follow-forks`
    /// or `--follow-forks=false` [default: false for attach, true for run].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub follow_forks: Option<bool>,
    /// At the end (for `run`: at --duration), hold the process still for a moment and class its
    /// blocks as valgrind's memcheck would: definitely, indirectly and possibly lost, reachable.
    #[arg(long)]
    pub inspect: bool,
    /// With --inspect, when to copy the process's memory while it runs, so that the stop reads
    /// again only the pages written since (soft-dirty bits; else every page, into the ready
    /// copy): auto (when it holds over 16 MiB in writable mappings), always, never, or write-protect (always,
    /// and without soft-dirty bits by userfaultfd, opened by calls injected into the process:
    /// memprof killed by SIGKILL meanwhile may crash it) [default: auto].
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = Precopy::Auto, hide_default_value = true)]
    pub inspect_precopy: Precopy,
    /// With --inspect, memcheck's leak-check heuristics to use (its `--leak-check-heuristics`):
    /// a pointer into a block's interior that one of them accepts holds the block as a pointer
    /// to its start would. all, none, or a comma list of stdstring, length64, newarray and
    /// multipleinheritance [default: all, as memcheck].
    #[arg(long, value_name = "SET", default_value_t = Heuristics::ALL, hide_default_value = true)]
    pub inspect_heuristics: Heuristics,
    #[command(flatten)]
    pub filters: Filters,
    #[command(flatten)]
    pub suppress: SuppressionArgs,
    /// Draw each interval's report in place on the terminal, top-like (leak candidates first),
    /// and print the final report when the session ends.
    #[arg(long)]
    pub live: bool,
    /// Also report the bytes in use by the thread that allocated them, with the threads' names
    /// (read each interval while they run).
    #[arg(long)]
    pub threads: bool,
    #[command(flatten)]
    pub wrappers: WrapperArgs,
    #[command(flatten)]
    pub sampling: Sampling,
    #[command(flatten)]
    pub maps: LoadSettings,
}

impl TraceArgs {
    pub fn leak_settings(&self) -> LeakSettings {
        LeakSettings { window: self.leak_window, threshold: self.leak_threshold }
    }
}

/// How and where reports are written, the same for every command that writes them (`attach`,
/// `run`, `inspect`, `report`).
#[derive(Debug, Args, Clone)]
pub struct OutputArgs {
    /// How reports are written: table and json write every report, the other formats the last one
    /// [default: from --output's name: .json, .pb.gz (pprof), .html, .svg (flamegraph); else table].
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Shorthand for `--format json`.
    #[arg(long, conflicts_with = "format")]
    json: bool,
    /// Write reports to this file instead of stdout (`-`: stdout).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub file: Option<PathBuf>,
}

impl OutputArgs {
    /// `json` when `--json` is given, else `--format`, else what the output file's name asks
    /// for (`heap.pb.gz`: pprof), else a table.
    pub fn format(&self) -> Format {
        self.format_given().or_else(|| self.file.as_deref().and_then(Format::of_file_name)).unwrap_or(Format::Table)
    }

    /// The format the flags name, if they name one.
    pub fn format_given(&self) -> Option<Format> {
        if self.json {
            Some(Format::Json)
        } else {
            self.format
        }
    }

    /// Reports in `format` to `file` (stdout without one), as the flags would say.
    pub fn new(format: Format, file: Option<PathBuf>) -> Self {
        Self { format: Some(format), json: false, file }
    }
}

/// `memprof daemon` flags. Each overrides the same setting of the config file.
#[derive(Debug, Args, Clone, Default)]
pub struct DaemonArgs {
    /// TOML config file; SIGHUP reloads it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address for /metrics and the HTTP API [default: 127.0.0.1:9464].
    #[arg(long, value_name = "ADDR", value_parser = listen_address)]
    pub listen: Option<String>,
    /// TLS and basic auth for the listener, as Prometheus exporters' --web.config.file (YAML).
    #[arg(long, value_name = "FILE")]
    pub web_config_file: Option<PathBuf>,
    /// Unix socket serving the whole API to root and access.group [default: /run/memprof/api.sock; "" for none].
    #[arg(long, value_name = "PATH", value_parser = path_or_none)]
    pub socket: Option<PathBuf>,
    /// Trace this process (repeatable).
    #[arg(short, long = "pid", value_name = "N")]
    pub pids: Vec<u32>,
    /// Trace every process whose command name matches this regex (repeatable).
    #[arg(long = "comm", value_name = "REGEX")]
    pub comms: Vec<String>,
    /// Trace every process in this cgroup or below it, e.g. /system.slice/nginx.service (repeatable).
    #[arg(long = "cgroup", value_name = "PATH")]
    pub cgroups: Vec<String>,
    /// Trace every process that has an allocator (up to --max-targets).
    #[arg(long)]
    pub all: bool,
    /// Most processes traced at once [default: 1000].
    #[arg(long, allow_negative_numbers = true, value_parser = whole("processes", 1, usize::MAX))]
    pub max_targets: Option<usize>,
    /// Probe links of each traced process's own while few map an allocator file, shared per file
    /// past that (auto); always shared (every process mapping the file then takes the probes'
    /// traps); or always per process (each attach visits every process mapping the file)
    /// [default: auto].
    #[arg(long, value_enum)]
    pub probe_links: Option<ProbeLinks>,
    /// Seconds between snapshots of the kernel maps (at least 0.1) [default: 5].
    #[arg(long, allow_negative_numbers = true, value_parser = interval)]
    pub interval: Option<f64>,
    /// Seconds between scans of /proc for matching processes; new ones are found from their exec
    /// or fork at once, the scan catches a command name or cgroup changed later [default: 60].
    #[arg(long, allow_negative_numbers = true, value_parser = interval)]
    pub resync_interval: Option<f64>,
    /// Stacks exported per process in memprof_stack_inuse_bytes; 0 disables [default: 10].
    #[arg(long, allow_negative_numbers = true, value_parser = whole("stacks", 0, usize::MAX))]
    pub top_stacks: Option<usize>,
    /// Export each process's allocation sizes as a histogram (memprof_allocation_size_bytes: 36
    /// series a process); off by default, as most of a process's series would be its buckets.
    #[arg(long)]
    pub size_histograms: bool,
    /// Put `pid` on every per-process series too. Off by default: series are told apart by
    /// `comm` and `slot`, so a restarted service keeps its series instead of starting new ones;
    /// memprof_target_attached maps each slot to its pid.
    #[arg(long)]
    pub pid_labels: bool,
    /// Intervals the leak rule looks back over [default: 6].
    #[arg(long, allow_negative_numbers = true, value_parser = leak_window)]
    pub leak_window: Option<usize>,
    /// Lowest leak score (0 to 1) of a leak candidate [default: 0.5].
    #[arg(long, allow_negative_numbers = true, value_parser = leak_threshold)]
    pub leak_threshold: Option<f64>,
    #[command(flatten)]
    pub sampling: Sampling,
    /// Outstanding allocations tracked at once, all processes together [default: 1048576].
    #[arg(long, allow_negative_numbers = true, value_parser = whole("entries", 1, MAX_MAP_ENTRIES))]
    pub max_live: Option<u32>,
    /// Distinct call stacks kept, all processes together [default: 65536].
    #[arg(long, allow_negative_numbers = true, value_parser = whole("stacks", 1, MAX_MAP_ENTRIES))]
    pub max_stacks: Option<u32>,
    /// How stacks are walked: cfi (.eh_frame) or fp (frame pointers) [default: cfi].
    #[arg(long, value_enum)]
    pub unwind: Option<UnwindMode>,
    /// Frames kept per stack, 1 to 127 [default: 127].
    #[arg(long, allow_negative_numbers = true, value_parser = whole("frames", 1, profiler_common::MAX_FRAMES as u32))]
    pub max_frames: Option<u32>,
    /// Rows of unwind tables kept in the kernel, all files together [default: 16777216].
    #[arg(long, allow_negative_numbers = true, value_parser = whole("rows", 1, u32::MAX))]
    pub max_unwind_rows: Option<u32>,
    /// Rows of unwind tables one user's traced processes may take, root's excepted; a table past
    /// it is not loaded for them [default: a quarter of --max-unwind-rows].
    #[arg(long, allow_negative_numbers = true, value_parser = whole("rows", 1, u32::MAX))]
    pub max_unwind_rows_per_user: Option<u32>,
    /// Seconds the unwind table of a file no traced process maps any more is kept for the next
    /// process that maps it; a new table takes its rows sooner if it needs them (0: given back
    /// at once) [default: 60].
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true, value_parser = whole("seconds", 0, crate::unwind::MAX_KEEP_IDLE_SECONDS))]
    pub keep_unwind_tables: Option<u32>,
    /// Also trace anonymous mmap, munmap, mremap and brk with their stacks; costs these calls on
    /// the host a little (docs: guide/mappings.md#memory-outside-malloc-mappings).
    #[arg(long)]
    pub mappings: bool,
    /// Walk every free's stack, for double-free reports with the first free's whole stack
    /// (without it: its caller only).
    #[arg(long)]
    pub full_free_stacks: bool,
    #[command(flatten)]
    pub wrappers: WrapperArgs,
    /// Stacks accepted, in valgrind's suppression file format: no leak candidates, no
    /// memprof_stack_leak_candidate; the file's `suppressions` are used unless this is given.
    /// Repeatable.
    #[arg(long = "suppressions", value_name = "FILE")]
    pub suppressions: Vec<PathBuf>,
}

/// The longest time any setting takes (about 31 years): longer ones are refused, not overflowed.
pub const MAX_SECONDS: f64 = 1e9;

/// The shortest positive number of seconds: one nanosecond, a `Duration`'s resolution. Less would
/// be a zero period, which tokio's interval refuses with a panic.
pub const MIN_SECONDS: f64 = 1e-9;

/// The shortest interval: each reads the kernel's tables and builds the reports, and much more
/// often than this would spend a core on that alone.
pub const MIN_INTERVAL: f64 = 0.1;

/// Checks an interval: at least `MIN_INTERVAL` seconds and at most `MAX_SECONDS`.
pub fn check_interval(secs: f64) -> Result<f64, String> {
    if (MIN_INTERVAL..=MAX_SECONDS).contains(&secs) {
        Ok(secs)
    } else {
        Err(format!("`{secs}` is not an interval from {MIN_INTERVAL} to {MAX_SECONDS} seconds"))
    }
}

fn interval(value: &str) -> Result<f64, String> {
    check_interval(seconds(value)?)
}

/// A number of seconds as given, finite: "1e309" reads as infinity, which no check should echo.
fn seconds(value: &str) -> Result<f64, String> {
    value
        .parse::<f64>()
        .ok()
        .filter(|secs| secs.is_finite())
        .ok_or_else(|| format!("`{value}` is not a number of seconds"))
}

/// Checks a number of seconds: at least `MIN_SECONDS` (or at least zero, with `zero_ok`) and at most
/// `MAX_SECONDS`.
pub fn check_seconds(secs: f64, zero_ok: bool) -> Result<f64, String> {
    let lowest_ok = if zero_ok { secs >= 0.0 } else { secs >= MIN_SECONDS };
    if lowest_ok && secs <= MAX_SECONDS {
        Ok(secs)
    } else {
        let least = if zero_ok { "0" } else { "0.000000001 (1 ns)" };
        Err(format!("`{secs}` is not a number of seconds from {least} to {MAX_SECONDS}"))
    }
}

/// An address to listen on, checked as the command line is read; kept as given.
fn listen_address(value: &str) -> Result<String, String> {
    match value.parse::<std::net::SocketAddr>() {
        Ok(_) => Ok(value.to_string()),
        Err(_) => Err(format!("`{value}` is not IP:PORT, such as 127.0.0.1:9464")),
    }
}

fn positive_seconds(value: &str) -> Result<f64, String> {
    check_seconds(seconds(value)?, false)
}

fn non_negative_seconds(value: &str) -> Result<f64, String> {
    check_seconds(seconds(value)?, true)
}

/// A value parser for a whole number of `what` from `min` to `max`: its error says what the flag
/// takes, where clap's own says only that a digit is invalid or a number too large.
pub fn whole<T>(what: &'static str, min: T, max: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy + Send + Sync + 'static,
{
    move |value: &str| match value.parse::<T>() {
        Ok(n) if n >= min && n <= max => Ok(n),
        _ => Err(format!("`{value}` is not a whole number of {what} from {min} to {max}")),
    }
}

/// The largest process id Linux gives (`PID_MAX_LIMIT` on 64-bit machines).
const PID_MAX: u32 = 4_194_304;

/// A process id: a whole number from 1 to `PID_MAX`.
fn pid(value: &str) -> Result<NonZeroU32, String> {
    match value.parse::<u32>().ok().filter(|pid| *pid <= PID_MAX).and_then(NonZeroU32::new) {
        Some(pid) => Ok(pid),
        None => Err(format!("`{value}` is not a process id (a whole number from 1 to {PID_MAX})")),
    }
}

/// A number of stacks to show: at least 1.
fn stacks(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{value}` is not a positive number of stacks; give 1 or more")),
    }
}

/// A leak window: 2 to 1000 intervals.
pub fn leak_window(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if (2..=1000).contains(&n) => Ok(n),
        _ => Err(format!("`{value}` is not a number of intervals from 2 to 1000")),
    }
}

/// A leak score threshold: more than 0, at most 1.
pub fn leak_threshold(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("`{value}` is not a score above 0 and at most 1")),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use clap::CommandFactory as _;
    use proptest::prelude::*;

    use super::*;

    /// clap's own checks of the definition (short flags used twice, say), which it makes only in
    /// debug builds otherwise.
    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
        let run = Cli::try_parse_from(["memprof", "run", "-o", "f.json", "sh", "-c", "exit 3"]).unwrap();
        let Command::Run { trace, command, .. } = run.command else { panic!("not run") };
        assert_eq!(trace.output.file, Some(PathBuf::from("f.json")));
        assert_eq!(command, ["sh", "-c", "exit 3"]);
    }

    #[test]
    fn the_shortest_interval_is_not_a_zero_period() {
        assert!(!Duration::from_secs_f64(MIN_SECONDS).is_zero());
        let err = Cli::try_parse_from(["memprof", "run", "--duration", "1e-300", "--", "true"]).unwrap_err();
        assert!(err.to_string().contains("is not a number of seconds from 0.000000001 (1 ns)"), "{err}");
    }

    #[test]
    fn an_interval_below_a_tenth_of_a_second_is_refused() {
        for args in
            [&["memprof", "run", "--interval", "1e-9", "--", "true"][..], &["memprof", "daemon", "--interval", "0.01"]]
        {
            let err = Cli::try_parse_from(args).unwrap_err();
            assert!(err.to_string().contains("is not an interval from 0.1 to 1000000000 seconds"), "{err}");
        }
        assert!(Cli::try_parse_from(["memprof", "run", "--interval", "0.1", "--", "true"]).is_ok());
    }

    /// Every flag that takes a value: (subcommand, flag).
    pub(crate) fn value_flags() -> Vec<(String, String)> {
        let cli = Cli::command();
        let mut flags = Vec::new();
        for sub in cli.get_subcommands() {
            for arg in sub.get_arguments().filter(|a| a.get_action().takes_values()) {
                if let Some(long) = arg.get_long() {
                    flags.push((sub.get_name().to_string(), long.to_string()));
                }
            }
        }
        flags
    }

    /// Values a user might type, or not: anything, numbers of every shape, and the odd ones.
    pub(crate) fn flag_value() -> impl Strategy<Value = String> {
        prop_oneof![
            ".{0,40}",
            "-?[0-9]{0,25}(\\.[0-9]{0,12})?(e-?[0-9]{1,4})?",
            prop::sample::select(vec!["inf", "-inf", "NaN", "-0", "0", "0x10", "1_000", "18446744073709551616", ""])
                .prop_map(String::from),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn any_value_of_any_flag_is_parsed_or_refused_without_panicking(
            flag in prop::sample::select(value_flags()),
            value in flag_value(),
        ) {
            let (sub, flag) = flag;
            let _ = Cli::try_parse_from(["memprof".to_string(), sub, format!("--{flag}"), value]);
        }
    }
}
