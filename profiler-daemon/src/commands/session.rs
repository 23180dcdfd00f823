//! One tracing session: attach to a process (or start one), report every interval, report at the end.

use std::{collections::HashMap, io, num::NonZeroU32, time::Duration};

use std::os::fd::AsFd as _;

use anyhow::Context as _;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{signal, Signal, SignalKind},
};

use crate::{
    cli::{OnError, TraceArgs, MAX_SECONDS},
    commands::family::{Family, Process},
    commands::live::LiveView,
    commands::output::ReportOutput,
    commands::recording::{RecordingWriter, Settings},
    commands::suppress::{self, Suppressing},
    commands::target::{self, ExitWatch},
    console::say,
    error::UserError,
    format::{self, Format},
    heap::context::RunContext,
    heap::inspect::{self, Inspection},
    heap::price::{Mode, PriceWatch, SystemCpu},
    heap::report::{self, Report, Selection},
    heap::resident::{HeapNow, PinnedBudget, Resident},
    heap::sampling::Switch,
    heap::suppressions::Suppressions,
    heap::threads::{self, ThreadNames},
    heap::wrappers::Wrappers,
    kernel::aggregate::{self, DoubleFreeReader},
    kernel::loader::{self, Loaded},
    process::allocator::{self, Allocator},
    process::{procfs, usdt},
    symbolize::SymbolizerHandle,
};

/// `memprof attach`: returns the exit code (0: the target was traced to the end of the session).
pub async fn attach(pid: NonZeroU32, args: &TraceArgs) -> anyhow::Result<i32> {
    // A process attached to is a running one, maybe a busy service: sampled above a rate unless
    // asked otherwise.
    let args = &TraceArgs { sampling: args.sampling.for_attach(), ..args.clone() };
    let opened = Opened::open(args)?;
    let pid_n = pid.get();
    if pid_n == std::process::id() {
        return Err(UserError::SelfTrace.into());
    }
    // Privileges first: without them /proc says too little about other users' processes.
    loader::check_support()?;
    procfs::check_traceable(pid_n)?;
    let allocator = allocator::find_with(pid_n, runtime_only(args))?;
    // Its system time untraced, over the time memprof takes to load: what tracing adds is
    // measured against it.
    let untraced_from = SystemCpu::read(pid_n);
    let sites = usdt_sites(args, || usdt::in_process(pid_n))?;
    let mut loaded = loader::load(args.maps, args.interval, args.sampling.usdt)?;
    loaded.follow_forks = args.follow_forks.unwrap_or(false);
    if args.sampling.growth {
        loaded.trace_page_faults()?;
    }
    let untraced = untraced_from.zip(SystemCpu::read(pid_n)).and_then(|(from, to)| to.rate_since(&from));
    let attachment = match &sites {
        Some(sites) => loaded.attach_usdt(sites, pid, None),
        None => loaded.attach(&allocator, pid),
    }
    .with_context(|| gone_or(pid_n))?;
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
    if args.sampling.traces_calls() && !allocator.files.is_empty() {
        root.price = PriceWatch::start(pid_n, untraced);
    }
    announce(pid_n, &comm, probes, &allocator, sites.as_ref().map(Vec::len));
    let inspect = args.inspect.then(|| inspect::Settings {
        glibc: allocator.is_glibc(),
        complete: false,
        precopy: args.inspect_precopy,
        heuristics: args.inspect_heuristics,
    });
    let traced = trace(loaded, symbolizer, root, &mut exit, args, opened, inspect).await?;
    Ok(traced.code.unwrap_or(0))
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
    let opened = Opened::open(args)?;
    let program = target::resolve_program(&command[0])?;
    loader::check_support()?;
    let (mut allocator, files) = allocator::for_command(&program, runtime_only(args))?;
    let sites = usdt_sites(args, || usdt::in_files(&files, &program))?;
    let routed = allocator.route_through_malloc();
    // Whatever the command runs first: a program it execs later is routed too.
    let routes = Allocator::routes_for_any_program();
    let mut loaded = loader::load(args.maps, args.interval, args.sampling.usdt)?;
    loaded.follow_forks = args.follow_forks.unwrap_or(!args.sampling.usdt);
    if args.sampling.growth {
        loaded.trace_page_faults()?;
    }
    let symbolizer = SymbolizerHandle::spawn();
    // Until it has run, the child's name is memprof's: name it as the kernel will after exec.
    let comm: String = program.file_name().unwrap_or_default().to_string_lossy().chars().take(15).collect();
    let comm = crate::text::printable(&comm).into_owned();
    // By the name it is run as, as `procfs::exe_path` names it (a link's name, not its target's).
    let executable = std::path::absolute(&program).unwrap_or_else(|_| program.clone()).display().to_string();
    let (child, exit_code) = target::spawn(program, command, &routes)?;
    let pid = child.pid;
    let mut exit = ExitWatch::Child(exit_code, None);
    // From here on the command runs whatever happens to memprof (the child execs once `child`
    // is released or dropped): its fate is memprof's exit code.
    let ready = Ready { loaded, symbolizer, allocator, files, routed, comm, executable, sites };
    let traced = match trace_command(child, &mut exit, ready, args, opened).await {
        Ok(traced) => traced,
        Err(err) => return Ok(give_up(&err, on_error, pid, &mut exit).await),
    };
    match fail_on_leak_bytes {
        Some(limit) if traced.leak_bytes > limit => {
            say!(
                "memprof: leak candidates hold {} bytes, more than --fail-on-leak-bytes {limit}: exiting with {LEAK_EXIT_CODE}",
                traced.leak_bytes
            );
            Ok(LEAK_EXIT_CODE)
        }
        _ => Ok(traced.code.unwrap_or(0)),
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
}

/// `run`'s command, forked and waiting, traced from its exec to the session's end.
async fn trace_command(
    child: target::Child,
    exit: &mut ExitWatch,
    ready: Ready,
    args: &TraceArgs,
    opened: Opened,
) -> anyhow::Result<Traced> {
    let Ready { mut loaded, symbolizer, allocator, files, routed, comm, executable, sites } = ready;
    let pid = child.pid;
    // The child is our own and cannot be pid 0.
    let nonzero = NonZeroU32::new(pid).expect("a child's pid is positive");
    let attachment = match &sites {
        Some(sites) => loaded.attach_usdt(sites, nonzero, Some(&files))?,
        None => loaded.attach_before_exec(&allocator, nonzero, &files)?,
    };
    if let Some(sample_bytes) = args.sampling.sample_bytes {
        loaded.sample(pid, sample_bytes)?;
    }
    let probes = attachment.probes();
    let mut root =
        Process::new(pid, comm.clone(), Some(executable), attachment, allocator.clone(), settings(args), true);
    announce(pid, &comm, probes, &allocator, sites.as_ref().map(Vec::len));
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

/// With `--usdt`, the process's `otel_memory` probe sites, found before anything is loaded: none
/// is an error naming the fix. A process traced so has no allocator probe, and its forks are not
/// followed (they would get allocator probes).
fn usdt_sites(
    args: &TraceArgs,
    find: impl FnOnce() -> Result<Vec<usdt::Site>, UserError>,
) -> Result<Option<Vec<usdt::Site>>, UserError> {
    if !args.sampling.usdt {
        return Ok(None);
    }
    if args.follow_forks == Some(true) {
        return Err(UserError::UsdtFollowForks);
    }
    find().map(Some)
}

/// A process whose only allocator is a runtime's (a pure Go binary) is traced by what it maps or
/// touches, when that is traced.
fn runtime_only(args: &TraceArgs) -> allocator::RuntimeOnly {
    allocator::RuntimeOnly::accepted_if(args.maps.mappings || args.sampling.growth)
}

/// `usdt_sites`: with `--usdt`, how many `otel_memory` probe sites are attached.
fn announce(pid: u32, comm: &str, probes: usize, allocator: &Allocator, usdt_sites: Option<usize>) {
    if let Some(sites) = usdt_sites {
        say!(
            "memprof: tracing pid {pid} ({comm}) with {sites} otel_memory probes, the allocator's own sampler (no allocator probes); Ctrl-C to stop"
        );
        return;
    }
    if allocator.files.is_empty() {
        say!(
            "memprof: tracing pid {pid} ({comm}) by the memory it maps and touches only: its allocator is a runtime's, which memprof does not probe; Ctrl-C to stop"
        );
    } else {
        say!("memprof: tracing pid {pid} ({comm}) with {probes} probes in {}; Ctrl-C to stop", allocator.describe());
    }
    for spot in allocator.unprobed.iter().filter(|s| s.unless_env.is_none_or(|entry| !procfs::has_env(pid, entry))) {
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

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
            _ = self.hangup.recv() => {}
        }
    }
}

/// How a trace ended.
struct Traced {
    /// The target's exit code when memprof started it.
    code: Option<i32>,
    /// In-use bytes of the final report's leak candidates, children included.
    leak_bytes: u64,
}

/// What a session reads and reports from.
struct Tracer<'a> {
    loaded: Loaded,
    symbolizer: SymbolizerHandle,
    family: Family,
    args: &'a TraceArgs,
    start_ns: u64,
    min_age_ns: u64,
    context: RunContext,
    /// Every report is built whole (every stack) for the recording; the format takes its part.
    recording: bool,
    /// The root process's inspection, for its final report.
    inspection: Option<Inspection>,
    pinned_budget: PinnedBudget,
    wrappers: Wrappers,
    suppressions: &'a Suppressions,
    /// With `--threads`, each process's threads' names, read each interval.
    thread_names: HashMap<u32, ThreadNames>,
}

impl Tracer<'_> {
    fn stacks(&self, pid: u32) -> report::Stacks<'_> {
        report::Stacks {
            ebpf: &self.loaded.ebpf,
            unwind: &self.loaded.unwind,
            symbolizer: &self.symbolizer,
            pid,
            // A child's times count from when it was followed, not from the session's start.
            start_ns: self.family.get(pid).map_or(self.start_ns, |process| process.start_ns),
            known: None,
            wrappers: &self.wrappers,
        }
    }

    /// New libraries get their tables (and are probed when they hold the allocator), and walks
    /// the kernel deferred are finished on them.
    fn on_unwind_events(&mut self) {
        // Read, then the execs, then used: a program's mapping changes come after the exec that
        // started it, whose path names its executable when it is gone before its mappings are
        // read (see `UnwindEvents::collect`).
        self.loaded.unwind_events.collect();
        self.family.on_process_events(&mut self.loaded, &self.symbolizer);
        let (symbolizer, family) = (&self.symbolizer, &self.family);
        let exe_of = |pid| family.get(pid).map(|process| process.exe.clone());
        let on_read = |pid, mappings: &[_]| symbolizer.refresh_with(pid, mappings.to_vec());
        for pid in self.loaded.sync_changed_mappings_with(exe_of, on_read) {
            self.family.probe(&mut self.loaded, pid);
            if let Some(spots) = self.family.get_mut(pid).and_then(|process| process.blind_spots.as_mut()) {
                spots.learn_new_files(pid).iter().for_each(|spot| say_not_seen(pid, spot));
            }
        }
    }

    /// Refreshes what is known of the live processes and collects their double frees.
    fn collect(&mut self, double_free_reader: &mut DoubleFreeReader) {
        // Before the reports: a walk deferred since the last event is finished for them.
        self.on_unwind_events();
        let pids = self.family.pids();
        for pid in pids {
            if let Some(current) = procfs::comm(pid) {
                if let Some(process) = self.family.get_mut(pid) {
                    process.comm = current;
                    // Unreadable for a moment while the process execs.
                    if let Some(exe) = procfs::exe_path(pid) {
                        process.exe = exe;
                    }
                }
                self.loaded.sync_mappings(pid);
                self.symbolizer.refresh(pid);
                if self.args.threads {
                    self.thread_names.entry(pid).or_default().refresh(pid);
                }
            }
        }
        self.family.probe_waiting(&mut self.loaded);
        for event in double_free_reader.drain() {
            let double_free = self.stacks(event.tgid).double_free(&event);
            let Some(process) = self.family.get_mut(event.tgid) else { continue };
            if process.double_free_filter.as_ref().is_none_or(|filter| filter.is_user(&double_free)) {
                process.double_frees.push(double_free);
            }
        }
    }

    /// Reads the kernel's counters (the leak rule needs every interval's); returns the reports of
    /// `pids` (all when None), the root's with its children, when one is to be written.
    fn read(&mut self, is_final: bool, only: Option<u32>) -> anyhow::Result<Option<Report>> {
        let pids = only.map_or_else(|| self.family.pids(), |pid| [pid].into());
        let kernel = self.loaded.read(&pids, self.min_age_ns)?;
        let clock = self.loaded.ages.clock;
        let mut switches = Vec::new();
        // The session's final report reads the pinned pages whatever the budget (a child's
        // exit, which may come in storms, does not).
        let residents = self
            .family
            .processes_mut()
            .filter(|p| pids.contains(&p.pid))
            .map(|p| (p.pid, &mut p.resident, HeapNow::of(kernel.processes.get(&p.pid))));
        Resident::read_all(
            &self.loaded.ebpf,
            kernel.live_entries,
            residents,
            &mut self.pinned_budget,
            is_final && only.is_none(),
        )?;
        for process in self.family.processes_mut().filter(|p| pids.contains(&p.pid)) {
            let Some(snapshot) = kernel.processes.get(&process.pid) else { continue };
            // A final read switches nothing: the tracing ends.
            if let Some(switch) = process.rate_guard.check(snapshot).filter(|_| !is_final) {
                switches.push((process.pid, switch));
            }
            let time_s = (snapshot.now_ns.saturating_sub(process.start_ns)) as f64 / 1e9;
            // A final read moments after the last interval is no interval of its own: it stands
            // in for the last (see `observe_instead_of_last`).
            let since_last = time_s - process.leaks.last_time_s().unwrap_or(f64::NEG_INFINITY);
            if is_final && since_last < self.args.interval / 2.0 {
                process.leaks.observe_instead_of_last(snapshot, &clock, time_s);
            } else {
                process.leaks.observe(snapshot, &clock, time_s);
            }
        }
        for (pid, switch) in switches {
            self.switch(pid, switch)?;
        }
        let format = self.args.output.format();
        if !is_final && !format.streams() && !self.recording && !self.args.live {
            return Ok(None);
        }
        let selection = Selection {
            is_final,
            // Filters, suppressions and generated rules see every stack; the format shows the top.
            top: (format == Format::Table
                && self.args.filters.is_empty()
                && self.suppressions.is_empty()
                && !self.args.suppress.gen_suppressions
                && !self.recording
                && !self.args.live)
                .then_some(self.args.top),
            aged_only: self.min_age_ns > 0,
            freed: format == Format::Pprof || self.recording,
            whole_peak: self.recording,
        };
        let mut by_thread = if self.args.threads {
            let sample_bytes = |pid| kernel.processes.get(&pid).map_or(0, |s| s.sample_bytes);
            threads::read(&self.loaded.ebpf, &pids, sample_bytes)?
        } else {
            HashMap::new()
        };
        // The root's inspection, given to its report before suppressions take their blocks out.
        let mut inspection = self.inspection.take();
        let mut reports: Vec<Report> = self
            .family
            .processes()
            .filter(|p| pids.contains(&p.pid))
            .map(|process| {
                let ctx = report::Context {
                    stacks: self.stacks(process.pid),
                    comm: &process.comm,
                    ns_pid: process.ns_pid,
                    double_frees: &process.double_frees,
                    leaks: &process.leaks,
                    pinned: process.resident.pinned(),
                };
                let snapshot = kernel.processes.get(&process.pid).cloned().unwrap_or_default();
                let mut report = report::build(&ctx, &snapshot, &kernel, selection);
                report.exe = process.exe.clone();
                report.parent = process.parent;
                report.memory = process.resident.current(process.pid, report.totals.outstanding_bytes);
                report.blind_spots = process.blind_spots.as_ref().map_or_else(Vec::new, |b| {
                    b.current(report.memory, report.totals.allocations, report.mappings.outstanding_bytes)
                });
                if let Some(tally) = by_thread.remove(&process.pid) {
                    report.threads = tally.view(self.thread_names.get(&process.pid));
                }
                if let Some(inspection) = inspection.take_if(|_| process.pid == self.family.root) {
                    report::add_inspection(&mut report, inspection, &self.stacks(process.pid));
                }
                self.suppressions.apply(&mut report);
                if !self.args.filters.is_empty() {
                    self.args.filters.apply(&mut report);
                }
                report
            })
            .collect();
        if only.is_some() {
            return Ok(reports.pop());
        }
        let root_at = reports.iter().position(|r| r.pid == self.family.root);
        let Some(mut root) = root_at.map(|at| reports.remove(at)) else { return Ok(None) };
        root.forks = self.family.forks(&self.loaded);
        root.unwind_tables = Some(self.loaded.unwind.table_use());
        root.context = Some(self.context.clone());
        root.children = self.family.exited_reports().iter().cloned().chain(reports).collect();
        Ok(Some(root))
    }

    /// Samples `pid` from now on, and says so.
    fn switch(&mut self, pid: u32, switch: Switch) -> anyhow::Result<()> {
        self.loaded.sample(pid, switch.sample_bytes)?;
        say!("{}", switch.line(pid));
        Ok(())
    }

    /// When the next process's price is due (CLOCK_MONOTONIC, ns), if any is still to be said.
    fn next_price_ns(&self) -> Option<u64> {
        self.family.processes().filter_map(|p| p.price.map(|watch| watch.due_ns())).min()
    }

    /// Says the price of each process traced for a second now: the root's always, a followed
    /// child's when it is worth saving (a build's compilers would fill the terminal otherwise).
    /// The count read for it is checked against `--max-rate` too, so that a busy process is
    /// switched to sampling after its first second, not its first intervals.
    fn say_prices(&mut self) -> anyhow::Result<()> {
        let now_ns = aggregate::monotonic_now_ns();
        // Taken whatever happens next: each price is said once at most.
        let due: HashMap<u32, PriceWatch> = self
            .family
            .processes_mut()
            .filter(|p| p.price.is_some_and(|watch| watch.due_ns() <= now_ns))
            .filter_map(|p| Some((p.pid, p.price.take()?)))
            .collect();
        if due.is_empty() {
            return Ok(());
        }
        let calls = self.loaded.calls(&due.keys().copied().collect())?;
        let root = self.family.root;
        let mut switches = Vec::new();
        for process in self.family.processes_mut() {
            let (Some(watch), Some(count)) = (due.get(&process.pid), calls.get(&process.pid)) else { continue };
            let Some(now) = SystemCpu::read(process.pid) else { continue };
            let switch = process.rate_guard.check_calls(now.at_ns, count.calls, count.sample_bytes);
            let mode = match (switch, count.sample_bytes) {
                (Some(_), _) => Mode::Switched,
                (None, 0) => Mode::Exact,
                (None, _) => Mode::Sampled,
            };
            if let Some(price) = watch.price(process.pid, now, count.calls, mode) {
                if process.pid == root || price.significant() {
                    say!("{}", price.line());
                }
            }
            switches.extend(switch.map(|switch| (process.pid, switch)));
        }
        for (pid, switch) in switches {
            self.switch(pid, switch)?;
        }
        Ok(())
    }

    /// A followed child exited: its last report is kept, its probes and map entries go.
    fn child_exited(&mut self, pid: u32) {
        let last = match self.read(true, Some(pid)) {
            Ok(report) => report.map(|mut report| {
                report.exited = true;
                report
            }),
            Err(err) => {
                tracing::warn!(pid, "reading the maps: {err:#}");
                None
            }
        };
        self.family.on_child_exit(&mut self.loaded, pid, last);
    }
}

/// Reports every interval until the target exits, a signal arrives or the duration is up; then
/// prints the final report.
async fn trace(
    mut loaded: Loaded,
    symbolizer: SymbolizerHandle,
    root: Process,
    exit: &mut ExitWatch,
    args: &TraceArgs,
    opened: Opened,
    inspect: Option<inspect::Settings>,
) -> anyhow::Result<Traced> {
    let Opened { mut output, mut recording, mut stop, suppressing, mut live } = opened;
    // SAFETY: new fds of our own, open as long as the AsyncFds that own them.
    let unwind_events = unsafe { AsyncFd::register(loaded.unwind_events.bell().try_clone_to_owned()?) }
        .map_err(|err| err.into_parts().1)?;
    let process_events = unsafe { AsyncFd::register(loaded.process_events.ring().as_fd().try_clone_to_owned()?) }
        .map_err(|err| err.into_parts().1)?;
    let mut double_free_reader = DoubleFreeReader::new(&mut loaded.ebpf)?;
    let (exits, mut exited) = tokio::sync::mpsc::unbounded_channel();
    let follow_forks = loaded.follow_forks;
    let mut tracer = Tracer {
        loaded,
        symbolizer,
        family: Family::new(root, settings(args), follow_forks, exits),
        args,
        start_ns: aggregate::monotonic_now_ns(),
        min_age_ns: (args.min_age * 1e9) as u64,
        context: RunContext::now(),
        recording: recording.is_some(),
        inspection: None,
        pinned_budget: PinnedBudget::default(),
        wrappers: Wrappers::new(&args.wrappers),
        suppressions: &suppressing.rules,
        thread_names: HashMap::new(),
    };
    // A process attached to may have children already; `run`'s command has none before its exec.
    if follow_forks && matches!(exit, ExitWatch::Attached(_)) {
        tracer.family.adopt_existing_children(&mut tracer.loaded, &tracer.symbolizer);
    }
    if let Some(recording) = &mut recording {
        recording.start(Settings { top: args.top, interval_s: args.interval })?;
    }
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(args.interval));
    ticks.tick().await;
    let duration = tokio::time::sleep(Duration::from_secs_f64(args.duration.unwrap_or(MAX_SECONDS)));
    tokio::pin!(duration);
    let format = args.output.format();
    // Returns whether the reports are still read.
    let mut write = |report: Option<Report>| -> anyhow::Result<bool> {
        if let Some(report) = report {
            if let Some(recording) = &mut recording {
                recording.report(&report)?;
            }
            if let Some(view) = &mut live {
                if !report.is_final {
                    view.draw(&format::select(&report, Format::Table, usize::MAX))?;
                    return Ok(true);
                }
            }
            // Off the live screen before the final report.
            live = None;
            if report.is_final || format.streams() {
                output.write_report(&format::render(&format::select(&report, format, args.top), format))?;
                if let (true, false, Some(path)) = (report.is_final, format.streams(), output.path()) {
                    say!("memprof: wrote {}", path.display());
                }
            }
        }
        Ok(output.is_read())
    };

    let code = loop {
        let price_due = tracer.next_price_ns();
        tokio::select! {
            () = until_monotonic(price_due) => {
                if let Err(err) = tracer.say_prices() {
                    tracing::warn!("saying the price of tracing: {err:#}");
                }
            }
            _ = ticks.tick() => {
                tracer.collect(&mut double_free_reader);
                tracer.family.flush(&mut tracer.loaded);
                // `attach ... | head -1`: nobody reads any more, so end quietly as --duration does.
                if !write(tracer.read(false, None)?)? {
                    break None;
                }
            }
            ready = process_events.readable() => {
                if let Ok(mut ready) = ready {
                    ready.clear_ready();
                }
                tracer.family.on_process_events(&mut tracer.loaded, &tracer.symbolizer);
            }
            Some(pid) = exited.recv() => tracer.child_exited(pid),
            ready = unwind_events.readable() => {
                if let Ok(mut ready) = ready {
                    ready.clear_ready();
                }
                tracer.on_unwind_events();
            }
            code = exit.exited() => break code,
            () = stop.recv() => break exit.settle().await,
            _ = &mut duration => break None,
        }
    };
    // Children that forked or exited meanwhile are counted in the final report.
    tracer.family.on_process_events(&mut tracer.loaded, &tracer.symbolizer);
    while let Ok(pid) = exited.try_recv() {
        tracer.child_exited(pid);
    }
    // Children whose exit watchers have not run yet.
    let root = tracer.family.root;
    for pid in tracer.family.pids() {
        if pid != root && procfs::stat(pid).is_none_or(|stat| stat.zombie) {
            tracer.child_exited(pid);
        }
    }
    if let Some(settings) = inspect {
        tracer.inspection = inspect_root(&tracer, settings);
    }
    tracer.collect(&mut double_free_reader);
    let result = tracer.read(true, None);
    let leak_bytes = result.as_ref().ok().and_then(Option::as_ref).map_or(0, |root| {
        std::iter::once(root)
            .chain(&root.children)
            .flat_map(|report| &report.stacks)
            .filter(|s| s.leak.candidate)
            .map(|s| s.outstanding_bytes)
            .sum()
    });
    let generated = result.as_ref().ok().and_then(Option::as_ref).and_then(|root| suppressing.generated(root));
    let written = result.and_then(&mut write).and_then(|read| suppress::print(generated).map(|()| read));
    let Tracer { mut loaded, family, .. } = tracer;
    family.finish(&mut loaded);
    written.map(|_| Traced { code, leak_bytes })
}

/// Waits until CLOCK_MONOTONIC reaches `at_ns`; forever when none.
async fn until_monotonic(at_ns: Option<u64>) {
    match at_ns {
        Some(at_ns) => {
            tokio::time::sleep(Duration::from_nanos(at_ns.saturating_sub(aggregate::monotonic_now_ns()))).await;
        }
        None => std::future::pending().await,
    }
}

/// Inspects the root process if it is still there; says why not otherwise.
fn inspect_root(tracer: &Tracer, settings: inspect::Settings) -> Option<Inspection> {
    let pid = tracer.family.root;
    if procfs::stat(pid).is_none_or(|stat| stat.zombie) {
        say!("memprof: pid {pid} exited before it could be inspected; no inspection in the report");
        return None;
    }
    match inspect::inspect(&tracer.loaded.ebpf, pid, settings) {
        Ok(inspection) => {
            say!(
                "memprof: inspected pid {pid}: held still {:.1} ms, {} bytes of roots and {} of blocks scanned",
                inspection.pause_ms,
                inspection.root_bytes_scanned,
                inspection.block_bytes_scanned
            );
            Some(inspection)
        }
        Err(err) => {
            say!("memprof: could not inspect pid {pid}: {err:#}; no inspection in the report");
            None
        }
    }
}
