//! `--growth`: a traced process's heap seen by its page faults instead of its allocator calls.
//! The daemon opens a software event counting minor page faults on each of the process's threads
//! (inherited by the threads they start) with this program on it; the kernel counts a fault once
//! it has handled it, so the page is mapped when the program runs. The program walks the stack of
//! each fault and sends the page, and how much the fault mapped, to the daemon through
//! `mapping`'s ring, which keeps each page with the stack that first touched it until the process
//! gives it back. Its cost follows the pages a process touches for the first time, not its
//! allocator calls: a fault on a page already present (copy-on-write after a fork, a write to the
//! zero page a read mapped) is no first touch and is dropped before the walk.
//!
//! How much a fault mapped: a transparent huge page (2 MiB, or a smaller multi-size one) is a
//! large folio the kernel allocates in the fault, movable, and frees again in it when it does not
//! map it (its memory cgroup refused it, or another thread mapped the span first). The page
//! allocator's tracepoints keep, for each thread of a process traced by its pages, the large
//! folio it holds from such an allocation, and the fault's event takes it: the daemon counts the
//! fault at the fault, not by reading the page map later, when the huge page may have been split
//! or the process gone.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{bpf_perf_event_data, pt_regs},
    helpers::{bpf_get_current_pid_tgid, bpf_get_current_task_btf, bpf_ktime_get_ns, bpf_task_pt_regs},
    macros::{map, perf_event, raw_tracepoint},
    maps::{HashMap, PerCpuArray},
    programs::{PerfEventContext, RawTracePointContext},
    EbpfContext, Global,
};
use profiler_common::{stack_table, traced, walk_kind, DropReason};

use crate::{
    mapping, process,
    shared::{count_drop, kernel_word},
    unwind::{self, Regs, TakenReturns},
};

const PAGE: u64 = 4096;
const PAGE_MASK: u64 = !(PAGE - 1);
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

/// A large folio a thread of a process traced by its pages was given, and the fault it was in.
#[derive(Clone, Copy)]
#[repr(C)]
struct LargeFolio {
    /// Its `struct page`, as the allocator's and the free's tracepoints name it.
    page: u64,
    /// The page of the fault the thread was in, from this CPU's `FAULT_CODES`; 0 when this CPU's
    /// last fault was another thread's (see `mapped_at`).
    fault: u64,
    order: u64,
}

/// The large folio each thread (`pid_tgid`) holds since its latest allocation, until its fault's
/// event takes it or the thread frees it. An entry of a thread that allocated one outside a fault
/// (a file's large folio read in by a system call) stays until its next fault's event, which
/// finds it for another page and counts it as `fault_size_unknown`, as an insert into the full
/// map is.
#[map]
static LARGE_FOLIOS: HashMap<u64, LargeFolio> = HashMap::with_max_entries(4_096, 0);

/// `enum migratetype`'s `MIGRATE_MOVABLE`: a process's pages are, the kernel's own large
/// allocations (slabs, the huge zero page) are not.
const MIGRATE_MOVABLE: u64 = 1;
/// The smallest large folio a fault maps (multi-size THP's 16 KiB).
const LARGE_ORDER: u64 = 2;

/// `mm_page_alloc(struct page *page, unsigned int order, gfp_t gfp_flags, int migratetype)`:
/// every allocation of pages on the machine, while a process is traced by its pages. Most are
/// single pages and return at the first test.
#[raw_tracepoint(tracepoint = "mm_page_alloc")]
pub fn large_folio_alloc(ctx: RawTracePointContext) -> i32 {
    let (page, order, migratetype): (u64, u64, u64) = (ctx.arg(0), ctx.arg(1), ctx.arg(3));
    if order < LARGE_ORDER || migratetype & 0xffff_ffff != MIGRATE_MOVABLE || page == 0 {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    if process::traced_flags((pid_tgid >> 32) as u32).is_none_or(|flags| flags & traced::GROWTH == 0) {
        return 0;
    }
    // SAFETY: the map's slot for this CPU, copied at once.
    let fault = match FAULT_CODES.get_ptr(0).map(|code| unsafe { *code }) {
        Some(code) if code.pid_tgid == pid_tgid => code.addr & PAGE_MASK,
        _ => 0,
    };
    if LARGE_FOLIOS.insert(pid_tgid, LargeFolio { page, fault, order }, 0).is_err() {
        count_drop(DropReason::FaultSizeUnknown);
    }
    0
}

/// `mm_page_free(struct page *page, unsigned int order)`: a large folio the fault did not map
/// goes back in the same thread.
#[raw_tracepoint(tracepoint = "mm_page_free")]
pub fn large_folio_free(ctx: RawTracePointContext) -> i32 {
    let (page, order): (u64, u64) = (ctx.arg(0), ctx.arg(1));
    if order < LARGE_ORDER {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: a copy of the value is taken at once.
    if unsafe { LARGE_FOLIOS.get(pid_tgid) }.is_some_and(|held| held.page == page) {
        let _ = LARGE_FOLIOS.remove(pid_tgid);
    }
    0
}

/// The offset of `mapping` in `struct folio`, read from the kernel's BTF by the daemon (0:
/// unknown, a folio is then tied to its fault by the fault's code only).
#[unsafe(no_mangle)]
static FOLIO_MAPPING_OFFSET: Global<u32> = Global::new(0);
/// The offset of `index` in `struct folio`, read the same way.
#[unsafe(no_mangle)]
static FOLIO_INDEX_OFFSET: Global<u32> = Global::new(0);
/// `PAGE_MAPPING_ANON`: the low bit of an anonymous folio's `mapping`.
const MAPPING_ANON: u64 = 1;

/// The bytes the current thread's fault at `page` mapped: its large folio's, when the thread
/// still holds one allocated in this fault; otherwise one page. A folio not known to be this
/// fault's (allocated outside a fault, or on a CPU whose last fault was another's and not found
/// mapped at `page`) is counted.
#[inline(never)]
fn fault_bytes(pid_tgid: u64, page: u64) -> u64 {
    // SAFETY: a copy of the value is taken at once.
    let Some(held) = (unsafe { LARGE_FOLIOS.get(pid_tgid) }).copied() else { return PAGE };
    let _ = LARGE_FOLIOS.remove(pid_tgid);
    if held.order < 32 && (held.fault == page || mapped_at(&held, page)) {
        return PAGE << held.order;
    }
    count_drop(DropReason::FaultSizeUnknown);
    PAGE
}

/// Whether `held` is the anonymous folio mapped over `page`, for a folio whose fault's code was
/// lost: the thread waited in its fault (the page allocator may compact memory first) and other
/// threads' faults took the CPU's `FAULT_CODES`, or it moved to another CPU. The fault has mapped
/// the folio when its event runs, and set its `index` to the page number of its first page in
/// the mapping; anonymous memory (`mmap`, the break) numbers its pages by their addresses. Memory
/// moved by `mremap` keeps its old numbers and is not recognised.
fn mapped_at(held: &LargeFolio, page: u64) -> bool {
    let (mapping_at, index_at) = (FOLIO_MAPPING_OFFSET.load(), FOLIO_INDEX_OFFSET.load());
    if mapping_at == 0 {
        return false;
    }
    let first = page & !((PAGE << held.order) - 1);
    kernel_word(held.page, mapping_at) & MAPPING_ANON != 0 && kernel_word(held.page, index_at) == first / PAGE
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
        kind: walk_kind::PAGE_FAULT,
    };
    let stack_id = unwind::stack_id(stack_table::ALLOCATIONS, tgid, regs);
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let bytes = fault_bytes(bpf_get_current_pid_tgid(), addr & PAGE_MASK);
    mapping::send_fault(tgid, addr & PAGE_MASK, bytes, stack_id, now);
    0
}
