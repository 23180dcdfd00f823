//! `--growth`: a traced process's heap seen by its page faults instead of its allocator calls.
//! The daemon opens a page-fault software event on each of the process's threads (inherited by
//! the threads they start) with this program on it; the program walks the stack of
//! each fault and sends the page to the daemon through `mapping`'s ring, which keeps each page
//! with the stack that first touched it until the process gives it back. Its cost follows the
//! pages a process touches for the first time, not its allocator calls: a fault on a page already
//! present (copy-on-write after a fork, a write to the zero page a read mapped) is no first touch
//! and is dropped before the walk.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{bpf_perf_event_data, pt_regs},
    helpers::{bpf_get_current_pid_tgid, bpf_get_current_task_btf, bpf_ktime_get_ns, bpf_task_pt_regs},
    macros::{map, perf_event, raw_tracepoint},
    maps::PerCpuArray,
    programs::{PerfEventContext, RawTracePointContext},
    EbpfContext,
};
use profiler_common::stack_table;

use crate::{
    mapping, process,
    shared::kernel_word,
    unwind::{self, Regs, TakenReturns},
};

const PAGE_MASK: u64 = !4095;
/// The page-fault error code's bit for a page present: a protection fault.
const PF_PROT: u64 = 1;

/// A fault's error code, with the thread and address it was for.
#[derive(Clone, Copy)]
#[repr(C)]
struct FaultCode {
    pid_tgid: u64,
    addr: u64,
    error_code: u64,
}

/// The latest page fault's error code on each CPU. The page-fault event's registers do not carry
/// it (the kernel's exception entry overwrites `orig_ax` with -1), the fault tracepoints do, and
/// they fire before the event in the same fault.
#[map]
static FAULT_CODES: PerCpuArray<FaultCode> = PerCpuArray::with_max_entries(1, 0);

/// `page_fault_user(unsigned long address, struct pt_regs *regs, unsigned long error_code)`, and
/// `page_fault_kernel` (the same arguments, for a fault in the kernel copying to or from a
/// process): every fault on the machine, so it only keeps the code.
#[raw_tracepoint(tracepoint = "page_fault_user")]
pub fn fault_code(ctx: RawTracePointContext) -> i32 {
    if let Some(slot) = FAULT_CODES.get_ptr_mut(0) {
        let code = FaultCode { pid_tgid: bpf_get_current_pid_tgid(), addr: ctx.arg(0), error_code: ctx.arg(2) };
        // SAFETY: the map's slot for this CPU, which nothing else writes while the program runs.
        unsafe { *slot = code };
    }
    0
}

/// Whether the current thread's fault at `addr` was on a page present. A code kept for another
/// fault (the thread moved to another CPU between the tracepoint and the event) says no: the
/// fault is walked and sent, and the daemon counts it unless it holds the page already.
fn page_present(addr: u64) -> bool {
    let Some(code) = FAULT_CODES.get_ptr(0) else { return false };
    // SAFETY: the map's slot for this CPU, read in place: the stack walk needs the stack.
    unsafe {
        (*code).pid_tgid == bpf_get_current_pid_tgid() && (*code).addr == addr && (*code).error_code & PF_PROT != 0
    }
}

#[perf_event]
pub fn page_fault(ctx: PerfEventContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // Children the event was inherited by and memprof does not follow.
    if process::traced_flags(tgid).is_none() {
        return 0;
    }
    let data = ctx.as_ptr() as *const bpf_perf_event_data;
    // SAFETY: the context is the running program's.
    let (addr, from_user) = unsafe { ((*data).addr, (*data).regs.cs & 3 == 3) };
    // Not a first touch: the page was touched before, by this process or by the one it was
    // forked from.
    if page_present(addr) {
        return 0;
    }
    // The thread's user registers, saved where it entered the kernel: the fault's own for a
    // fault in user code, the system call's for one in the kernel copying to or from the process.
    // SAFETY: helpers on the current task, which lives while the program runs.
    let user = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as u64;
    let word = |field: usize| kernel_word(user, field as u32);
    let (pc, sp) = (word(offset_of!(pt_regs, rip)), word(offset_of!(pt_regs, rsp)));
    // Code read in from its file at its first run. A thread's stack growing is sent as any other
    // touch, and counted outside the heap by the daemon, which knows the stacks' mappings: a
    // window around the stack pointer also took the heap a new thread fills just above its stack.
    if addr & PAGE_MASK == pc & PAGE_MASK || user == 0 {
        return 0;
    }
    let regs = Regs {
        // In user code, the instruction that touched the page, kept as if a call returned just
        // after its first byte (as at a USDT site): the walk then finds its row, and the reports,
        // which take every frame for a return address and name the byte before it, its function.
        // A touch at a function's first instruction was named after the function before it.
        pc: pc + u64::from(from_user),
        sp,
        bp: word(offset_of!(pt_regs, rbp)),
        // In a system call, the instruction after `syscall`.
        pc_is_return: true,
        // The code that touched the page is the stack's first frame.
        first_is_probed: false,
        // No allocator probes in such a process: no return address was taken.
        taken: TakenReturns::NONE,
        counts_cuts: true,
    };
    let stack_id = unwind::stack_id(stack_table::ALLOCATIONS, tgid, regs);
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    mapping::send_fault(tgid, addr & PAGE_MASK, stack_id, now);
    0
}
