//! Execs, forks and exits of traced processes (and, for the daemon's discovery, execs and forks
//! of any process: `discover`), reported by the `process_exec` and `process_fork`
//! tracepoint programs through a ring buffer; and the `thread_exit` program, which settles the
//! in-flight calls of threads that die inside the allocator.

use anyhow::Context as _;
use aya::{
    maps::{Array, HashMap, PerCpuArray},
    programs::RawTracePoint,
    Ebpf,
};
pub use profiler_common::ProcessEvent;
use profiler_common::{discover, COMM_BYTES};

use crate::{
    process::{mounts, procfs},
    ring::Ring,
};

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
/// component, cut to 15 bytes, as its `comm` reads. For a process gone before `/proc` is read,
/// and for telling an exec no rule can match without reading `/proc`. None when the path does
/// not tell it: no path, a path cut to fit the event, or a file descriptor's exec (`/dev/fd/N`,
/// which the kernel names after the file itself).
pub fn exec_comm(event: &ProcessEvent) -> Option<String> {
    let end = event.path.iter().position(|&b| b == 0).unwrap_or(event.path.len());
    let path = &event.path[..end];
    // The kernel's copy keeps a byte for its terminating NUL.
    if end + 1 >= event.path.len() || path.starts_with(b"/dev/fd/") {
        return None;
    }
    let name = path.rsplit(|&b| b == b'/').next().filter(|name| !name.is_empty())?;
    Some(procfs::comm_text(&name[..name.len().min(15)]))
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

/// Reports the execs and forks of processes not traced too, as `flags` (`discover::`) say;
/// under `discover::NAMED_EXECS` only the execs to one of `exec_names` (see `Rules::exec_names`);
/// under `discover::CGROUPS` none in a cgroup kept back (`keep_back_cgroup`): the cgroups kept
/// back before are forgotten, as the rules may have changed.
pub fn discover(ebpf: &mut Ebpf, flags: u32, exec_names: &[[u8; COMM_BYTES]]) -> anyhow::Result<()> {
    let set_flags = |ebpf: &mut Ebpf, flags: u32| -> anyhow::Result<()> {
        let mut discover: Array<_, u32> = Array::try_from(ebpf.map_mut("DISCOVER").context("map DISCOVER missing")?)?;
        Ok(discover.set(0, flags, 0)?)
    };
    // Every exec and fork is reported while the names and cgroups change: none the old or new
    // rules match is missed.
    set_flags(ebpf, flags & !(discover::NAMED_EXECS | discover::CGROUPS))?;
    clear::<[u8; COMM_BYTES]>(ebpf, "EXEC_NAMES")?;
    forget_kept_back_cgroups(ebpf)?;
    let mut names: HashMap<_, [u8; COMM_BYTES], u8> =
        HashMap::try_from(ebpf.map_mut("EXEC_NAMES").context("map EXEC_NAMES missing")?)?;
    for name in exec_names {
        names.insert(name, 0, 0)?;
    }
    set_flags(ebpf, flags)
}

/// Empties hash map `name`, whose keys are `K`s.
fn clear<K: aya::Pod>(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<()> {
    let mut map: HashMap<_, K, u8> =
        HashMap::try_from(ebpf.map_mut(name).with_context(|| format!("map {name} missing"))?)?;
    let keys: Vec<K> = map.keys().filter_map(Result::ok).collect();
    for key in keys {
        map.remove(&key)?;
    }
    Ok(())
}

/// Every exec and fork is reported again, whatever its cgroup.
pub fn forget_kept_back_cgroups(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    clear::<u64>(ebpf, "UNMATCHED_CGROUPS")
}

/// No exec or fork in cgroup `id` is reported from now on (under `discover::CGROUPS`): no rule
/// contains it.
pub fn keep_back_cgroup(ebpf: &mut Ebpf, id: u64) -> anyhow::Result<()> {
    let mut unmatched: HashMap<_, u64, u8> =
        HashMap::try_from(ebpf.map_mut("UNMATCHED_CGROUPS").context("map UNMATCHED_CGROUPS missing")?)?;
    Ok(unmatched.insert(id, 0, 0)?)
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

#[cfg(test)]
mod tests {
    use profiler_common::{process_event, EXEC_PATH_BYTES};

    use super::*;

    fn exec_of(path: &[u8]) -> ProcessEvent {
        let mut event = ProcessEvent {
            kind: process_event::EXEC,
            tgid: 1,
            pid: 1,
            image: 0,
            time_ns: 0,
            cgroup_id: 0,
            path: [0; EXEC_PATH_BYTES],
        };
        event.path[..path.len()].copy_from_slice(path);
        event
    }

    #[test]
    fn an_exec_names_its_process_as_its_comm_reads() {
        assert_eq!(exec_comm(&exec_of(b"/usr/bin/true")).as_deref(), Some("true"));
        assert_eq!(exec_comm(&exec_of(b"./a-rather-long-program-name")).as_deref(), Some("a-rather-long-p"));
        assert_eq!(exec_comm(&exec_of(b"bin/bad\x01name")).as_deref(), Some("bad\\x01name"));
    }

    #[test]
    fn an_exec_whose_path_does_not_tell_its_name_has_none() {
        assert_eq!(exec_comm(&exec_of(b"")), None);
        assert_eq!(exec_comm(&exec_of(b"/usr/bin/")), None);
        assert_eq!(exec_comm(&exec_of(b"/dev/fd/3")), None);
        assert_eq!(exec_comm(&exec_of(&[b'a'; EXEC_PATH_BYTES - 1])), None);
    }
}
