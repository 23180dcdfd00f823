//! Process life of traced processes: exec and fork, from the scheduler's tracepoints (raw
//! tracepoints: they attach by name, without tracefs, and kprobes are not available).
//!
//! Only processes in `TRACED` are reported, so the programs cost every other exec and fork one
//! hash lookup; unless the daemon asks for every exec or fork on the host (`DISCOVER`), to find
//! the processes its rules match as they start: an exec or a fork then costs one ring record
//! more, next to the exec's or fork's own tens of microseconds, and a wake-up of the daemon.
//! Where the rules match processes by whole names only, an exec costs that only when it takes
//! one of them (`EXEC_NAMES`); where they name cgroups, a fork (and, with such names, an exec)
//! in a cgroup the daemon found none of them contains costs nothing more
//! (`UNMATCHED_CGROUPS`). The daemon re-attaches a process that execs (its probes were on the
//! old program's allocator), attaches to the children it follows and detaches from the
//! processes that exit.

use aya_ebpf::{
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task,
        bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes,
    },
    macros::{map, raw_tracepoint},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::RawTracePointContext,
    Global,
};
use profiler_common::{
    discover, process_event, traced, ProcessEvent, COMM_BYTES, MAX_EXEC_NAMES, MAX_UNMATCHED_CGROUPS,
};

use crate::shared::{add, kernel_word, NO_PREALLOC};

/// Traced processes (tgid) and their `traced::` flags, kept by the daemon.
#[map]
static TRACED: HashMap<u32, u32> = HashMap::with_max_entries(4_096, NO_PREALLOC);
/// Sized for as many events as before execs carried their path (`ProcessEvent::path`): a fork
/// storm's events are that size too.
#[map]
static PROCESS_EVENTS: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);
/// `discover::` flags: which execs and forks of untraced processes are reported too.
#[map]
static DISCOVER: Array<u32> = Array::with_max_entries(1, 0);
/// The command names whose execs are reported under `discover::NAMED_EXECS`, kept by the daemon.
#[map]
static EXEC_NAMES: HashMap<[u8; COMM_BYTES], u8> = HashMap::with_max_entries(MAX_EXEC_NAMES, NO_PREALLOC);
/// Cgroups (by id) the daemon found no rule contains: under `discover::CGROUPS` their execs and
/// forks are not reported. The daemon empties it before it is full.
#[map]
static UNMATCHED_CGROUPS: HashMap<u64, u8> = HashMap::with_max_entries(MAX_UNMATCHED_CGROUPS, NO_PREALLOC);
/// The thread each traced process's perf-event uprobes are opened on (its id, to its process's
/// tgid), kept by user space where the kernel has no uprobe_multi links: its exit is reported.
#[map]
static PROBE_THREADS: HashMap<u32, u32> = HashMap::with_max_entries(4_096, NO_PREALLOC);
/// Events `PROCESS_EVENTS` had no room for.
#[map]
static PROCESS_EVENTS_LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Offsets of `pid` and `tgid` in the kernel's `struct task_struct`, read by the daemon from the
/// kernel's BTF (the layout differs between builds; Rust BPF has no CO-RE relocations).
#[unsafe(no_mangle)]
static TASK_PID_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static TASK_TGID_OFFSET: Global<u32> = Global::new(0);
/// Offsets of `signal` in `struct task_struct`, and of `flags` and `group_exec_task` in
/// `struct signal_struct` (0: unknown, not read), read the same way.
#[unsafe(no_mangle)]
static TASK_SIGNAL_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static SIGNAL_FLAGS_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static SIGNAL_EXEC_TASK_OFFSET: Global<u32> = Global::new(0);
/// `SIGNAL_GROUP_EXIT` of include/linux/sched/signal.h: the process exits whole.
const SIGNAL_GROUP_EXIT: u64 = 0x4;
/// The way from a `struct task_struct` to its cgroup's id: the offsets of `cgroups` in it, of
/// `dfl_cgrp` in `struct css_set`, of `kn` in `struct cgroup` and of `id` in `struct
/// kernfs_node` (0 in the first: unknown, forks are not kept back by their cgroup).
#[unsafe(no_mangle)]
static TASK_CGROUP_ID_WAY: Global<[u32; 4]> = Global::new([0; 4]);
/// Offset of `filename` in `struct linux_binprm` (0: unknown, the path is not sent).
#[unsafe(no_mangle)]
static BPRM_FILENAME_OFFSET: Global<u32> = Global::new(0);

/// Whether the probes are to record the current process. A link of the process's own (the
/// kernel's pid filter chose it) records it without a lookup; a link shared by every process
/// that maps the file (`shared_link`, from the cookie) only a process traced through shared
/// links, so that another process on the host pays only its trap and this lookup, and a traced
/// process with links of its own is not seen twice.
#[inline(always)]
pub fn probed(shared_link: bool) -> bool {
    if !shared_link {
        return true;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    traced_flags(tgid).is_some_and(|flags| flags & traced::SHARED != 0)
}

/// The `traced::` flags of process `tgid`, when it is traced (for the programs that fire in
/// every process, whether it is).
#[inline(always)]
pub fn traced_flags(tgid: u32) -> Option<u32> {
    // SAFETY: a copy of the value is taken at once; user space rewrites entries whole.
    unsafe { TRACED.get(tgid) }.copied()
}

/// The `discover::` flags the daemon set.
#[inline(always)]
fn discover_flags() -> u32 {
    DISCOVER.get(0).copied().unwrap_or(0)
}

/// Whether the daemon is told of an exec of a process not traced: under `NAMED_EXECS`, only
/// when the name the exec gave it is one the rules match, or, under `CGROUPS` too, when its
/// cgroup is not one they cannot match; so that the host's other execs wake nothing. With the
/// id of its cgroup under `CGROUPS` (`ProcessEvent::cgroup_id`), else 0.
#[inline(always)]
fn exec_discovered() -> Option<u64> {
    let flags = discover_flags();
    if flags & discover::EXECS == 0 {
        return None;
    }
    // SAFETY: a helper without arguments.
    let cgroup_id = if flags & discover::CGROUPS != 0 { unsafe { bpf_get_current_cgroup_id() } } else { 0 };
    if flags & discover::NAMED_EXECS == 0 {
        return Some(cgroup_id);
    }
    // The exec has named the process by now (`begin_new_exec`, before this tracepoint).
    let Ok(name) = bpf_get_current_comm() else { return Some(cgroup_id) };
    // SAFETY: only the entry's presence is read.
    let named = unsafe { EXEC_NAMES.get(name) }.is_some();
    (named || (flags & discover::CGROUPS != 0 && !unmatched(cgroup_id))).then_some(cgroup_id)
}

/// Whether the daemon is told of a fork by a process not traced, of `child` (a `struct
/// task_struct`): every one under `FORKS`, but those into a cgroup the rules cannot match under
/// `CGROUPS`. With the id of the child's cgroup under `CGROUPS`, else 0. `flags`: the
/// `discover::` flags.
#[inline(always)]
fn fork_discovered(flags: u32, child: u64) -> Option<u64> {
    if flags & discover::FORKS == 0 {
        return None;
    }
    if flags & discover::CGROUPS == 0 {
        return Some(0);
    }
    // The child's own: a service manager may start it in another cgroup (`CLONE_INTO_CGROUP`).
    let cgroup_id = cgroup_id_of(child);
    (!unmatched(cgroup_id)).then_some(cgroup_id)
}

#[inline(always)]
fn unmatched(cgroup_id: u64) -> bool {
    // SAFETY: only the entry's presence is read.
    unsafe { UNMATCHED_CGROUPS.get(cgroup_id) }.is_some()
}

/// The id of the cgroup `task` (a `struct task_struct`) is in (0: unknown).
#[inline(always)]
fn cgroup_id_of(task: u64) -> u64 {
    let way = TASK_CGROUP_ID_WAY.load();
    if way[0] == 0 {
        return 0;
    }
    let cgroup = kernel_word(kernel_word(task, way[0]), way[1]);
    let node = if cgroup == 0 { 0 } else { kernel_word(cgroup, way[2]) };
    if node == 0 {
        return 0;
    }
    kernel_word(node, way[3])
}

fn emit(kind: u32, tgid: u32, pid: u32, image: u32) {
    emit_with(kind, tgid, pid, image, 0, core::ptr::null());
}

/// `emit`, with the event's cgroup (`ProcessEvent::cgroup_id`) and the path of `bprm` (a `struct
/// linux_binprm`; null: none) for an exec. Written in the ring's record: the path does not fit
/// the BPF stack beside the event.
fn emit_with(kind: u32, tgid: u32, pid: u32, image: u32, cgroup_id: u64, bprm: *const u8) {
    let Some(mut entry) = PROCESS_EVENTS.reserve::<ProcessEvent>(0) else {
        if let Some(lost) = PROCESS_EVENTS_LOST.get_ptr_mut(0) {
            add(unsafe { &mut *lost }, 1);
        }
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: the record is ours until submitted; every field is written before it is.
    unsafe {
        (*event).kind = kind;
        (*event).tgid = tgid;
        (*event).pid = pid;
        (*event).image = image;
        (*event).time_ns = bpf_ktime_get_ns();
        (*event).cgroup_id = cgroup_id;
        (*event).path[0] = 0;
        let offset = BPRM_FILENAME_OFFSET.load();
        if !bprm.is_null() && offset != 0 {
            if let Ok(name) = bpf_probe_read_kernel(bprm.add(offset as usize) as *const *const u8) {
                let _ = bpf_probe_read_kernel_str_bytes(name, &mut (*event).path);
            }
        }
    }
    entry.submit(0);
}

/// `sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)`, in the
/// task that exec'd: by then it leads its thread group, whichever thread called execve.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(ctx: RawTracePointContext) -> i32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // The thread that called execve, by its id before the exec.
    let old_pid = ctx.arg::<u64>(1) as u32;
    if traced_flags(tgid).is_some() {
        crate::unwind::code_changed(tgid);
        let image = crate::record::new_image(tgid);
        emit_with(process_event::EXEC, tgid, old_pid, image, 0, ctx.arg(2));
        return 0;
    }
    if let Some(cgroup_id) = exec_discovered() {
        // With its path: the name the rules match, for a process gone before the daemon reads
        // /proc (counted in `memprof_targets_missed`).
        emit_with(process_event::EXEC, tgid, old_pid, 0, cgroup_id, ctx.arg(2));
    }
    0
}

/// `sched_process_fork(struct task_struct *parent, struct task_struct *child)`, in the parent, for
/// every clone: a new thread (its tgid is its creator's) is not a new process.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn process_fork(ctx: RawTracePointContext) -> i32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // Every traced process's: a child not followed still has its parent's breakpoints, which
    // memprof has the kernel take out of it (see `sweep`).
    let traced = traced_flags(tgid).is_some();
    let discover = if traced { 0 } else { discover_flags() };
    if !traced && discover & discover::FORKS == 0 {
        return 0;
    }
    let child: *const u8 = ctx.arg(1);
    // SAFETY: kernel reads through the helper, at offsets inside task_struct.
    let read = |offset: u32| unsafe { bpf_probe_read_kernel(child.add(offset as usize) as *const i32) };
    let (Ok(pid), Ok(child_tgid)) = (read(TASK_PID_OFFSET.load()), read(TASK_TGID_OFFSET.load())) else { return 0 };
    if pid != child_tgid || child_tgid as u32 == tgid {
        return 0;
    }
    if traced {
        emit(process_event::FORK, tgid, pid as u32, 0);
        return 0;
    }
    if let Some(cgroup_id) = fork_discovered(discover, child as u64) {
        emit_with(process_event::FORK, tgid, pid as u32, 0, cgroup_id, core::ptr::null());
    }
    0
}

/// A thread exited (`sched_process_exit`): when it is a traced process's main thread, the
/// process is reported, for the daemon to let it go at once; when its perf-event uprobes were
/// opened on it, that too, for memprof to open them again on a live thread (they stop firing at
/// this exit, see `PROBE_THREADS`). Other threads cost a lookup.
#[inline(always)]
pub fn on_thread_exit() {
    let ids = bpf_get_current_pid_tgid();
    let (tgid, pid) = ((ids >> 32) as u32, ids as u32);
    if pid == tgid && traced_flags(tgid).is_some() {
        emit(process_event::EXIT, tgid, 0, 0);
    }
    // SAFETY: a copy of the value is taken at once; user space writes entries whole.
    if unsafe { PROBE_THREADS.get(pid) }.is_some_and(|&owner| owner == tgid) && !process_goes_whole() {
        emit(process_event::PROBE_THREAD_EXIT, tgid, pid, 0);
    }
}

/// Whether the current thread exits with its whole process: an `exit_group` or a fatal signal
/// (`SIGNAL_GROUP_EXIT`), or an exec by another of its threads (`group_exec_task`), which the
/// exec's event reports.
fn process_goes_whole() -> bool {
    // SAFETY: a helper without arguments.
    let task = unsafe { bpf_get_current_task() };
    let signal = kernel_word(task, TASK_SIGNAL_OFFSET.load());
    if signal == 0 {
        return false;
    }
    let exec_task = SIGNAL_EXEC_TASK_OFFSET.load();
    kernel_word(signal, SIGNAL_FLAGS_OFFSET.load()) & SIGNAL_GROUP_EXIT != 0
        || (exec_task != 0 && kernel_word(signal, exec_task) != 0)
}
