//! One tracing session: attach to a process (or start one), report every interval, report at the end.

use std::{
    collections::HashSet,
    fs::File,
    io::{self, Write},
    num::NonZeroU32,
    time::Duration,
};

use std::os::fd::AsFd as _;

use anyhow::Context as _;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{signal, SignalKind},
};

use crate::{
    aggregate::{self, DoubleFreeReader},
    allocator::{self, Allocator},
    cli::{TraceArgs, MAX_SECONDS},
    error::UserError,
    format::{self, Format},
    leak::LeakTracker,
    loader::{self, Attachment, Loaded},
    procfs,
    report::{self, DoubleFreeReport, Selection},
    sampling::RateGuard,
    symbolize::SymbolizerHandle,
    target::{self, DoubleFreeFilter, ExitWatch, MappingRequest},
};

/// `memprof attach`: returns the exit code (0: the target was traced to the end of the session).
pub async fn attach(pid: NonZeroU32, args: &TraceArgs) -> anyhow::Result<i32> {
    let mut output = open_output(args)?;
    let pid_n = pid.get();
    if pid_n == std::process::id() {
        return Err(UserError::SelfTrace.into());
    }
    // Privileges first: without them /proc says too little about other users' processes.
    loader::check_support()?;
    procfs::check_traceable(pid_n)?;
    let allocator = allocator::find(pid_n)?;
    let mut loaded = loader::load(args.maps, args.interval)?;
    let attachment = loaded.attach(&allocator, pid).with_context(|| gone_or(pid_n))?;
    let exit = ExitWatch::attached(pid_n).map_err(|_| UserError::NoSuchProcess(pid_n))?;
    let symbolizer = SymbolizerHandle::spawn();
    symbolizer.refresh(pid_n);
    let comm = procfs::comm(pid_n).unwrap_or_default();
    let ns_pid = procfs::ns_pid(pid_n);
    announce(pid_n, &comm, &attachment, &allocator);
    let double_free_filter = DoubleFreeFilter::new(&allocator.display_path, procfs::exe_path(pid_n).as_deref());
    let rate_guard = RateGuard::new(args.sampling);
    if let Some(sample_bytes) = rate_guard.initial() {
        loaded.sample(pid_n, sample_bytes)?;
    }
    let tracee = Tracee { loaded, attachment, symbolizer, pid: pid_n, ns_pid, comm, double_free_filter, rate_guard };
    let traced = trace(tracee, exit, None, args, &mut output).await?;
    Ok(traced.code.unwrap_or(0))
}

/// Exit code of `memprof run --fail-on-leak-bytes` when the leak candidates hold more.
pub const LEAK_EXIT_CODE: i32 = 100;

/// `memprof run`: returns the command's exit code, or `LEAK_EXIT_CODE` when its leak candidates
/// hold more than `fail_on_leak_bytes` at the end.
pub async fn run(
    command: &[std::ffi::OsString],
    args: &TraceArgs,
    fail_on_leak_bytes: Option<u64>,
) -> anyhow::Result<i32> {
    let mut output = open_output(args)?;
    let program = target::resolve_program(&command[0])?;
    loader::check_support()?;
    let allocator = allocator_for_command(&program)?;
    let mut loaded = loader::load(args.maps, args.interval)?;
    let symbolizer = SymbolizerHandle::spawn();
    // Until it has run, the child's name is memprof's: name it as the kernel will after exec.
    let comm: String = program.file_name().unwrap_or_default().to_string_lossy().chars().take(15).collect();
    let executable = std::fs::canonicalize(&program).unwrap_or_else(|_| program.clone()).display().to_string();
    let double_free_filter = DoubleFreeFilter::new(&allocator.display_path, Some(&executable));
    let (mapping_requests, requests) = tokio::sync::mpsc::unbounded_channel();
    let (child, exit_code) = target::spawn(program, command, symbolizer.clone(), mapping_requests)?;
    let pid = child.pid;
    // The child is our own and cannot be pid 0.
    let attachment = loaded.attach(&allocator, NonZeroU32::new(pid).expect("a child's pid is positive"))?;
    loaded.stop_on_mapping_change(pid)?;
    let rate_guard = RateGuard::new(args.sampling);
    if let Some(sample_bytes) = rate_guard.initial() {
        loaded.sample(pid, sample_bytes)?;
    }
    announce(pid, &comm, &attachment, &allocator);
    child.release();
    // The child shares memprof's pid namespace.
    let tracee = Tracee { loaded, attachment, symbolizer, pid, ns_pid: None, comm, double_free_filter, rate_guard };
    let traced = trace(tracee, ExitWatch::Child(exit_code), Some(requests), args, &mut output).await?;
    match fail_on_leak_bytes {
        Some(limit) if traced.leak_bytes > limit => {
            eprintln!(
                "memprof: leak candidates hold {} bytes, more than --fail-on-leak-bytes {limit}: exiting with {LEAK_EXIT_CODE}",
                traced.leak_bytes
            );
            Ok(LEAK_EXIT_CODE)
        }
        _ => Ok(traced.code.unwrap_or(0)),
    }
}

/// A command's allocator before it runs, in the order the dynamic loader binds `malloc`: the
/// executable itself when it defines malloc (a static binary), else a library in `LD_PRELOAD`
/// (given by path) that does, else the C library memprof itself uses, which the loader will map.
fn allocator_for_command(program: &std::path::Path) -> Result<Allocator, UserError> {
    let preloaded = std::env::var("LD_PRELOAD").unwrap_or_default();
    let candidates = std::iter::once(program.to_path_buf())
        .chain(preloaded.split([':', ' ']).filter(|entry| entry.contains('/')).map(std::path::PathBuf::from));
    for path in candidates {
        // As /proc/PID/maps will name it, to recognise the allocator's own frames later.
        let display = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone()).display().to_string();
        if let Some(allocator) = allocator::read_entry_points(&path, &display) {
            return Ok(allocator);
        }
    }
    allocator::find(std::process::id())
}

fn gone_or(pid: u32) -> String {
    if procfs::check_traceable(pid).is_err() {
        format!("pid {pid} exited while probes were being attached")
    } else {
        format!("attaching probes to pid {pid}")
    }
}

fn announce(pid: u32, comm: &str, attachment: &Attachment, allocator: &Allocator) {
    eprintln!(
        "memprof: tracing pid {pid} ({comm}) with {} probes in {}; Ctrl-C to stop",
        attachment.probes(),
        allocator.display_path
    );
}

fn open_output(args: &TraceArgs) -> Result<Box<dyn Write>, UserError> {
    format::check_destination(args.format(), args.output.as_deref())?;
    match &args.output {
        None => Ok(Box::new(io::stdout())),
        Some(path) => File::create(path)
            .map(|f| Box::new(f) as Box<dyn Write>)
            .map_err(|source| UserError::Output { path: path.clone(), source }),
    }
}

/// A process with probes attached.
struct Tracee {
    loaded: Loaded,
    attachment: Attachment,
    symbolizer: SymbolizerHandle,
    pid: u32,
    ns_pid: Option<u32>,
    comm: String,
    double_free_filter: DoubleFreeFilter,
    rate_guard: RateGuard,
}

impl Tracee {
    fn stacks(&self, start_ns: u64) -> report::Stacks<'_> {
        report::Stacks { ebpf: &self.loaded.ebpf, symbolizer: &self.symbolizer, pid: self.pid, start_ns }
    }
}

/// How a trace ended.
struct Traced {
    /// The target's exit code when memprof started it.
    code: Option<i32>,
    /// In-use bytes of the final report's leak candidates.
    leak_bytes: u64,
}

/// Reports every interval until the target exits, a signal arrives or the duration is up; then
/// prints the final report.
async fn trace(
    mut tracee: Tracee,
    mut exit: ExitWatch,
    mapping_requests: Option<tokio::sync::mpsc::UnboundedReceiver<MappingRequest>>,
    args: &TraceArgs,
    output: &mut dyn Write,
) -> anyhow::Result<Traced> {
    // Without a ptraced child no request comes: a closed channel that is never polled.
    let mut mapping_requests = mapping_requests.unwrap_or_else(|| tokio::sync::mpsc::unbounded_channel().1);
    let mut requests_open = true;
    // SAFETY: a new fd of our own, open as long as the AsyncFd that owns it.
    let mapping_events =
        unsafe { AsyncFd::register(tracee.loaded.mapping_events.ring().as_fd().try_clone_to_owned()?) }
            .map_err(|err| err.into_parts().1)?;
    let start_ns = aggregate::monotonic_now_ns();
    let min_age_ns = (args.min_age * 1e9) as u64;
    let mut double_free_reader = DoubleFreeReader::new(&mut tracee.loaded.ebpf)?;
    let mut double_frees: Vec<DoubleFreeReport> = Vec::new();
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(args.interval));
    ticks.tick().await;
    let duration = tokio::time::sleep(Duration::from_secs_f64(args.duration.unwrap_or(MAX_SECONDS)));
    tokio::pin!(duration);

    // Refreshes what is known of the live process and collects its double frees.
    let mut collect = |tracee: &mut Tracee, double_frees: &mut Vec<DoubleFreeReport>| {
        if let Some(current) = procfs::comm(tracee.pid) {
            tracee.comm = current;
            tracee.loaded.sync_mappings(tracee.pid);
            tracee.symbolizer.refresh(tracee.pid);
        }
        for event in double_free_reader.drain() {
            let double_free = tracee.stacks(start_ns).double_free(&event);
            if tracee.double_free_filter.is_user(&double_free) {
                double_frees.push(double_free);
            }
        }
    };
    let mut leaks = LeakTracker::new(args.leak_settings());
    // Reads the kernel's counters every interval (the leak rule needs each one); writes a
    // report when the format streams, or at the end.
    let mut emit = |tracee: &mut Tracee,
                    double_frees: &[DoubleFreeReport],
                    output: &mut dyn Write,
                    is_final: bool|
     -> anyhow::Result<u64> {
        let pids = HashSet::from([tracee.pid]);
        let kernel = aggregate::read(&tracee.loaded.ebpf, &mut tracee.loaded.ages, &pids, min_age_ns)?;
        let snapshot = kernel.processes.get(&tracee.pid).cloned().unwrap_or_default();
        if let Some(switch) = tracee.rate_guard.check(&snapshot) {
            tracee.loaded.sample(tracee.pid, switch.sample_bytes)?;
            eprintln!(
                "memprof: pid {} makes {:.0} allocator calls a second, more than --max-rate: sampling one in every {} bytes from now on",
                tracee.pid, switch.calls_per_second, switch.sample_bytes
            );
        }
        let time_s = (snapshot.now_ns.saturating_sub(start_ns)) as f64 / 1e9;
        leaks.observe(&snapshot, &tracee.loaded.ages.clock, time_s);
        let format = args.format();
        if !is_final && !format.streams() {
            return Ok(0);
        }
        let ctx = report::Context {
            stacks: tracee.stacks(start_ns),
            comm: &tracee.comm,
            ns_pid: tracee.ns_pid,
            double_frees,
            leaks: &leaks,
        };
        // The table shows the top stacks (of those the filters keep); the other formats carry
        // every outstanding stack.
        let top = (format == Format::Table).then_some(args.top);
        let filtered = !args.filters.is_empty();
        let selection = Selection {
            is_final,
            top: if filtered { None } else { top },
            aged_only: min_age_ns > 0,
            freed: format == Format::Pprof,
        };
        let mut report = report::build(&ctx, &snapshot, &kernel, selection);
        if filtered {
            args.filters.apply(&mut report);
            report.stacks.truncate(top.unwrap_or(usize::MAX));
        }
        output.write_all(&format::render(&report, format))?;
        output.flush()?;
        Ok(report.stacks.iter().filter(|s| s.leak.candidate).map(|s| s.outstanding_bytes).sum())
    };

    let code = loop {
        tokio::select! {
            _ = ticks.tick() => {
                collect(&mut tracee, &mut double_frees);
                emit(&mut tracee, &double_frees, output, false)?;
            }
            ready = mapping_events.readable() => {
                if let Ok(mut ready) = ready {
                    ready.clear_ready();
                }
                if tracee.loaded.sync_changed_mappings().contains(&tracee.pid) {
                    tracee.symbolizer.refresh(tracee.pid);
                }
            }
            request = mapping_requests.recv(), if requests_open => match request {
                Some(request) => {
                    tracee.loaded.sync_mappings(request.pid);
                    tracee.symbolizer.refresh(request.pid);
                    let _ = request.reply.send(tracee.loaded.take_mapping_stop(request.pid));
                }
                None => requests_open = false,
            },
            code = exit.exited() => break code,
            _ = sigint.recv() => break exit.settle().await,
            _ = sigterm.recv() => break exit.settle().await,
            _ = &mut duration => break None,
        }
    };
    collect(&mut tracee, &mut double_frees);
    let result = emit(&mut tracee, &double_frees, output, true);
    tracee.loaded.detach(tracee.attachment);
    result.map(|leak_bytes| Traced { code, leak_bytes })
}
