//! Execs, forks and exits of traced processes (and, for the daemon's discovery, execs and forks
//! of any process: `discover`), reported by the `process_exec` and `process_fork`
//! tracepoint programs through a ring buffer; and the `thread_exit` program, which settles the
//! in-flight calls of threads that die inside the allocator.

use anyhow::Context as _;
use aya::{
    maps::{Array, PerCpuArray},
    programs::RawTracePoint,
    Ebpf,
};
pub use profiler_common::ProcessEvent;

use crate::{process::mounts, ring::Ring};

/// The program an exec ran (`ProcessEvent::path`), absolute and with links resolved as
/// `/proc/PID/exe` names it: a relative path is taken from the process's directory, or from
/// memprof's once the process is gone (`run`'s command starts in it). None without a path.
pub fn exec_path(pid: u32, event: &ProcessEvent) -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt as _;
    let end = event.path.iter().position(|&b| b == 0).unwrap_or(event.path.len());
    if end == 0 {
        return None;
    }
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(&event.path[..end]));
    let base = std::fs::read_link(format!("/proc/{pid}/cwd")).or_else(|_| std::env::current_dir()).ok()?;
    let path = base.join(path);
    // Resolving links looks at every directory on the way: not while the process sees a user's
    // FUSE mount, nor on a mount that does not answer. The path is resolved in memprof's mounts,
    // so they are asked too: a process in a container does not see the host's (see `mounts`).
    let process_allows = match mounts::risky_mounts(pid) {
        Ok(risky) => !mounts::has_users_fuse(&risky) && mounts::may_look(&risky, &path, &path),
        Err(_) => true,
    };
    let lookable = process_allows && mounts::MemprofsView::read().may_look(&path);
    if lookable {
        return Some(std::fs::canonicalize(&path).unwrap_or(path));
    }
    Some(path)
}

/// The name the kernel gave the process at the exec (`ProcessEvent::path`): the path's last
/// component, cut to 15 bytes, as its `comm`. For a process gone before `/proc` is read.
pub fn exec_comm(event: &ProcessEvent) -> Option<String> {
    let end = event.path.iter().position(|&b| b == 0).unwrap_or(event.path.len());
    let name = event.path[..end].rsplit(|&b| b == b'/').next().filter(|name| !name.is_empty())?;
    Some(String::from_utf8_lossy(&name[..name.len().min(15)]).into_owned())
}

/// (program, tracepoint) pairs: each fires for every process (or thread) on the machine, and
/// returns at once for those not traced.
const TRACEPOINTS: [(&str, &str); 3] = [
    ("process_exec", "sched_process_exec"),
    ("process_fork", "sched_process_fork"),
    ("thread_exit", "sched_process_exit"),
];

/// Loads and attaches the tracepoint programs (for as long as `ebpf` lives); returns the reader of
/// their events.
pub fn attach(ebpf: &mut Ebpf) -> anyhow::Result<ProcessEvents> {
    attach_raw(ebpf, &TRACEPOINTS)?;
    let map = ebpf.take_map("PROCESS_EVENTS").context("map PROCESS_EVENTS missing")?;
    Ok(ProcessEvents { ring: Ring::new("PROCESS_EVENTS", map)? })
}

/// Loads and attaches each (program, raw tracepoint) pair, for as long as `ebpf` lives.
fn attach_raw(ebpf: &mut Ebpf, pairs: &[(&str, &str)]) -> anyhow::Result<()> {
    for &(name, tracepoint) in pairs {
        let program: &mut RawTracePoint = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the eBPF object"))?
            .try_into()?;
        program.load().with_context(|| format!("loading program {name}"))?;
        program.attach(tracepoint).with_context(|| format!("attaching {name} to the {tracepoint} tracepoint"))?;
    }
    Ok(())
}

/// Reports the execs and forks of processes not traced too, as `flags` (`discover::`) say.
pub fn discover(ebpf: &mut Ebpf, flags: u32) -> anyhow::Result<()> {
    let mut discover: Array<_, u32> = Array::try_from(ebpf.map_mut("DISCOVER").context("map DISCOVER missing")?)?;
    discover.set(0, flags, 0)?;
    Ok(())
}

/// Events the ring buffer had no room for, all CPUs together.
pub fn events_lost(ebpf: &Ebpf) -> u64 {
    ebpf.map("PROCESS_EVENTS_LOST")
        .and_then(|map| PerCpuArray::<_, u64>::try_from(map).ok())
        .and_then(|lost| lost.get(&0, 0).ok())
        .map_or(0, |per_cpu| per_cpu.iter().sum())
}

pub struct ProcessEvents {
    ring: Ring,
}

impl ProcessEvents {
    /// The events since the last call, in order.
    pub fn drain(&mut self) -> Vec<ProcessEvent> {
        let mut events = Vec::new();
        self.ring.read_each(|event: ProcessEvent| events.push(event));
        events
    }

    /// For waiting on events with poll or an async reactor.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }
}
