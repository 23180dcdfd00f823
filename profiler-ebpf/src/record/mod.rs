//! The maps and what each probe does to them: a call's entry and return (`calls`), a free
//! (`frees`), the totals an allocation and a free change (`totals`), and the blocks an
//! allocator's own sampler reports (`usdt`). Here: what they share.
//!
//! The maps' capacities in these files are defaults; the daemon sets the real ones at load time.

use aya_ebpf::{
    bindings::{pt_regs, BPF_NOEXIST},
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::map,
    maps::{Array, HashMap},
    programs::ProbeContext,
};
use profiler_common::{
    rate_slot, DropReason, FreeNote, Inflight, LiveAlloc, ProcCounters, SampleRate, NO_STACK, RATE_SLOTS,
};

use crate::{
    shared::{add, count_drop, NO_PREALLOC},
    unwind::{self, Regs},
};

mod calls;
mod frees;
mod totals;
mod usdt;

pub use calls::{current_mm, in_allocator_call, on_completion, on_entry, on_return, on_thread_exit, return_trampoline};
pub use frees::on_free;
pub use totals::new_image;
pub use usdt::{on_usdt_alloc, on_usdt_free};

/// A thread's entry stays while the thread lives, idle (`depth` 0) between calls: rewriting it in
/// place costs far less than an insert per call and a delete per return. `on_thread_exit` removes it.
#[map]
static INFLIGHT: HashMap<u32, Inflight> = HashMap::with_max_entries(16_384, NO_PREALLOC);

#[map]
static PROC_COUNTERS: HashMap<u32, ProcCounters> = HashMap::with_max_entries(4_096, NO_PREALLOC);

/// Processes traced by sampling: tgid → mean bytes between samples (`--sample-bytes`). Their
/// frees of unrecorded blocks are expected, and their double frees are not looked for. Read
/// through `SAMPLE_RATES`, which holds most of them.
#[map]
static SAMPLING: HashMap<u32, u64> = HashMap::with_max_entries(4_096, NO_PREALLOC);
/// The rates again, by slot (see `SampleRate`), kept by the daemon beside `SAMPLING`.
#[map]
static SAMPLE_RATES: Array<SampleRate> = Array::with_max_entries(RATE_SLOTS, 0);

/// Process `tgid`'s mean bytes between samples; 0 when it records every call.
#[inline(always)]
fn sample_bytes(tgid: u32) -> u64 {
    let Some(slot) = SAMPLE_RATES.get(rate_slot(tgid)) else {
        return 0;
    };
    slot.of(tgid).unwrap_or_else(|| unsafe { SAMPLING.get(tgid) }.copied().unwrap_or(0))
}

fn ids() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    ((pid_tgid >> 32) as u32, pid_tgid as u32)
}

/// Zeroed counters to insert from (a read-only global, as `totals`' empty values).
static EMPTY_COUNTERS: ProcCounters =
    ProcCounters { unknown_frees: 0, internal_frees: 0, failed_allocations: 0, usdt_samples: 0, usdt_counts: 0 };

/// A thread's entry between calls.
static IDLE: Inflight = Inflight {
    func: 0,
    depth: 0,
    size: 0,
    ptr_arg: 0,
    tgid: 0,
    stashed: 0,
    stash: LiveAlloc { size: 0, time_ns: 0, stack_id: NO_STACK, tid: 0, func: 0 },
    entry_sp: 0,
    sample_bytes: 0,
    recorded: 0,
    _pad: 0,
    free_note: FreeNote::EMPTY,
    last_alloc: 0,
};

/// Returns the value for `key`, inserting `empty` first when it is missing.
fn get_or_insert<K, V>(map: &HashMap<K, V>, key: &K, empty: &'static V) -> Option<*mut V> {
    if let Some(value) = map.get_ptr_mut(key) {
        return Some(value);
    }
    // Another CPU may insert the same key first; BPF_NOEXIST then fails and the lookup finds theirs.
    let _ = map.insert(key, empty, BPF_NOEXIST as u64);
    map.get_ptr_mut(key)
}

fn bump_proc_counter(tgid: u32, field: fn(&mut ProcCounters) -> &mut u64) {
    add_to_proc_counter(tgid, field, 1);
}

fn add_to_proc_counter(tgid: u32, field: fn(&mut ProcCounters) -> &mut u64, value: u64) {
    match get_or_insert(&PROC_COUNTERS, &tgid, &EMPTY_COUNTERS) {
        Some(counters) => add(field(unsafe { &mut *counters }), value),
        None => count_drop(DropReason::ProcessTableFull),
    }
}

/// The registers of the probe that fired, for a stack walk.
#[derive(Clone, Copy)]
struct Probe {
    regs: *const pt_regs,
    site: Site,
}

/// Where a probe sits, which says where its stack walk starts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Site {
    /// At a function's entry, before anything is pushed: the walk leaves the function out.
    Entry,
    /// At a return probe: the walk starts at the return address.
    Return,
    /// At a USDT probe site, whose frame is the first (see `Regs::at_site`).
    Usdt,
    /// At an allocator's completion site, with the stack as at its entry: the walk starts at the
    /// return address, as at the return (see `Regs::completing`).
    Completion,
}

impl Probe {
    /// Inlined: as a function of its own, its frame would add to the chain of frames a free's
    /// walk stacks up, which 6.1 bounds at 512 bytes.
    #[inline(always)]
    fn stack_id(self, which: u32, tgid: u32) -> u64 {
        // SAFETY: `regs` is the context of the probe that is running.
        let regs = unsafe {
            match self.site {
                Site::Entry => Regs::of(self.regs, false),
                Site::Return => Regs::of(self.regs, true),
                Site::Usdt => Regs::at_site(self.regs),
                Site::Completion => Regs::completing(self.regs, calls::return_trampoline),
            }
        };
        unwind::stack_id(which, tgid, regs)
    }

    /// Where the probed call returns to: at a return probe, the instruction pointer (the kernel
    /// has put the real return address back); elsewhere, the word at the stack pointer, as the
    /// daemon places entry and completion probes where nothing is pushed. 0 when unreadable.
    fn caller(self) -> u64 {
        // SAFETY: `regs` is the context of the probe that is running; the user read faults safely.
        unsafe {
            let regs = &*self.regs;
            if self.site == Site::Return {
                regs.rip
            } else {
                bpf_probe_read_user(regs.rsp as *const u64).unwrap_or(0)
            }
        }
    }

    /// Whether the C library's own code called the free whose entry probe has `cookie`.
    fn called_by_c_library(self, cookie: u64) -> bool {
        // SAFETY: `regs` is the context of the probe that is running: at an entry, its address.
        let here = unsafe { (*self.regs).rip };
        self.site != Site::Return && profiler_common::called_by_c_library(cookie, here, self.caller())
    }
}

/// How far below an allocator call's entry a call nested in it can run. glibc's allocator frames
/// are small; a thread's stack starts megabytes away from any other's.
const NESTING_STACK_SPAN: u64 = 64 * 1024;

/// The address of the probe that fired, at an entry probe: the kernel sets the instruction
/// pointer back to the breakpoint before it runs the programs. `bpf_get_func_ip` says the same
/// but returns 0 in uprobes before Linux 6.6.
#[inline(always)]
pub fn probe_address(ctx: &ProbeContext) -> u64 {
    // SAFETY: the context is the running probe's.
    unsafe { (*ctx.regs).rip }
}

fn stack_pointer(ctx: &ProbeContext) -> u64 {
    #[cfg(bpf_target_arch = "x86_64")]
    {
        unsafe { (*ctx.regs).rsp }
    }
    #[cfg(not(bpf_target_arch = "x86_64"))]
    {
        let _ = ctx;
        0
    }
}
