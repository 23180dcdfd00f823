//! Events sent to user space through ring buffers: the dynamic linker's list, execs and forks,
//! and changes to anonymous memory.

/// Objects a `LinkMapEvent` holds at most, and the bytes of each one's path.
pub const LINK_MAP_OBJECTS: usize = 48;
pub const LINK_MAP_NAME_BYTES: usize = 248;

/// One object the dynamic linker has loaded: its load bias (`l_addr`) and path (`l_name`,
/// empty for the executable).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LoadedObject {
    pub base: u64,
    pub name: [u8; LINK_MAP_NAME_BYTES],
}

/// The dynamic linker's list of loaded objects (`r_debug.r_map`), read in the process when the
/// linker reports a consistent state (`_dl_debug_state`, `RT_CONSISTENT`): with the files' program
/// headers it gives the process's mappings even after the process is gone, as a debugger learns
/// them. Sent through `UNWIND_EVENTS`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LinkMapEvent {
    pub tgid: u32,
    /// Objects read, up to `LINK_MAP_OBJECTS`.
    pub count: u32,
    /// `bpf_ktime_get_ns` when it was read: a list sent before the process's latest exec is its
    /// old program's.
    pub time_ns: u64,
    pub objects: [LoadedObject; LINK_MAP_OBJECTS],
}

/// Sent through `PROCESS_EVENTS` when a traced process execs or forks (rare: an event stream).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEvent {
    /// A `process_event::` constant.
    pub kind: u32,
    /// The traced process.
    pub tgid: u32,
    /// The task the event names besides the process, by its kernel pid (a thread's id): for a
    /// fork, the new process (its main thread, whose pid is its tgid); for an exec, the thread
    /// that called it, by its id before the exec (`tgid` unless another of its threads exec'd);
    /// for a probe thread's exit, that thread.
    pub pid: u32,
    /// For an exec, the new program's number (`ProcHeap::image`): what the process's maps hold
    /// under a smaller one, or allocated before `time_ns`, is the old program's.
    pub image: u32,
    /// `bpf_ktime_get_ns` at the event.
    pub time_ns: u64,
    /// For an exec or fork of a process not traced under `discover::CGROUPS`, the id of the
    /// cgroup the process is in (the child's, for a fork); 0 otherwise, or unknown.
    pub cgroup_id: u64,
    /// For an exec, the path the new program was run by, as given to `execve` (relative to the
    /// process's directory, cut at `EXEC_PATH_BYTES`), NUL-terminated: its name when it is gone
    /// before memprof reads `/proc` (a program that runs for a millisecond).
    pub path: [u8; EXEC_PATH_BYTES],
}

impl ProcessEvent {
    /// Whether a thread other than the main one exec'd: the kernel's pid-filtered probes follow
    /// the main thread's task, which the exec ended, so the process's probes no longer fire.
    pub fn exec_by_other_thread(&self) -> bool {
        self.kind == process_event::EXEC && self.pid != self.tgid
    }
}

/// Room for `ProcessEvent::path`.
pub const EXEC_PATH_BYTES: usize = 256;

/// What a `ProcessEvent` reports.
pub mod process_event {
    /// The process replaced its program (`execve`): its pid stays, its memory is new.
    pub const EXEC: u32 = 0;
    /// The process made a new process (`fork`, `vfork`, `clone` without `CLONE_THREAD`).
    pub const FORK: u32 = 1;
    /// The process's main thread exited: the process is gone, or is a moment later, unless its
    /// other threads run on (the main thread called `pthread_exit`).
    pub const EXIT: u32 = 2;
    /// The thread the process's perf-event uprobes were opened on (`pid`) exited. Unless the
    /// whole process goes with it, they fire no more: the kernel fires such an event only in the
    /// threads whose memory is that thread's, and an exited thread has none.
    pub const PROBE_THREAD_EXIT: u32 = 3;
}

/// Which execs and forks of processes not traced are reported too (`DISCOVER`), for the daemon
/// to find the processes its rules match as they start.
pub mod discover {
    /// Every exec on the host: a program's command name is set at its exec.
    pub const EXECS: u32 = 1;
    /// Every new process on the host: a process starts in its parent's cgroup.
    pub const FORKS: u32 = 2;
    /// With `EXECS`: only the execs that give their process a name in `EXEC_NAMES`, the names
    /// the rules match when they match names and nothing else.
    pub const NAMED_EXECS: u32 = 4;
    /// No fork into a cgroup in `UNMATCHED_CGROUPS`, the cgroups the daemon found no rule
    /// contains; with `NAMED_EXECS`, the execs in any other cgroup too.
    pub const CGROUPS: u32 = 8;
}

/// Room for a command name (the kernel's `TASK_COMM_LEN`): an `EXEC_NAMES` key, NUL-padded.
pub const COMM_BYTES: usize = 16;
/// The names `EXEC_NAMES` holds at most.
pub const MAX_EXEC_NAMES: u32 = 1_024;
/// The cgroups `UNMATCHED_CGROUPS` holds at most (a host's services and containers; past them,
/// the daemon starts again from none).
pub const MAX_UNMATCHED_CGROUPS: u32 = 4_096;

/// A change to a traced process's anonymous private memory outside the heap's blocks, sent
/// through `MAPPING_EVENTS` at the return of `mmap`, `munmap`, `mremap`, `brk` or `madvise`
/// (calls rare next to malloc's: an event stream), and, for a process traced by its page faults
/// (`--growth`), at the first touch of each page. Addresses and lengths are as the call gave
/// them; the daemon rounds them to pages, as the kernel does.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingEvent {
    pub tgid: u32,
    /// A `mapping_event::` constant.
    pub kind: u32,
    /// The address of the process's `mm_struct`, only compared: an exec gives the process a new
    /// memory, whose mappings start from none.
    pub mm: u64,
    /// `MAP`, `UNMAP`: the range's start; `REMAP`: the old range's.
    pub addr: u64,
    /// `MAP`, `UNMAP`: the range's length; `REMAP`: the old range's; `FAULT`: the bytes the fault
    /// mapped, a page or a (transparent) huge page's, which `addr` is in.
    pub len: u64,
    /// `REMAP`: the new range's start; `BRK`: the new break.
    pub new_addr: u64,
    /// `REMAP`: the new range's length.
    pub new_len: u64,
    /// The caller's stack in `STACKS` (`NO_STACK` for `UNMAP`).
    pub stack_id: u64,
    /// `mapping_event::IN_ALLOCATOR`, `mapping_event::KEEP_OLD`.
    pub flags: u32,
    pub _pad: u32,
    /// `FAULT`: when the page was touched (the kernel's monotonic clock).
    pub time_ns: u64,
}

/// What a `MappingEvent` reports, and its flags.
pub mod mapping_event {
    /// An anonymous private mapping was made (over whatever was there, for `MAP_FIXED`).
    pub const MAP: u32 = 0;
    /// A range stopped being anonymous private memory: `munmap`, or a `MAP_FIXED` mapping of
    /// another kind over it.
    pub const UNMAP: u32 = 1;
    /// `mremap` moved or resized a range.
    pub const REMAP: u32 = 2;
    /// `brk` returned: the program break after it.
    pub const BRK: u32 = 3;
    /// A page of `addr` was touched and the kernel gave it memory: `stack_id` touched it.
    pub const FAULT: u32 = 4;
    /// `madvise` took back the memory of a range (`MADV_DONTNEED`, `MADV_FREE`, `MADV_REMOVE`):
    /// it stays mapped, and its pages' next touch gives them memory again.
    pub const RELEASE: u32 = 5;
    /// Made inside a probed allocator call (glibc's malloc maps large blocks and grows its heap
    /// with `brk`): memory the heap's blocks already count.
    pub const IN_ALLOCATOR: u32 = 1;
    /// `MREMAP_DONTUNMAP`: the old range stays mapped.
    pub const KEEP_OLD: u32 = 2;

    /// The mapping calls' x86-64 system call numbers: a probe of a process's own at one of its
    /// wrappers of them has its call's for cookie.
    pub mod syscall {
        pub const MMAP: u32 = 9;
        pub const MUNMAP: u32 = 11;
        pub const BRK: u32 = 12;
        pub const MREMAP: u32 = 25;
        pub const MADVISE: u32 = 28;
    }
}
