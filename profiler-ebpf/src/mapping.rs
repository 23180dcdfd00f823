//! Anonymous memory a traced process gets from the kernel directly: `mmap`, `munmap`, `mremap`
//! and `brk`, and gives back with `madvise`, seen at the return of each call's kernel function
//! (`fexit` programs). The page faults of a process traced by them (`growth`) go through
//! the same ring, so that the daemon sees each page's touch and its range's changes in order.
//! A `madvise` keeps the range mapped and gives back only its pages: it is sent for a process
//! traced by its pages only (`traced::GROWTH`), as allocators such as jemalloc purge with it
//! all the time and no other process's ranges change by it.
//!
//! Each program runs at every call of its system call on the machine and returns after one
//! lookup for processes not traced; every other system call runs none of memprof's code. A
//! kernel that refuses `fexit` programs gets `syscall_exit_tracepoint` at the raw `sys_exit`
//! tracepoint instead: that puts every system call of every process on the kernel's slower path
//! for traced system calls, and runs the program there, which returns after one read of the
//! call's number. There, a process traced by its pages gets probes of its own instead where its
//! wrappers make the calls, its C library's or its program's (`mapping_call_return`), and no
//! other process pays.
//! Nothing runs at a call's entry: the one thing it would tell, the break before a `brk`, the
//! daemon knows from the process's previous `brk`.
//!
//! The kernel keeps no ranges: a partial `munmap` splits a mapping, which a hash map cannot find
//! by an address inside it. Each call that changes a traced process's anonymous private memory
//! goes to the daemon as one `MappingEvent` with its stack, and the daemon keeps the ranges.
//! These calls are rare next to malloc's (glibc maps only blocks of 128 KiB and more, and raises
//! that threshold as they are freed), so a stream of them costs what the calls themselves cost.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{pt_regs, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{bpf_get_attach_cookie, bpf_get_current_pid_tgid},
    macros::{fexit, map, raw_tracepoint, uprobe},
    maps::RingBuf,
    programs::{FExitContext, ProbeContext, RawTracePointContext},
    EbpfContext as _,
};
use profiler_common::{
    mapping_event::{self, syscall},
    stack_table, traced, walk_kind, DropReason, MappingEvent, NO_STACK,
};

use crate::{
    process,
    record::{current_mm, in_allocator_call, return_trampoline},
    shared::{count_drop, kernel_word},
    unwind::{self, Regs, TakenReturns},
};

const SYS_MMAP: u64 = syscall::MMAP as u64;
const SYS_MUNMAP: u64 = syscall::MUNMAP as u64;
const SYS_BRK: u64 = syscall::BRK as u64;
const SYS_MREMAP: u64 = syscall::MREMAP as u64;
const SYS_MADVISE: u64 = syscall::MADVISE as u64;

const MADV_DONTNEED: u64 = 4;
const MADV_FREE: u64 = 8;
const MADV_REMOVE: u64 = 9;
const MADV_DONTNEED_LOCKED: u64 = 24;

const PROT_NONE: u64 = 0;
const PROT_EXEC: u64 = 4;
const MAP_TYPE: u64 = 0x0f;
const MAP_PRIVATE: u64 = 0x02;
const MAP_FIXED: u64 = 0x10;
const MAP_ANONYMOUS: u64 = 0x20;
const MAP_STACK: u64 = 0x20000;
const MREMAP_DONTUNMAP: u64 = 4;

/// The calls and first touches, in order, for the daemon: 16,384 events between two of its
/// reads. It reads them at each interval, and as soon as the kernel wakes it (`emit`).
#[map]
static MAPPING_EVENTS: RingBuf = RingBuf::with_byte_size(MAPPING_EVENTS_BYTES, 0);
const MAPPING_EVENTS_BYTES: u32 = 1024 * 1024;

fn ids() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    ((pid_tgid >> 32) as u32, pid_tgid as u32)
}

/// `__x64_sys_mmap(const struct pt_regs *regs)`, and each of the others: `regs` are the
/// caller's registers, which still hold the call's arguments (these calls do not change them),
/// and its stack is the one at the call. The return value follows the one argument.
#[fexit(function = "__x64_sys_mmap")]
pub fn mmap_exit(ctx: FExitContext) -> i32 {
    syscall_exit(&ctx, SYS_MMAP)
}

#[fexit(function = "__x64_sys_munmap")]
pub fn munmap_exit(ctx: FExitContext) -> i32 {
    syscall_exit(&ctx, SYS_MUNMAP)
}

#[fexit(function = "__x64_sys_mremap")]
pub fn mremap_exit(ctx: FExitContext) -> i32 {
    syscall_exit(&ctx, SYS_MREMAP)
}

#[fexit(function = "__x64_sys_brk")]
pub fn brk_exit(ctx: FExitContext) -> i32 {
    syscall_exit(&ctx, SYS_BRK)
}

#[fexit(function = "__x64_sys_madvise")]
pub fn madvise_exit(ctx: FExitContext) -> i32 {
    syscall_exit(&ctx, SYS_MADVISE)
}

/// Inlined into each program with its call's `id`, so that each keeps only its own case (and
/// those that never give memory, no stack walk).
#[inline(always)]
fn syscall_exit(ctx: &FExitContext, id: u64) -> i32 {
    let (tgid, tid) = ids();
    if let Some(flags) = process::traced_flags(tgid) {
        on_exit(ctx.arg(0), id, ctx.arg(1), flags, tgid, tid);
    }
    0
}

/// The fallback: `sys_exit(struct pt_regs *regs, long ret)`, at the return of every system call.
/// A process whose calls probes of its own read (`mapping_call_return`) is skipped.
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn syscall_exit_tracepoint(ctx: RawTracePointContext) -> i32 {
    let regs: u64 = ctx.arg(0);
    let id = kernel_word(regs, offset_of!(pt_regs, orig_rax) as u32);
    if !matches!(id, SYS_MMAP | SYS_MUNMAP | SYS_BRK | SYS_MREMAP | SYS_MADVISE) {
        return 0;
    }
    let (tgid, tid) = ids();
    if let Some(flags) = process::traced_flags(tgid).filter(|flags| flags & traced::OWN_MAPPING_CALLS == 0) {
        on_exit(regs, id, ctx.arg(1), flags, tgid, tid);
    }
    0
}

/// Where the kernel refuses `fexit` programs, a probe of one process's own: a uprobe at the
/// instruction after a `syscall` in its wrapper of a mapping call (its C library's, a static
/// program's copy, Go's runtime's), the call's number for cookie (see the daemon's
/// `process::mapping_calls`). The registers there are the call's: its arguments still in theirs,
/// its result in rax, and the stack the call's.
#[uprobe]
pub fn mapping_call_return(ctx: ProbeContext) -> u32 {
    // SAFETY: the context is the running probe's.
    let id = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    if !matches!(id, SYS_MMAP | SYS_MUNMAP | SYS_BRK | SYS_MREMAP | SYS_MADVISE) {
        return 0;
    }
    let (tgid, tid) = ids();
    if let Some(flags) = process::traced_flags(tgid) {
        let regs = ctx.regs as u64;
        let result = register(regs, offset_of!(pt_regs, rax)) as i64;
        on_exit(regs, id, result, flags, tgid, tid);
    }
    0
}

/// Register `field` (its offset in `struct pt_regs`) of the caller's registers at `regs`.
fn register(regs: u64, field: usize) -> u64 {
    kernel_word(regs, field as u32)
}

/// What a call changed, before its stack is walked.
struct Change {
    kind: u32,
    addr: u64,
    len: u64,
    new_addr: u64,
    new_len: u64,
    flags: u32,
    /// Whether it gave the process memory: its stack is walked then only.
    grows: bool,
}

impl Change {
    /// `[addr, addr + len)` changed by `kind` without a stack: nothing given to the process.
    fn range(kind: u32, addr: u64, len: u64) -> Self {
        Change { kind, addr, len, new_addr: 0, new_len: 0, flags: 0, grows: false }
    }
}

/// `process_flags` are the process's `traced::` flags.
#[inline(always)]
fn on_exit(regs: u64, id: u64, ret: i64, process_flags: u32, tgid: u32, tid: u32) {
    let (arg0, arg1) = (register(regs, offset_of!(pt_regs, rdi)), register(regs, offset_of!(pt_regs, rsi)));
    let change = match id {
        // The break after the call (brk fails by returning the old one, never an error number):
        // the daemon knows the one before from the process's previous `brk`.
        SYS_BRK => Change {
            kind: mapping_event::BRK,
            addr: 0,
            len: 0,
            new_addr: ret as u64,
            new_len: 0,
            flags: 0,
            grows: true,
        },
        // Error numbers are -4095..-1; an address is never there.
        _ if (-4095..0).contains(&ret) => return,
        SYS_MMAP => {
            let (prot, flags) = (register(regs, offset_of!(pt_regs, rdx)), register(regs, offset_of!(pt_regs, r10)));
            let (addr, len) = (ret as u64, arg1);
            if prot & PROT_EXEC != 0 && flags & MAP_ANONYMOUS == 0 {
                // A file's code, mapped by the dynamic linker (whose hook counts it too) or by a
                // loader of its own.
                unwind::code_changed(tgid);
            }
            // Shared anonymous memory is shmem: shared with the children it is made for, not
            // in the process's anonymous resident memory. PROT_NONE is address space reserved,
            // not memory (Go and the JVM reserve heaps so, and map them again to use them).
            // A thread's stack is not heap.
            let anonymous = flags & MAP_TYPE == MAP_PRIVATE && flags & MAP_ANONYMOUS != 0;
            if anonymous && prot != PROT_NONE && flags & MAP_STACK == 0 {
                Change { kind: mapping_event::MAP, addr, len, new_addr: 0, new_len: 0, flags: 0, grows: true }
            } else if flags & MAP_FIXED != 0 {
                // Replaced whatever was there.
                Change::range(mapping_event::UNMAP, addr, len)
            } else {
                return;
            }
        }
        SYS_MADVISE => {
            if process_flags & traced::GROWTH == 0 {
                return;
            }
            let advice = register(regs, offset_of!(pt_regs, rdx));
            if !matches!(advice, MADV_DONTNEED | MADV_FREE | MADV_REMOVE | MADV_DONTNEED_LOCKED) {
                return;
            }
            Change::range(mapping_event::RELEASE, arg0, arg1)
        }
        SYS_MUNMAP => Change::range(mapping_event::UNMAP, arg0, arg1),
        _ => {
            let (new_len, flags) = (register(regs, offset_of!(pt_regs, rdx)), register(regs, offset_of!(pt_regs, r10)));
            let keep_old = if flags & MREMAP_DONTUNMAP != 0 { mapping_event::KEEP_OLD } else { 0 };
            Change {
                kind: mapping_event::REMAP,
                addr: arg0,
                len: arg1,
                new_addr: ret as u64,
                new_len,
                flags: keep_old,
                grows: new_len > arg1,
            }
        }
    };
    send(regs, &change, tgid, tid);
}

#[inline(always)]
fn send(regs: u64, change: &Change, tgid: u32, tid: u32) {
    let (stack_id, flags) = if change.grows {
        let inside = in_allocator_call(tgid, tid);
        let regs = Regs {
            pc: register(regs, offset_of!(pt_regs, rip)),
            sp: register(regs, offset_of!(pt_regs, rsp)),
            bp: register(regs, offset_of!(pt_regs, rbp)),
            // The instruction after `syscall`: the walk looks the call up a byte before.
            pc_is_return: true,
            first_is_probed: false,
            // Inside an allocator call, its return address (and its callers', when they are
            // probed too) is the kernel's return trampoline on the stack.
            taken: if inside { TakenReturns::current(return_trampoline()) } else { TakenReturns::NONE },
            // `dropped` counts the heap's walks; a mapping's stack says it was cut itself.
            kind: walk_kind::MAPPING_CALL,
        };
        let inside = if inside { mapping_event::IN_ALLOCATOR } else { 0 };
        (unwind::stack_id(stack_table::ALLOCATIONS, tgid, regs), change.flags | inside)
    } else {
        (NO_STACK, change.flags)
    };
    emit(tgid, change, stack_id, flags, 0);
}

/// The first touch of the page at `addr` by `stack_id` (see `growth`).
pub fn send_fault(tgid: u32, addr: u64, len: u64, stack_id: u64, time_ns: u64) {
    let change = Change { kind: mapping_event::FAULT, addr, len, new_addr: 0, new_len: 0, flags: 0, grows: true };
    emit(tgid, &change, stack_id, 0, time_ns);
}

fn emit(tgid: u32, change: &Change, stack_id: u64, flags: u32, time_ns: u64) {
    let Some(mut entry) = MAPPING_EVENTS.reserve::<MappingEvent>(0) else {
        let lost =
            if change.kind == mapping_event::FAULT { DropReason::FaultEventLost } else { DropReason::MmapEventLost };
        count_drop(lost);
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: the reserved record is ours until submitted.
    unsafe {
        ((*event).tgid, (*event).kind, (*event).mm) = (tgid, change.kind, current_mm());
        ((*event).addr, (*event).len) = (change.addr, change.len);
        ((*event).new_addr, (*event).new_len) = (change.new_addr, change.new_len);
        ((*event).stack_id, (*event).flags, (*event)._pad) = (stack_id, flags, 0);
        (*event).time_ns = time_ns;
    }
    // The daemon is woken only once a quarter of the ring waits: a burst of first touches (a
    // heap growing by tens of MiB at once) is read before it fills the ring, and a process that
    // maps or touches a page now and then wakes nobody.
    let waiting = MAPPING_EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    let wake = if waiting > u64::from(MAPPING_EVENTS_BYTES / 4) { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP };
    entry.submit(wake as u64);
}
