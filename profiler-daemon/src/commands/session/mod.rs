//! One tracing session: attach to a process (or start one), report every interval, report at the end.

mod means;
mod tracer;

use std::{io, num::NonZeroU32, time::Duration};

use anyhow::Context as _;
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::{
    cli::{OnError, TraceArgs},
    commands::family::{self, how_traced, Process},
    commands::live::LiveView,
    commands::output::ReportOutput,
    commands::recording::RecordingWriter,
    commands::suppress::Suppressing,
    commands::target::{self, ExitWatch},
    console::say,
    error::UserError,
    heap::price::{PriceWatch, SystemCpu},
    heap::{blind_spots::BlindSpots, inspect, sampling::Sampling},
    kernel::loader::{self, Loaded},
    process::allocator::{self, Allocator},
    process::{procfs, usdt},
    symbolize::SymbolizerHandle,
};

use means::Means;
use tracer::{trace, Traced};

/// How an `attach` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attached {
    /// The target was traced to the end of the session, and runs on.
    Traced,
    /// The target was traced until it exited, which memprof has said.
    Exited,
    /// A stop signal (its number) came while the programs loaded: no probe was attached (or, for
    /// `run`, the command was not started).
    StoppedBefore(i32),
}

impl Attached {
    pub fn exit_code(self) -> i32 {
        match self {
            Self::Traced | Self::Exited => 0,
            Self::StoppedBefore(signal) => 128 + signal,
        }
    }
}

/// `memprof attach`.
pub async fn attach(pid: NonZeroU32, args: &TraceArgs) -> anyhow::Result<Attached> {
    // A process attached to is a running one, maybe a busy service: sampled above a rate unless
    // asked otherwise.
    let args = &TraceArgs { sampling: args.sampling.for_attach(), ..args.clone() };
    let mut opened = Opened::open(args)?;
    let pid_n = pid.get();
    if pid_n == std::process::id() {
        return Err(UserError::SelfTrace.into());
    }
    // Privileges first: without them /proc says too little about other users' processes.
    loader::check_support()?;
    procfs::check_traceable(pid_n)?;
    let Means { args, mut allocator, sites, beside_calls } = means::of_process(args, pid_n)?;
    let args = &args;
    // Its system time untraced, over the time memprof takes to load: what tracing adds is
    // measured against it.
    let untraced_from = SystemCpu::read(pid_n);
    let forking = forks_untraced_children(args, pid_n);
    if forking {
        say!("memprof: pid {pid_n} has children and --follow-forks is off: attaching perf-event uprobes, which a child it forks drops at its first call to each (they take about 90 ms each to detach)");
    }
    let mut loaded = loader::load(args.maps, args.interval, means::samplers(args), !forking)?;
    // Loading may take less than a rate needs (a fast machine): the rest is waited for, so that
    // the price is always measured against the untraced time.
    if let Some(from) = &untraced_from {
        tokio::time::sleep(from.wait_for_rate()).await;
    }
    if let Some(signal) = opened.stop.came().await {
        say!("memprof: stopped before tracing pid {pid_n} began: no probe was attached to it");
        return Ok(Attached::StoppedBefore(signal));
    }
    if args.sampling.growth {
        loaded.trace_page_faults()?;
    }
    let untraced = untraced_from.zip(SystemCpu::read(pid_n)).and_then(|(from, to)| to.rate_since(&from));
    let mut attachment = match &sites {
        Some(sites) => loaded.attach_usdt(sites, pid, None),
        None => loaded.attach(&allocator, pid),
    }
    .with_context(|| gone_or(pid_n))?;
    let beside = family::attach_beside_calls(beside_calls, &mut allocator, &mut loaded, pid, &mut attachment);
    let mut exit = ExitWatch::attached(pid_n).map_err(|_| UserError::NoSuchProcess(pid_n))?;
    let symbolizer = SymbolizerHandle::spawn();
    symbolizer.refresh(pid_n);
    let comm = procfs::comm(pid_n).unwrap_or_default();
    if let Some(sample_bytes) = args.sampling.sample_bytes {
        loaded.sample(pid_n, sample_bytes)?;
    }
    // Everything read from /proc before saying "tracing": a process that was waiting for it (a
    // test, a script) may exit at once.
    let probes = attachment.probes();
    let mut root = Process::new(
        pid_n,
        comm.clone(),
        procfs::exe_path(pid_n),
        attachment,
        allocator.clone(),
        settings(args),
        false,
    );
    root.sampler_beside_calls = beside;
    if args.sampling.traces_calls() && !allocator.files.is_empty() {
        root.price = PriceWatch::start(pid_n, untraced);
    }
    announce(pid_n, &comm, probes, &allocator, args.sampling, sites.as_deref());
    // What it held already, growth mode cannot see into: said now, as the reports will.
    let held_before = root.blind_spots.as_ref().and_then(BlindSpots::held_before_pages);
    if let Some(spot) = held_before {
        say_not_seen(pid_n, &spot);
    }
    let inspect = args.inspect.then(|| inspect::Settings {
        glibc: allocator.is_glibc(),
        complete: false,
        precopy: args.inspect_precopy,
        heuristics: args.inspect_heuristics,
    });
    let traced = trace(loaded, symbolizer, root, &mut exit, args, opened, inspect).await?;
    Ok(if traced.ended { Attached::Exited } else { Attached::Traced })
}

/// memprof cannot go on: says so, leaves the command running or stops it (`--on-error`), and
/// returns its exit code once it ends.
async fn give_up(err: &anyhow::Error, on_error: OnError, pid: u32, exit: &mut ExitWatch) -> i32 {
    match on_error {
        OnError::Continue => say!(
            "memprof: cannot go on: {err:#}; the command runs on untraced, and memprof exits with its exit code when it ends"
        ),
        OnError::Stop => {
            say!(
                "memprof: cannot go on: {err:#}; stopping the command with SIGTERM (--on-error stop), and memprof exits with its exit code"
            );
            if !exit.ended() {
                // SAFETY: kill takes a pid and a signal. The pid is memprof's own child's and
                // its code not sent yet: it is reaped at most a moment ago, and the kernel hands
                // out pids in order, so no other process has it now.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            }
        }
    }
    exit.exited().await.unwrap_or(1)
}

/// Exit code of `memprof run --fail-on-leak-bytes` when the leak candidates hold more.
pub const LEAK_EXIT_CODE: i32 = 100;

/// `memprof run`: returns the command's exit code, or `LEAK_EXIT_CODE` when its leak candidates
/// hold more than `fail_on_leak_bytes` at the end.
pub async fn run(
    command: &[std::ffi::OsString],
    args: &TraceArgs,
    fail_on_leak_bytes: Option<u64>,
    on_error: OnError,
) -> anyhow::Result<i32> {
    if args.inspect && args.duration.is_none() {
        return Err(UserError::InspectNeedsDuration.into());
    }
    let mut opened = Opened::open(args)?;
    let (program, command) = target::as_a_shell_starts(target::resolve_program(&command[0])?, command);
    if allocator::runs_valgrind(&program) {
        return Err(UserError::ValgrindCommand(program).into());
    }
    loader::check_support()?;
    let (Means { args, mut allocator, sites, beside_calls }, files) = means::of_command(args, &program)?;
    let args = &args;
    let routed = allocator.route_through_malloc();
    // Whatever the command runs first: a program it execs later is routed too.
    let routes = Allocator::routes_for_any_program();
    let mut loaded = loader::load(args.maps, args.interval, means::samplers(args), true)?;
    if let Some(signal) = opened.stop.came().await {
        say!("memprof: stopped before starting {}: it was not run", program.display());
        return Ok(Attached::StoppedBefore(signal).exit_code());
    }
    if args.sampling.growth {
        loaded.trace_page_faults()?;
    }
    let symbolizer = SymbolizerHandle::spawn();
    // Until it has run, the child's name is memprof's: name it as the kernel will after exec.
    let comm: String = program.file_name().unwrap_or_default().to_string_lossy().chars().take(15).collect();
    let comm = crate::text::printable(&comm).into_owned();
    // By the name it is run as, as `procfs::exe_path` names it (a link's name, not its target's).
    let executable = std::path::absolute(&program).unwrap_or_else(|_| program.clone()).display().to_string();
    let (child, exit_code) = target::spawn(program, &command, &routes)?;
    let pid = child.pid;
    let mut exit = ExitWatch::Child(exit_code, None);
    // From here on the command runs whatever happens to memprof (the child execs once `child`
    // is released or dropped): its fate is memprof's exit code.
    let ready = Ready { loaded, symbolizer, allocator, files, routed, comm, executable, sites, beside_calls };
    let traced = match trace_command(child, &mut exit, ready, args, opened).await {
        Ok(traced) => traced,
        Err(err) => {
            let code = give_up(&err, on_error, pid, &mut exit).await;
            if fail_on_leak_bytes.is_some() && code == 0 {
                // A gate that could not be judged does not pass.
                say!("memprof: --fail-on-leak-bytes could not be judged: exiting with 1");
                return Ok(1);
            }
            return Ok(code);
        }
    };
    let code = traced.code.unwrap_or(0);
    let gate = &traced.gate;
    match fail_on_leak_bytes {
        Some(limit) if gate.candidates > limit => {
            say!(
                "memprof: leak candidates hold {} bytes, more than --fail-on-leak-bytes {limit}: exiting with {LEAK_EXIT_CODE}",
                gate.candidates
            );
            Ok(LEAK_EXIT_CODE)
        }
        // The bytes the rule has no verdict on could hold a leak above the limit: not a pass.
        Some(limit) if gate.unjudged > limit => {
            let exit = if code == 0 { 1 } else { code };
            say!(
                "memprof: --fail-on-leak-bytes could not be judged: {} bytes are held by processes the leak rule has no verdict on yet (it needs {} intervals of {} s, and the command was traced {:.1} s); give a shorter --interval or --leak-window: exiting with {exit}",
                gate.unjudged,
                args.leak_window,
                args.interval,
                gate.traced_s
            );
            Ok(exit)
        }
        _ => Ok(code),
    }
}

/// What `run` makes ready before it forks its command.
struct Ready {
    loaded: Loaded,
    symbolizer: SymbolizerHandle,
    allocator: Allocator,
    /// The files the command will map that hold its allocator.
    files: Vec<std::path::PathBuf>,
    /// What the command is started with so that it goes through malloc.
    routed: Vec<allocator::BlindSpot>,
    comm: String,
    executable: String,
    /// The command's `otel_memory` probe sites, with `--usdt`.
    sites: Option<Vec<usdt::Site>>,
    /// Its Go runtime's sampler, to attach beside its calls (see `Means::beside_calls`).
    beside_calls: Option<Vec<usdt::Site>>,
}

/// `run`'s command, forked and waiting, traced from its exec to the session's end.
async fn trace_command(
    child: target::Child,
    exit: &mut ExitWatch,
    ready: Ready,
    args: &TraceArgs,
    opened: Opened,
) -> anyhow::Result<Traced> {
    let Ready { mut loaded, symbolizer, mut allocator, files, routed, comm, executable, sites, beside_calls } = ready;
    let pid = child.pid;
    // The child is our own and cannot be pid 0.
    let nonzero = NonZeroU32::new(pid).expect("a child's pid is positive");
    let mut attachment = match &sites {
        Some(sites) => loaded.attach_usdt(sites, nonzero, Some(&files))?,
        None => loaded.attach_before_exec(&allocator, nonzero, &files)?,
    };
    let beside = family::attach_beside_calls(beside_calls, &mut allocator, &mut loaded, nonzero, &mut attachment);
    if let Some(sample_bytes) = args.sampling.sample_bytes {
        loaded.sample(pid, sample_bytes)?;
    }
    let probes = attachment.probes();
    let mut root =
        Process::new(pid, comm.clone(), Some(executable), attachment, allocator.clone(), settings(args), true);
    root.sampler_beside_calls = beside;
    announce(pid, &comm, probes, &allocator, args.sampling, sites.as_deref());
    if sites.is_none() && args.sampling.traces_calls() {
        probe_standby(&mut loaded, &mut root, &allocator);
    }
    for spot in &routed {
        let entry = spot.unless_env.unwrap_or_default();
        let name = spot.env_name().unwrap_or_default();
        say!(
            "memprof: starting the command with {entry}, so that what memprof would not see passes through malloc ({}); set {name} yourself to keep it as it is",
            spot.what
        );
    }
    child.release();
    // memprof saw every allocation of an unsampled command: none unseen can hold a pointer.
    let complete = args.sampling.sample_bytes.is_none() && args.sampling.traces_calls();
    let inspect = args.inspect.then(|| inspect::Settings {
        glibc: allocator.is_glibc(),
        complete,
        precopy: args.inspect_precopy,
        heuristics: args.inspect_heuristics,
    });
    trace(loaded, symbolizer, root, exit, args, opened, inspect).await
}

/// Probes the preloadable allocators the command does not map for it too (`allocator::standby`),
/// for a program it execs with one preloaded (`env LD_PRELOAD=... prog`).
fn probe_standby(loaded: &mut Loaded, root: &mut Process, allocator: &Allocator) {
    let standby = allocator::standby(allocator);
    if standby.files.is_empty() {
        return;
    }
    let Some(pid) = NonZeroU32::new(root.pid) else { return };
    match loaded.attach_standby(&standby, pid) {
        Ok(attachment) => {
            say!(
                "memprof: also probing {} for pid {pid}, for a program it execs with one preloaded",
                standby.describe()
            );
            root.also_probed(attachment, &standby);
        }
        Err(err) => say!(
            "memprof: a program pid {pid} execs with {} preloaded is not seen until probed: {err:#}",
            standby.describe()
        ),
    }
}

fn settings(args: &TraceArgs) -> (crate::heap::sampling::Sampling, crate::heap::leak::LeakSettings) {
    (args.sampling, args.leak_settings())
}

fn gone_or(pid: u32) -> String {
    if procfs::check_traceable(pid).is_err() {
        format!("pid {pid} exited while probes were being attached")
    } else {
        format!("attaching probes to pid {pid}")
    }
}

/// Whether the session follows its target's children: with `--follow-forks`, else for `run`'s
/// command (but with `--usdt`, which refuses it), not for a process `attached` to.
fn follows_forks(args: &TraceArgs, attached: bool) -> bool {
    args.follow_forks.unwrap_or(!attached && !args.sampling.usdt)
}

/// Whether process `pid`, attached to, is a forking server whose children memprof does not
/// follow: one with children now, whose next children may live for milliseconds. Such children
/// keep copies of its breakpoints: uprobe_multi links leave them until memprof sweeps them, at
/// its next interval, while a perf-event uprobe is dropped from a child at its first trap there.
/// So it gets perf-event uprobes, when its allocator calls are what is traced.
fn forks_untraced_children(args: &TraceArgs, pid: u32) -> bool {
    args.sampling.traces_calls()
        && !follows_forks(args, true)
        && procfs::children(pid).is_ok_and(|children| !children.is_empty())
}

/// `usdt_sites`: with `--usdt`, the probe sites attached.
fn announce(
    pid: u32,
    comm: &str,
    probes: usize,
    allocator: &Allocator,
    sampling: Sampling,
    usdt_sites: Option<&[usdt::Site]>,
) {
    if let Some(sites) = usdt_sites {
        let through = usdt::describe(sites);
        say!("memprof: tracing pid {pid} ({comm}) with {through} (no allocator probes); Ctrl-C to stop");
        return;
    }
    if allocator.files.is_empty() {
        say!(
            "memprof: tracing pid {pid} ({comm}) by the memory it maps and touches only: its allocator is a runtime's, which memprof does not probe; Ctrl-C to stop"
        );
    } else {
        say!("memprof: tracing pid {pid} ({comm}) {}; Ctrl-C to stop", how_traced(sampling.growth, probes, allocator));
    }
    // Growth mode sees every page a heap first touches, a runtime's too.
    let unseen = allocator.unprobed.iter().filter(|_| !sampling.growth);
    for spot in unseen.filter(|s| s.unless_env.is_none_or(|entry| !procfs::has_env(pid, entry))) {
        say_not_seen(pid, spot);
    }
}

fn say_not_seen(pid: u32, spot: &allocator::BlindSpot) {
    say!("memprof: not seen in pid {pid}: {}; {}", spot.what, spot.advice);
}

/// What a session opens before anything else: where its reports and recording go (checked
/// before any probe is attached) and the signals that end it.
struct Opened {
    output: ReportOutput,
    recording: Option<RecordingWriter>,
    stop: StopSignals,
    suppressing: Suppressing,
    live: Option<LiveView>,
}

impl Opened {
    fn open(args: &TraceArgs) -> anyhow::Result<Self> {
        if args.record.is_some() && args.record == args.output.file {
            return Err(UserError::RecordIsOutput.into());
        }
        Ok(Self {
            output: ReportOutput::open(args.output.format(), args.output.file.as_deref())?,
            recording: args.record.as_deref().map(RecordingWriter::create).transpose()?,
            stop: StopSignals::new()?,
            suppressing: Suppressing::open(&args.suppress, &args.output, args.output.format())?,
            live: args.live.then(LiveView::open).transpose()?,
        })
    }
}

/// The signals that end a session with its final report: Ctrl-C, `kill`, a closed terminal or
/// `kill -HUP`. Caught from the session's start: one that comes while probes are attached still
/// ends it properly.
struct StopSignals {
    interrupt: Signal,
    terminate: Signal,
    hangup: Signal,
}

impl StopSignals {
    fn new() -> io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// Waits for one; returns its number.
    async fn recv(&mut self) -> i32 {
        tokio::select! {
            _ = self.interrupt.recv() => libc::SIGINT,
            _ = self.terminate.recv() => libc::SIGTERM,
            _ = self.hangup.recv() => libc::SIGHUP,
        }
    }

    /// The one that came already (while the programs loaded, which blocks this thread), if
    /// any: the runtime is given a moment to read the signal's wake-up first.
    async fn came(&mut self) -> Option<i32> {
        tokio::time::timeout(Duration::from_millis(20), self.recv()).await.ok()
    }
}
