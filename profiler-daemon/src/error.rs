//! Errors a user can meet, each saying what is wrong and what to do about it.

use std::path::PathBuf;

use crate::process::go_program;

#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("no process with pid {0}; check the pid with `ps -p {0}`")]
    NoSuchProcess(u32),
    #[error("cannot read /proc/{pid}/maps: {cause} (the kernel shows a process's mappings only to one that may ptrace it: pid {pid} is not dumpable, in a user namespace memprof is not privileged in, or guarded by a security module); memprof cannot trace it")]
    MapsUnreadable { pid: u32, cause: std::io::Error },
    #[error("pid {0} is a zombie: it has exited and has no memory left, nothing to trace (its parent has not reaped it yet); pick a running process")]
    Zombie(u32),
    #[error("memprof cannot trace itself; give the pid of another process")]
    SelfTrace,
    #[error("pid {0} is a kernel thread, which has no heap; pick a user-space process")]
    KernelThread(u32),
    #[error("{thread} is a thread of pid {process}, not a process: give the process's pid (-p {process}); a report's threads are told apart with --threads")]
    Thread { thread: u32, process: u32 },
    #[error("no allocator found in pid {pid}: {detail}; memprof knows the C library's malloc, jemalloc, tcmalloc, mimalloc and Rust's global allocators (docs: guide/allocators.md#allocators)")]
    NoAllocator { pid: u32, detail: String },
    #[error("pid {0} runs under valgrind, which runs its code translated: memprof's breakpoints would stop it (SIGTRAP); it is not traced, valgrind's own leak check is the tool for it")]
    UnderValgrind(u32),
    #[error("{} is valgrind, which runs its program translated: memprof's breakpoints, which its probes keep through the exec, would stop it (SIGTRAP); run the program under memprof, or under valgrind alone", .0.display())]
    ValgrindCommand(PathBuf),
    #[error("no otel_memory USDT probes and no Go runtime in the files of {target}: --usdt records only what an allocator's own sampler reports, through otel_memory:alloc and otel_memory:free probes or Go's runtime; use an allocator built with them, or leave out --usdt (every call, or --sample-bytes N)")]
    NoUsdtProbes { target: String },
    #[error("{target} is a Go program without cgo whose {samples_nothing}, and it has no allocator memprof probes: {set_the_rate}, or trace it with {other_modes} (docs: guide/usdt.md#go-programs)",
        samples_nothing = go_program::SAMPLES_NOTHING, set_the_rate = go_program::SET_THE_RATE, other_modes = go_program::OTHER_MODES)]
    GoSamplingOff { target: String },
    #[error("--usdt traces one process, through its own probes: its children would need allocator probes; leave out --follow-forks")]
    UsdtFollowForks,
    #[error("the otel_memory:{name} probe in {file} cannot be used: {detail}")]
    UsdtProbe { file: String, name: String, detail: String },
    #[error("Go's heap samples in {file} cannot be read: {detail}")]
    GoSampler { file: String, detail: String },
    #[error("no allocator found for {}: {detail}; memprof knows the C library's malloc, jemalloc, tcmalloc, mimalloc and Rust's global allocators (docs: guide/allocators.md#allocators)", program.display())]
    NoAllocatorInCommand { program: PathBuf, detail: String },
    #[error("missing privileges: memprof needs root, or CAP_SYS_ADMIN + CAP_SYS_PTRACE + CAP_DAC_READ_SEARCH; missing {missing}; run it with sudo, or see docs: install.md#permissions")]
    Privileges { missing: String },
    #[error("this kernel lacks {0}; memprof needs CONFIG_DEBUG_INFO_BTF and CONFIG_UPROBE_EVENTS, and is tested on Linux 6.1, 6.12 and 6.18 (docs: reference/kernels.md#kernel-requirements)")]
    KernelSupport(&'static str),
    #[error("this kernel lacks the BPF helper {helper} (Linux {since}), which memprof's stack walk calls; memprof is tested on Linux 6.1, 6.12 and 6.18 (docs: reference/kernels.md#kernel-requirements)")]
    KernelTooOld { helper: &'static str, since: &'static str },
    /// Not a `source`: the message says the cause already.
    #[error("cannot write the output file {path}: {cause}; {}", write_fix(.cause, "--output"))]
    Output { path: PathBuf, cause: std::io::Error },
    #[error("cannot write to standard output: {0}; check the disk space and permissions of where it goes")]
    Stdout(std::io::Error),
    #[error("`run --inspect` inspects the command at --duration, while it still runs; add --duration SECS")]
    InspectNeedsDuration,
    #[error("--format {0} writes binary data, which a terminal cannot show; add --output FILE")]
    BinaryToTerminal(&'static str),
    #[error(
        "--live draws on a terminal, and standard output is not one; leave out --live, or run memprof in a terminal"
    )]
    LiveNeedsTerminal,
    #[error("--record and --output name one file, which would hold the report alone; give each a path of its own")]
    RecordIsOutput,
    #[error("--output names the recording itself ({0}), which the report would replace; give --output another path")]
    OutputIsRecording(PathBuf),
    /// Flags that cannot go together, or a flag's value refused once the others are known: the
    /// message names them and the fix.
    #[error("{0}")]
    Flags(String),
    #[error(
        "the kernel has no memory for memprof's maps: a memory cgroup's limit (systemd's MemoryMax) may be below what they take at these sizes; raise it, or lower --max-live, --max-stacks and --max-unwind-rows (docs: reference/limits.md)"
    )]
    MapsOutOfMemory,
    #[error("memprof needs about {need_mib} MiB more memory while the kernel verifies its programs, and its memory cgroup {} leaves it {room_mib} MiB under {file}: raise that limit by {short_mib} MiB or more (systemd: MemoryMax=), or run memprof outside it (docs: reference/limits.md#the-verifiers-memory)", cgroup.display())]
    NoRoomToVerify { need_mib: u64, room_mib: u64, short_mib: u64, cgroup: PathBuf, file: &'static str },
    /// Not a `source`: the message says the cause already, and the error chain would say it twice.
    #[error("cannot start {command}: {cause}")]
    Spawn { command: String, cause: std::io::Error },
}

/// Why no file can be made for a report at a path in /proc (the cause of `Output`): a hint
/// about disk space or permissions would send the user looking in the wrong place.
#[derive(Debug, thiserror::Error)]
#[error("/proc holds the kernel's view of processes, and no file can be made there")]
pub struct InProc;

/// What to do when the file `flag` names cannot be written.
pub fn write_fix(cause: &std::io::Error, flag: &str) -> String {
    if cause.get_ref().is_some_and(|cause| cause.is::<InProc>()) {
        format!("give {flag} a path outside /proc")
    } else {
        format!("check the disk space and permissions, or choose another path with {flag}")
    }
}

impl UserError {
    /// Whether it refuses the flags given, together or where they were given (a terminal), as
    /// the command-line parser refuses a value: such errors exit with 2, as its do.
    pub fn refuses_flags(&self) -> bool {
        matches!(
            self,
            Self::UsdtFollowForks
                | Self::InspectNeedsDuration
                | Self::BinaryToTerminal(_)
                | Self::LiveNeedsTerminal
                | Self::RecordIsOutput
                | Self::OutputIsRecording(_)
                | Self::Flags(_)
        )
    }
}
