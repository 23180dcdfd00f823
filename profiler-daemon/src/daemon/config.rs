//! The daemon's settings: a TOML file, overridden by flags, validated into one `Config`.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use profiler_common::{COMM_BYTES, MAX_EXEC_NAMES};
use regex::Regex;
use serde::Deserialize;

use super::{access, server};
use crate::{
    cli::{self, DaemonArgs},
    heap::leak::{LeakSettings, DEFAULT_LEAK},
    heap::sampling::{self, MaxRate, Sampling},
    heap::{suppressions::Suppressions, wrappers::Wrappers},
    kernel::settings::{LoadSettings, DEFAULT_LOAD, MAX_MAP_ENTRIES},
    kernel::shared::ProbeLinks,
    process::procfs,
    unwind::{UnwindMode, KEEP_IDLE, MAX_KEEP_IDLE_SECONDS},
};

/// Most processes traced at once unless told: the scale measured and tested, attach and exit times
/// and the cost at rest (docs: performance.md#scale), well under the kernel's table of traced
/// processes (4,096).
pub const DEFAULT_MAX_TARGETS: usize = 1000;

/// One user's traced processes may take this fraction of `max_unwind_rows` unless told: room for
/// the largest programs measured, twice over (docs: reference/limits.md#unwind-rows), and three
/// quarters left to the other users.
const UNWIND_SHARES: u32 = 4;

/// Seconds between scans of /proc unless told (see `Config::resync`).
const DEFAULT_RESYNC: f64 = 60.0;

/// `max_rate` in the config file: a number of calls a second, or `off`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FileMaxRate {
    Calls(u64),
    Word(String),
}

/// The config file. Every field is optional; flags override fields.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    listen: Option<String>,
    pids: Option<Vec<u32>>,
    comms: Option<Vec<String>>,
    cgroups: Option<Vec<String>>,
    all: Option<bool>,
    max_targets: Option<usize>,
    probe_links: Option<ProbeLinks>,
    interval: Option<f64>,
    resync_interval: Option<f64>,
    top_stacks: Option<usize>,
    size_histograms: Option<bool>,
    pid_labels: Option<bool>,
    leak_window: Option<usize>,
    leak_threshold: Option<f64>,
    sample_bytes: Option<u64>,
    max_rate: Option<FileMaxRate>,
    growth: Option<bool>,
    usdt: Option<bool>,
    max_live: Option<u32>,
    max_stacks: Option<u32>,
    unwind: Option<UnwindMode>,
    max_frames: Option<u32>,
    max_unwind_rows: Option<u32>,
    max_unwind_rows_per_user: Option<u32>,
    keep_unwind_tables: Option<u32>,
    mappings: Option<bool>,
    full_free_stacks: Option<bool>,
    wrappers: Option<Vec<String>>,
    auto_wrappers: Option<bool>,
    suppressions: Option<Vec<PathBuf>>,
    http: Option<server::SettingsFile>,
    access: Option<access::SettingsFile>,
}

/// Which processes to trace.
#[derive(Debug, Clone)]
pub struct Rules {
    pub pids: Vec<u32>,
    pub comms: Vec<Regex>,
    /// cgroup paths as processes see them (`/system.slice/x.service`), no trailing slash.
    pub cgroups: Vec<String>,
    pub all: bool,
}

impl Rules {
    /// Whether a process matches: `cgroups` are its cgroup paths, one per hierarchy.
    pub fn matches(&self, pid: u32, comm: &str, cgroups: &[String]) -> bool {
        self.all
            || self.pids.contains(&pid)
            || self.comms.iter().any(|re| re.is_match(comm))
            || cgroups.iter().any(|cgroup| self.names_cgroup(cgroup))
    }

    /// Whether a cgroup rule contains cgroup `path` (as processes see it).
    pub fn names_cgroup(&self, path: &str) -> bool {
        self.cgroups.iter().any(|rule| in_cgroup(path, rule))
    }

    pub fn needs_cgroup(&self) -> bool {
        !self.cgroups.is_empty()
    }

    /// Whether process `pid`, whose command name is `comm`, may match: only a cgroup rule needs
    /// more than its pid and name to tell.
    pub fn may_match(&self, pid: u32, comm: &str) -> bool {
        self.needs_cgroup() || self.matches(pid, comm, &[])
    }

    /// The command names the rules match, when they match processes by those names alone: no
    /// `all`, and each comm rule a whole name or a choice of whole names (`^nginx$`,
    /// `^(redis|valkey)-server$`). The kernel then reports only the execs that give one of them,
    /// as NUL-padded keys of `EXEC_NAMES` (and, where a rule names cgroups, those in a cgroup it
    /// may contain). A pid rule needs no exec.
    pub fn exec_names(&self) -> Option<Vec<[u8; COMM_BYTES]>> {
        if self.all {
            return None;
        }
        let mut keys = Vec::new();
        for rule in &self.comms {
            for name in whole_names(rule.as_str())? {
                // The kernel keeps 15 bytes of a name: a longer one is no process's.
                let mut name = name;
                while name.len() < COMM_BYTES {
                    let mut key = [0; COMM_BYTES];
                    key[..name.len()].copy_from_slice(&name);
                    keys.push(key);
                    // `/proc`'s name is read without trailing newlines (`procfs::comm_text`):
                    // the kernel's may have them.
                    name.push(b'\n');
                }
            }
        }
        (keys.len() <= MAX_EXEC_NAMES as usize).then_some(keys)
    }

    /// No rule at all: the daemon traces nothing (the shipped config, until it is given one).
    pub fn is_empty(&self) -> bool {
        !self.all && self.pids.is_empty() && self.comms.is_empty() && self.cgroups.is_empty()
    }
}

/// The names `pattern` matches, when it matches whole names only, each of printable ASCII but
/// the backslash: such a name is a kernel's name unchanged by `procfs::comm_text`, which writes
/// other bytes out with a backslash.
fn whole_names(pattern: &str) -> Option<Vec<Vec<u8>>> {
    use regex_syntax::hir::{literal::Extractor, HirKind, Look};
    let hir = regex_syntax::parse(pattern).ok()?;
    let HirKind::Concat(parts) = hir.kind() else { return None };
    let [first, middle @ .., last] = parts.as_slice() else { return None };
    if *first.kind() != HirKind::Look(Look::Start) || *last.kind() != HirKind::Look(Look::End) {
        return None;
    }
    // Between the anchors no assertion: its exact literals are then every string it matches.
    let middle = regex_syntax::hir::Hir::concat(middle.to_vec());
    if !middle.properties().look_set().is_empty() {
        return None;
    }
    let literals = Extractor::new().extract(&middle);
    let names = literals.literals()?;
    let plain = |name: &[u8]| name.iter().all(|&b| (b' '..=b'~').contains(&b) && b != b'\\');
    names
        .iter()
        .all(|name| name.is_exact() && plain(name.as_bytes()))
        .then(|| names.iter().map(|name| name.as_bytes().to_vec()).collect())
}

/// `cgroup` is `rule` or below it.
fn in_cgroup(cgroup: &str, rule: &str) -> bool {
    rule == "/" || cgroup == rule || cgroup.strip_prefix(rule).is_some_and(|rest| rest.starts_with('/'))
}

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub rules: Rules,
    pub max_targets: usize,
    /// Read at start: a reload does not change the links of processes traced already.
    pub probe_links: ProbeLinks,
    pub interval: f64,
    /// Seconds between scans of /proc for the processes the rules match: new processes are
    /// found from their exec or fork as it happens, the scan catches what changes otherwise (a
    /// command name set by the program itself, a process moved into a cgroup).
    pub resync: f64,
    pub top_stacks: usize,
    /// `memprof_allocation_size_bytes` is exported (`--size-histograms`).
    pub size_histograms: bool,
    /// Every per-process series carries `pid` too (`--pid-labels`).
    pub pid_labels: bool,
    pub leak: LeakSettings,
    pub sampling: Sampling,
    pub maps: LoadSettings,
    /// Rows of unwind tables one user's processes may take (`--max-unwind-rows-per-user`); read
    /// at start.
    pub unwind_rows_per_user: u32,
    /// How long an unwind table no traced process maps is kept for the next
    /// (`--keep-unwind-tables`).
    pub keep_unwind_tables: Duration,
    /// The allocation wrappers folded into the allocator in every report.
    pub wrappers: Wrappers,
    /// Stacks accepted (valgrind's suppression files): never leak candidates.
    pub suppressions: Suppressions,
    pub http: server::Settings,
    /// Read at start, as `http`.
    pub access: access::Settings,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the config file {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("invalid config file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid listen address `{0}`: expected IP:PORT, such as 127.0.0.1:9464")]
    Listen(String),
    #[error("invalid command-name regex `{pattern}` ({given}): {problem}")]
    Regex { pattern: String, given: String, problem: String },
    #[error("invalid {0}: {1}")]
    Value(&'static str, String),
    #[error(transparent)]
    Suppressions(#[from] crate::heap::suppressions::LoadError),
    #[error("no targets: give --pid, --comm, --cgroup or --all (or pids, comms, cgroups or all in the config file)")]
    NoTargets,
}

/// The regex crate's error in one line: its last, which names the problem (`unclosed group`);
/// the lines above it draw the pattern with a caret under the place.
fn regex_problem(err: &regex::Error) -> String {
    let text = err.to_string();
    let last = text.lines().map(str::trim).rfind(|line| !line.is_empty()).unwrap_or_default();
    last.strip_prefix("error: ").unwrap_or(last).to_string()
}

impl Config {
    /// Puts back the settings a reload cannot change, read at start, where `self` (the reloaded
    /// file) changes them from `running`'s: the listener is bound and its limits set, the programs
    /// loaded with their maps' sizes and settings, and the probe links chosen when the daemon
    /// starts. Returns their names, to be said.
    /// `usdt` keeps the whole sampling table as it was: the weights' table was sized for its mode.
    pub fn keep_read_at_start(&mut self, running: &Config) -> Vec<&'static str> {
        let mut kept = Vec::new();
        keep("listen", &mut self.listen, &running.listen, &mut kept);
        keep("probe_links", &mut self.probe_links, &running.probe_links, &mut kept);
        // Every field named: a setting added to the load settings must be kept here too.
        let LoadSettings { max_live, max_stacks, unwind, max_frames, max_unwind_rows, mappings, full_free_stacks } =
            &mut self.maps;
        let loaded = &running.maps;
        keep("max_live", max_live, &loaded.max_live, &mut kept);
        keep("max_stacks", max_stacks, &loaded.max_stacks, &mut kept);
        keep("unwind", unwind, &loaded.unwind, &mut kept);
        keep("max_frames", max_frames, &loaded.max_frames, &mut kept);
        keep("max_unwind_rows", max_unwind_rows, &loaded.max_unwind_rows, &mut kept);
        keep("mappings", mappings, &loaded.mappings, &mut kept);
        keep("full_free_stacks", full_free_stacks, &loaded.full_free_stacks, &mut kept);
        keep("max_unwind_rows_per_user", &mut self.unwind_rows_per_user, &running.unwind_rows_per_user, &mut kept);
        keep("[http]", &mut self.http, &running.http, &mut kept);
        keep("[access]", &mut self.access, &running.access, &mut kept);
        if self.sampling.usdt != running.sampling.usdt {
            kept.push("usdt (with the other sampling settings)");
            self.sampling = running.sampling;
        }
        kept
    }
}

/// Sets `value` back to `running`, and notes `name`, when they differ.
fn keep<T: PartialEq + Clone>(name: &'static str, value: &mut T, running: &T, kept: &mut Vec<&'static str>) {
    if value != running {
        *value = running.clone();
        kept.push(name);
    }
}

/// The one line an idle daemon logs, at start and at each reload that leaves it without rules:
/// why it traces nothing and how to give it something to trace.
pub fn idle_notice(config_file: &Path) -> String {
    let file = config_file.display();
    format!(
        "no rule is configured, so no process is traced: add one to {file} (comms = [\"^my-service$\"], \
         or cgroups, pids, all = true) and reload (systemctl reload memprof, or SIGHUP)"
    )
}

/// Reads the config file (if any) and applies the flags over it.
pub fn load(args: &DaemonArgs) -> Result<Config, ConfigError> {
    let file = match &args.config {
        Some(path) => read_file(path)?,
        None => File::default(),
    };
    merge(file, args)
}

/// The largest config or web config file read.
pub const SETTINGS_BYTES: u64 = 1 << 20;

fn read_file(path: &Path) -> Result<File, ConfigError> {
    let display = path.display().to_string();
    let text = crate::input::read_text(path, SETTINGS_BYTES)
        .map_err(|cause| ConfigError::Read { path: display.clone(), cause })?;
    toml::from_str(&text).map_err(|err| ConfigError::Parse {
        path: display,
        // toml's messages span several lines (with a caret under the spot): keep them on one.
        message: err.to_string().split_whitespace().collect::<Vec<_>>().join(" "),
    })
}

/// A list from the flags when any were given, else the file's.
fn pick<T: Clone>(flags: &[T], from_file: Option<Vec<T>>) -> Vec<T> {
    if flags.is_empty() {
        from_file.unwrap_or_default()
    } else {
        flags.to_vec()
    }
}

fn merge(file: File, args: &DaemonArgs) -> Result<Config, ConfigError> {
    let listen = args.listen.clone().or(file.listen).unwrap_or_else(|| "127.0.0.1:9464".to_string());
    let listen = listen.parse().map_err(|_| ConfigError::Listen(listen.clone()))?;
    let given = match &args.config {
        _ if !args.comms.is_empty() => "given with --comm".to_string(),
        Some(path) => format!("in comms of {}", path.display()),
        None => "in the config file's comms".to_string(),
    };
    let comms = pick(&args.comms, file.comms)
        .into_iter()
        .map(|pattern| {
            Regex::new(&pattern).map_err(|err| ConfigError::Regex {
                problem: regex_problem(&err),
                pattern,
                given: given.clone(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cgroups = pick(&args.cgroups, file.cgroups).iter().map(|dir| procfs::cgroup_path(dir)).collect();
    let rules = Rules { pids: pick(&args.pids, file.pids), comms, cgroups, all: args.all || file.all.unwrap_or(false) };
    // A config file without rules is the shipped one, not yet told what to trace: the daemon
    // starts idle and says so (`idle_notice`). Without a file, no rule is a forgotten flag.
    if rules.is_empty() && args.config.is_none() {
        return Err(ConfigError::NoTargets);
    }
    let interval = cli::check_interval(args.interval.or(file.interval).unwrap_or(5.0))
        .map_err(|e| ConfigError::Value("interval", e))?;
    let resync = cli::check_interval(args.resync_interval.or(file.resync_interval).unwrap_or(DEFAULT_RESYNC))
        .map_err(|e| ConfigError::Value("resync_interval", e))?;
    let leak = LeakSettings {
        window: args.leak_window.or(file.leak_window).unwrap_or(DEFAULT_LEAK.window),
        threshold: args.leak_threshold.or(file.leak_threshold).unwrap_or(DEFAULT_LEAK.threshold),
    };
    cli::leak_window(&leak.window.to_string()).map_err(|e| ConfigError::Value("leak_window", e))?;
    cli::leak_threshold(&leak.threshold.to_string()).map_err(|e| ConfigError::Value("leak_threshold", e))?;
    let file_max_rate = match &file.max_rate {
        Some(FileMaxRate::Calls(n)) => Some(sampling::max_rate(&n.to_string())),
        Some(FileMaxRate::Word(word)) => Some(sampling::max_rate(word)),
        None => None,
    };
    let file_max_rate = file_max_rate.transpose().map_err(|e| ConfigError::Value("max_rate", e))?;
    let growth = args.sampling.growth || file.growth.unwrap_or(false);
    let usdt = args.sampling.usdt || file.usdt.unwrap_or(false);
    let given_max_rate = args.sampling.max_rate.or(file_max_rate);
    let sampling = Sampling {
        sample_bytes: args.sampling.sample_bytes.or(file.sample_bytes),
        // A busy process goes to growth mode unless told otherwise.
        max_rate: given_max_rate.or((!growth && !usdt).then_some(MaxRate::Default)),
        growth,
        usdt,
    };
    if sampling.growth && (sampling.sample_bytes.is_some() || given_max_rate.is_some()) {
        return Err(ConfigError::Value(
            "growth",
            "traces pages, not allocator calls: drop sample_bytes and max_rate, or growth".into(),
        ));
    }
    if sampling.usdt && (sampling.sample_bytes.is_some() || given_max_rate.is_some() || sampling.growth) {
        return Err(ConfigError::Value(
            "usdt",
            "the allocator's own sampler replaces sample_bytes, max_rate and growth; set one or the other".into(),
        ));
    }
    if let Some(bytes) = sampling.sample_bytes {
        sampling::sample_bytes(&bytes.to_string()).map_err(|e| ConfigError::Value("sample_bytes", e))?;
    }
    let max_targets = args.max_targets.or(file.max_targets).unwrap_or(DEFAULT_MAX_TARGETS);
    if max_targets == 0 {
        return Err(ConfigError::Value("max_targets", "0 would trace nothing; give at least 1".to_string()));
    }
    let defaults = DEFAULT_LOAD;
    let maps = LoadSettings {
        max_live: args.max_live.or(file.max_live).unwrap_or(defaults.max_live),
        max_stacks: args.max_stacks.or(file.max_stacks).unwrap_or(defaults.max_stacks),
        unwind: args.unwind.or(file.unwind).unwrap_or(defaults.unwind),
        max_frames: args.max_frames.or(file.max_frames).unwrap_or(defaults.max_frames),
        max_unwind_rows: args.max_unwind_rows.or(file.max_unwind_rows).unwrap_or(defaults.max_unwind_rows),
        mappings: args.mappings || file.mappings.unwrap_or(defaults.mappings),
        full_free_stacks: args.full_free_stacks || file.full_free_stacks.unwrap_or(defaults.full_free_stacks),
    };
    let entries = 1..=MAX_MAP_ENTRIES;
    if !entries.contains(&maps.max_live) || !entries.contains(&maps.max_stacks) || maps.max_unwind_rows == 0 {
        return Err(ConfigError::Value(
            "map size",
            format!("max_live and max_stacks must be 1 to {MAX_MAP_ENTRIES}, max_unwind_rows at least 1"),
        ));
    }
    let unwind_rows_per_user = args
        .max_unwind_rows_per_user
        .or(file.max_unwind_rows_per_user)
        .unwrap_or(maps.max_unwind_rows.div_ceil(UNWIND_SHARES));
    if unwind_rows_per_user == 0 {
        return Err(ConfigError::Value(
            "max_unwind_rows_per_user",
            "0 would unwind no user's stacks; give at least 1".into(),
        ));
    }
    let keep_unwind_tables = match args.keep_unwind_tables.or(file.keep_unwind_tables) {
        Some(seconds @ 0..=MAX_KEEP_IDLE_SECONDS) => Duration::from_secs(seconds.into()),
        Some(_) => {
            return Err(ConfigError::Value("keep_unwind_tables", format!("give 0 to {MAX_KEEP_IDLE_SECONDS} seconds")))
        }
        None => KEEP_IDLE,
    };
    if !(1..=profiler_common::MAX_FRAMES as u32).contains(&maps.max_frames) {
        return Err(ConfigError::Value("max_frames", format!("give 1 to {}", profiler_common::MAX_FRAMES)));
    }
    let wrappers = Wrappers::merged(&args.wrappers, file.wrappers, file.auto_wrappers)
        .map_err(|e| ConfigError::Value("wrappers", e))?;
    let suppressions =
        if args.suppressions.is_empty() { file.suppressions.unwrap_or_default() } else { args.suppressions.clone() };
    let suppressions = Suppressions::load(&suppressions)?;
    let http = server::Settings::new(file.http, args.web_config_file.clone())
        .map_err(|(name, e)| ConfigError::Value(name, e))?;
    let access =
        access::Settings::new(file.access, args.socket.clone()).map_err(|(name, e)| ConfigError::Value(name, e))?;
    Ok(Config {
        listen,
        rules,
        max_targets,
        probe_links: args.probe_links.or(file.probe_links).unwrap_or(ProbeLinks::Auto),
        interval,
        resync,
        top_stacks: args.top_stacks.or(file.top_stacks).unwrap_or(10),
        size_histograms: args.size_histograms || file.size_histograms.unwrap_or(false),
        pid_labels: args.pid_labels || file.pid_labels.unwrap_or(false),
        leak,
        sampling,
        maps,
        unwind_rows_per_user,
        keep_unwind_tables,
        wrappers,
        suppressions,
        http,
        access,
    })
}

#[cfg(test)]
mod tests {
    use std::fs;

    use clap::Parser as _;
    use proptest::prelude::*;

    use super::*;
    use crate::cli::{
        tests::{flag_value, value_flags},
        Cli, Command,
    };
    use crate::heap::wrappers::WrapperArgs;

    fn parse(toml_text: &str, args: DaemonArgs) -> Result<Config, ConfigError> {
        let file =
            toml::from_str(toml_text).map_err(|e| ConfigError::Parse { path: "t".into(), message: e.to_string() })?;
        merge(file, &args)
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/memprof.toml");
        let args = DaemonArgs { config: Some(path), ..DaemonArgs::default() };
        let config = load(&args).unwrap();
        assert_eq!(config.listen.to_string(), "127.0.0.1:9464");
        // It traces nothing until told what to.
        assert!(config.rules.is_empty(), "{:?}", config.rules);
        assert_eq!(config.http, server::DEFAULT);
        assert_eq!(config.access, access::Settings::new(None, None).unwrap());
        // The values it gives are the defaults.
        assert_eq!(config.maps, DEFAULT_LOAD);
    }

    #[test]
    fn the_access_table_names_the_socket_its_group_and_inspection() {
        let text = "all = true\n[access]\nsocket = \"/tmp/x.sock\"\ngroup = \"root\"\ninspect = false\n";
        let access = parse(text, DaemonArgs::default()).unwrap().access;
        assert_eq!((access.socket, access.group, access.inspect), (Some("/tmp/x.sock".into()), Some(0), false));
        let args = DaemonArgs { socket: Some("".into()), ..DaemonArgs::default() };
        assert_eq!(parse(text, args).unwrap().access.socket, None, "--socket \"\" serves none");
        let err =
            parse("all = true\n[access]\ngroup = \"no-such-group-memprof\"\n", DaemonArgs::default()).unwrap_err();
        assert!(err.to_string().starts_with("invalid access.group: no group"), "{err}");
    }

    #[test]
    fn the_http_table_sets_the_listeners_limits() {
        let text = "all = true\n[http]\nmax_connections = 8\nheader_timeout = 0.5\nweb_config_file = \"w.yml\"\n";
        let http = parse(text, DaemonArgs::default()).unwrap().http;
        assert_eq!((http.max_connections, http.header_timeout), (8, std::time::Duration::from_millis(500)));
        assert_eq!(http.write_timeout, server::DEFAULT.write_timeout);
        let args = DaemonArgs { web_config_file: Some("flag.yml".into()), ..DaemonArgs::default() };
        assert_eq!(parse(text, args).unwrap().http.web_config_file, Some("flag.yml".into()));
        for (bad, name) in [
            ("max_connections = 0", "http.max_connections"),
            ("header_timeout = 0", "http.header_timeout"),
            ("max_header_bytes = 10", "http.max_header_bytes"),
        ] {
            let err = parse(&format!("all = true\n[http]\n{bad}\n"), DaemonArgs::default()).unwrap_err();
            assert!(err.to_string().starts_with(&format!("invalid {name}: ")), "{err}");
        }
        let err = parse("all = true\n[http]\nnope = 1\n", DaemonArgs::default()).unwrap_err();
        assert!(err.to_string().contains("unknown field `nope`"), "{err}");
    }

    #[test]
    fn unwind_tables_are_kept_a_minute_unless_told_and_at_most_a_day() {
        let keep =
            |text: &str| parse(&format!("all = true\n{text}"), DaemonArgs::default()).map(|c| c.keep_unwind_tables);
        assert_eq!(keep("").unwrap(), KEEP_IDLE);
        assert_eq!(keep("keep_unwind_tables = 0").unwrap(), Duration::ZERO);
        assert_eq!(keep("keep_unwind_tables = 86400").unwrap(), Duration::from_secs(86_400));
        let err = keep("keep_unwind_tables = 86401").unwrap_err();
        assert_eq!(err.to_string(), "invalid keep_unwind_tables: give 0 to 86400 seconds");
        let args = DaemonArgs { keep_unwind_tables: Some(5), ..DaemonArgs::default() };
        let flagged = parse("all = true\nkeep_unwind_tables = 60", args).unwrap();
        assert_eq!(flagged.keep_unwind_tables, Duration::from_secs(5));
    }

    #[test]
    fn a_reload_keeps_what_is_read_at_start_and_names_it() {
        let running = parse("all = true\ntop_stacks = 3\n", DaemonArgs::default()).unwrap();
        let text = "comms = [\"^a$\"]\ntop_stacks = 5\nlisten = \"127.0.0.1:1\"\nmax_live = 7\nusdt = true\n[http]\nmax_connections = 8\n";
        let mut reloaded = parse(text, DaemonArgs::default()).unwrap();
        let kept = reloaded.keep_read_at_start(&running);
        assert_eq!(kept, ["listen", "max_live", "[http]", "usdt (with the other sampling settings)"]);
        assert_eq!((reloaded.listen, reloaded.maps, &reloaded.http), (running.listen, running.maps, &running.http));
        assert_eq!(reloaded.sampling, running.sampling);
        // What a reload may change, it changes.
        assert_eq!(reloaded.top_stacks, 5);
        assert!(reloaded.rules.matches(7, "a", &[]) && !reloaded.rules.matches(7, "b", &[]));
        assert!(reloaded.clone().keep_read_at_start(&reloaded).is_empty());
    }

    #[test]
    fn flags_override_the_file() {
        let args =
            DaemonArgs { listen: Some("127.0.0.1:1".into()), comms: vec!["^b$".into()], ..DaemonArgs::default() };
        let config = parse("listen = \"0.0.0.0:9\"\ncomms = [\"^a$\"]\ntop_stacks = 3\n", args).unwrap();
        assert_eq!(config.listen.to_string(), "127.0.0.1:1");
        assert!(config.rules.matches(7, "b", &[]));
        assert!(!config.rules.matches(7, "a", &[]));
        assert_eq!(config.top_stacks, 3);
        assert_eq!(config.max_targets, DEFAULT_MAX_TARGETS);
        assert_eq!(config.leak, DEFAULT_LEAK);
    }

    #[test]
    fn bad_settings_are_refused_with_their_name() {
        let err = parse("comms = [\"(\"]", DaemonArgs::default()).unwrap_err();
        assert_eq!(err.to_string(), "invalid command-name regex `(` (in the config file's comms): unclosed group");
        let flags = DaemonArgs { comms: vec!["a[".into()], ..DaemonArgs::default() };
        let err = parse("", flags).unwrap_err();
        assert_eq!(err.to_string(), "invalid command-name regex `a[` (given with --comm): unclosed character class");
        let err = parse("all = true\nnope = 1", DaemonArgs::default()).unwrap_err();
        assert!(err.to_string().contains("unknown field `nope`"), "{err}");
        assert!(matches!(parse("", DaemonArgs::default()), Err(ConfigError::NoTargets)));
        // From a config file, no rule is a daemon waiting to be told what to trace.
        let from_file = DaemonArgs { config: Some("memprof.toml".into()), ..DaemonArgs::default() };
        assert!(parse("comms = []", from_file).unwrap().rules.is_empty());
        let err = parse("all = true\nlisten = \"nowhere\"", DaemonArgs::default()).unwrap_err();
        assert!(matches!(err, ConfigError::Listen(_)));
        // As a reload reads it too.
        let err = parse("all = true\ninterval = 1e-9", DaemonArgs::default()).unwrap_err();
        assert!(err.to_string().starts_with("invalid interval: `0.000000001` is not an interval from 0.1"), "{err}");
        let err = parse("all = true\nmax_live = 4294967295", DaemonArgs::default()).unwrap_err();
        assert!(err.to_string().contains("max_live and max_stacks must be 1 to 134217728"), "{err}");
    }

    #[test]
    fn suppressions_come_from_the_file_unless_flags_name_some() {
        let dir = std::env::temp_dir().join(format!("memprof-config-supp-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let (good, bad) = (dir.join("good.supp"), dir.join("bad.supp"));
        fs::write(&good, "{\n ours\n Memcheck:Leak\n fun:cache_*\n}\n").unwrap();
        fs::write(&bad, "fun:cache_*\n").unwrap();
        let text = |path: &Path| format!("all = true\nsuppressions = [\"{}\"]\n", path.display());
        assert!(!parse(&text(&good), DaemonArgs::default()).unwrap().suppressions.is_empty());
        let err = parse(&text(&bad), DaemonArgs::default()).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}:1: `fun:cache_*` is outside a suppression", bad.display())), "{err}");
        let args = DaemonArgs { suppressions: vec![good.clone()], ..DaemonArgs::default() };
        assert!(parse(&text(&bad), args).is_ok(), "the flag wins over the key");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn wrappers_come_from_the_file_unless_flags_name_some() {
        let text = "all = true\nwrappers = [\"my_alloc\"]\nauto_wrappers = false\n";
        let only = |names: &[&str]| {
            let wrappers = names.iter().map(|n| n.to_string()).collect();
            Wrappers::new(&WrapperArgs { wrappers, no_auto_wrappers: true })
        };
        assert_eq!(parse(text, DaemonArgs::default()).unwrap().wrappers, only(&["my_alloc"]));
        let flags = WrapperArgs { wrappers: vec!["pool_get".into()], no_auto_wrappers: false };
        let args = DaemonArgs { wrappers: flags, ..DaemonArgs::default() };
        assert_eq!(parse(text, args).unwrap().wrappers, only(&["pool_get"]), "auto_wrappers = false stands");
        assert_eq!(parse("all = true", DaemonArgs::default()).unwrap().wrappers, Wrappers::default());
        let err = parse("all = true\nwrappers = [\"\"]", DaemonArgs::default()).unwrap_err();
        assert!(err.to_string().starts_with("invalid wrappers: `` is not a function name"), "{err}");
    }

    #[test]
    fn cgroups_match_themselves_and_below() {
        let args = DaemonArgs { cgroups: vec!["/system.slice/".into()], ..DaemonArgs::default() };
        let rules = parse("", args).unwrap().rules;
        assert_eq!(rules.cgroups, vec!["/system.slice".to_string()]);
        let matches = |cgroup: &str| rules.matches(1, "x", &[cgroup.to_string()]);
        assert!(matches("/system.slice"));
        assert!(matches("/system.slice/nginx.service"));
        assert!(!matches("/system.slicer"));
        assert!(!rules.matches(1, "x", &[]));
    }

    #[test]
    fn only_a_cgroup_rule_needs_more_than_the_name() {
        let rules = |args: DaemonArgs| parse("", args).unwrap().rules;
        let comms = rules(DaemonArgs { comms: vec!["^nginx$".into()], ..DaemonArgs::default() });
        assert!(comms.may_match(7, "nginx"));
        assert!(!comms.may_match(7, "true"));
        let pids = rules(DaemonArgs { comms: vec!["^nginx$".into()], pids: vec![7], ..DaemonArgs::default() });
        assert!(pids.may_match(7, "true"));
        assert!(!pids.may_match(8, "true"));
        let cgroups = rules(DaemonArgs { cgroups: vec!["/system.slice".into()], ..DaemonArgs::default() });
        assert!(cgroups.may_match(8, "true"));
        assert!(rules(DaemonArgs { all: true, ..DaemonArgs::default() }).may_match(8, "true"));
    }

    #[test]
    fn rules_on_whole_names_give_the_kernel_those_names() {
        let names = |comms: &[&str]| {
            let args = DaemonArgs { comms: comms.iter().map(|c| c.to_string()).collect(), ..DaemonArgs::default() };
            parse("", args).unwrap().rules.exec_names().map(|keys| {
                let text = |key: &[u8; COMM_BYTES]| String::from_utf8_lossy(key).trim_end_matches('\0').to_string();
                keys.iter().map(text).filter(|name| !name.ends_with('\n')).collect::<Vec<_>>()
            })
        };
        assert_eq!(names(&["^nothing$"]), Some(vec!["nothing".to_string()]));
        assert_eq!(names(&["^(redis|valkey)-server$", r"\Anginx\z"]).map(|n| n.len()), Some(3));
        assert_eq!(names(&["^a-name-longer-than-the-kernel-keeps$"]), Some(vec![]));
        for pattern in
            ["nginx", "^nginx", "^ngin.$", "^ngin+x$", "(?m)^nginx$", r"^a\bb$", "^(a$|b)$", r"^a\\x01$", "^é$"]
        {
            assert_eq!(names(&["^nothing$", pattern]), None, "{pattern}");
        }
        let with_newlines = parse("", DaemonArgs { comms: vec!["^nothing$".into()], ..DaemonArgs::default() });
        assert_eq!(with_newlines.unwrap().rules.exec_names().unwrap().len(), COMM_BYTES - "nothing".len());
        let all = DaemonArgs { comms: vec!["^nothing$".into()], all: true, ..DaemonArgs::default() };
        assert_eq!(parse("", all).unwrap().rules.exec_names(), None);
        // A cgroup rule's execs are the kernel's to keep back by their cgroup, beside the names.
        let cgroups = DaemonArgs { comms: vec!["^x$".into()], cgroups: vec!["/a".into()], ..DaemonArgs::default() };
        assert_eq!(parse("", cgroups).unwrap().rules.exec_names().map(|keys| keys.len()), Some(COMM_BYTES - 1));
    }

    /// The config file's keys, and one it does not know.
    const KEYS: [&str; 30] = [
        "listen",
        "pids",
        "comms",
        "cgroups",
        "all",
        "max_targets",
        "interval",
        "resync_interval",
        "top_stacks",
        "size_histograms",
        "pid_labels",
        "leak_window",
        "leak_threshold",
        "sample_bytes",
        "max_rate",
        "growth",
        "usdt",
        "max_live",
        "max_stacks",
        "unwind",
        "max_frames",
        "max_unwind_rows",
        "max_unwind_rows_per_user",
        "keep_unwind_tables",
        "mappings",
        "full_free_stacks",
        "wrappers",
        "auto_wrappers",
        "suppressions",
        "nope",
    ];

    /// TOML values of every type, with the edge cases of each.
    fn toml_value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|v| v.to_string()),
            any::<f64>().prop_map(|v| if v.is_finite() { format!("{v:e}") } else { "nan".to_string() }),
            "\"[^\"\\\\]{0,20}\"",
            prop::sample::select(vec![
                "true",
                "0",
                "-1",
                "1e-300",
                "1e300",
                "inf",
                "-inf",
                "nan",
                "[]",
                "[0, -1, 4294967296]",
                "[\"(\", \"^a\"]",
                "\"cfi\"",
                "\"0.0.0.0:99999\"",
                "{}",
            ])
            .prop_map(String::from),
        ]
    }

    /// The `[http]` table's keys, and one it does not know.
    const HTTP_KEYS: [&str; 7] = [
        "max_connections",
        "max_connections_per_client",
        "header_timeout",
        "write_timeout",
        "max_header_bytes",
        "web_config_file",
        "nope",
    ];

    /// Lines of `keys` with any values.
    fn lines(keys: &'static [&'static str]) -> impl Strategy<Value = String> {
        prop::collection::vec((prop::sample::select(keys), toml_value()), 0..10)
            .prop_map(|lines| lines.iter().map(|(key, value)| format!("{key} = {value}\n")).collect())
    }

    /// Whole files: anything at all, or lines of known and unknown keys with any values, with or
    /// without an `[http]` table.
    fn config_text() -> impl Strategy<Value = String> {
        prop_oneof![
            ".{0,200}",
            lines(&KEYS),
            (lines(&KEYS), lines(&HTTP_KEYS)).prop_map(|(top, http)| format!("{top}[http]\n{http}")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn any_config_file_is_loaded_or_refused_without_panicking(text in config_text()) {
            let _ = parse(&text, DaemonArgs::default());
        }

        #[test]
        fn any_daemon_flag_value_is_loaded_or_refused_without_panicking(
            flag in prop::sample::select(value_flags().into_iter().filter(|(sub, flag)| sub == "daemon" && flag != "config").collect::<Vec<_>>()),
            value in flag_value(),
        ) {
            let parsed = Cli::try_parse_from(["memprof".to_string(), "daemon".into(), "--all".into(), format!("--{}", flag.1), value]);
            if let Ok(Cli { command: Command::Daemon(args) }) = parsed {
                let _ = load(&args);
            }
        }
    }
}
