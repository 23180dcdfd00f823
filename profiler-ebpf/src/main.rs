//! Uprobes on the allocator of traced processes.
//!
//! Entry probes keep each call's arguments per thread in `INFLIGHT`; one shared return probe decides
//! what the call did (see `on_return`), records the allocation in `LIVE` and adds it to the
//! per-(process, stack) totals in `STACK_STATS`. `free` moves an allocation from `LIVE` to the
//! bounded `RECENT_FREES`, where a second free of the same address is recognised. Nothing is
//! streamed to userspace per allocation: the daemon reads the small totals every interval.
//! `usdt` records what an allocator's own sampler reports instead. `mapping` follows the anonymous
//! memory traced processes get from `mmap`, `mremap` and `brk`; `growth` sees a process by its
//! page faults instead of its allocator calls (`--growth`).
#![no_std]
#![no_main]
// Atomic adds to map values: see `shared::add`.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod growth;
mod live;
mod mapping;
mod memo;
mod process;
mod record;
mod shared;
mod unwind;
mod usdt;

use aya_ebpf::{
    bindings::pt_regs,
    helpers::{bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_get_func_ip, bpf_probe_read_kernel},
    macros::{raw_tracepoint, uprobe, uretprobe},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
    EbpfContext,
};
use core::{ffi::c_void, mem::offset_of};

use profiler_common::{
    completion::{Completion, RegisterNumber},
    moved_argument, moved_block, return_owner, AllocFn, SHARED_LINK,
};

/// One entry program serves every allocator function: the probe's cookie is its `AllocFn`, so that
/// one `uprobe_multi` link carries all of a process's entry points (see the daemon's `probes`).
#[uprobe]
pub fn alloc_entry(ctx: ProbeContext) -> u32 {
    let (cookie, shared_link) = cookie(&ctx);
    if process::probed(shared_link) {
        entry(&ctx, cookie, false);
    }
    0
}

/// The probe's own cookie, and whether its link is shared by every process mapping the file.
#[inline(always)]
fn cookie(ctx: &ProbeContext) -> (u64, bool) {
    // SAFETY: the context is the running probe's.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    (cookie & !SHARED_LINK, cookie & SHARED_LINK != 0)
}

/// Records an allocator call's entry; returns whether its return must be seen (`skippable`: a
/// session's return fires only then). Inlined, for the frames' sake (see `on_completion`).
#[inline(always)]
fn entry(ctx: &ProbeContext, cookie: u64, skippable: bool) -> bool {
    // The function is the cookie's low half; a completion site's says more above it.
    let Some(func) = AllocFn::from_u32(cookie as u32) else {
        return false;
    };
    if let Some(completion) = Completion::of(cookie) {
        // SAFETY: the context is the running probe's.
        let flags = unsafe { (*ctx.regs).eflags };
        if completion.completes(flags) {
            record::on_completion(ctx, func, argument(ctx, cookie, 0), register(ctx, completion.result));
        }
        // A call that goes on is seen by its later site: none needs a return probe from here.
        return false;
    }
    let (size, ptr_arg) = entry_arguments(ctx, cookie, func);
    record::on_entry(ctx, func, size, ptr_arg, skippable)
}

/// The value of register `number` (see `profiler_common::completion`) at the probe.
///
/// Read by the helper at the register's offset in the context: the verifier refuses a load at a
/// computed offset into the context, which LLVM makes of one load per `match` arm when it merges
/// them (it did, in the free program). A function of its own: inlined at each argument read, its
/// helper's output slots made the session program's frame too large (see `on_completion`).
#[inline(never)]
fn register(ctx: &ProbeContext, number: RegisterNumber) -> u64 {
    let offset = match number {
        0 => offset_of!(pt_regs, rax),
        1 => offset_of!(pt_regs, rcx),
        2 => offset_of!(pt_regs, rdx),
        3 => offset_of!(pt_regs, rbx),
        6 => offset_of!(pt_regs, rsi),
        7 => offset_of!(pt_regs, rdi),
        8 => offset_of!(pt_regs, r8),
        9 => offset_of!(pt_regs, r9),
        10 => offset_of!(pt_regs, r10),
        11 => offset_of!(pt_regs, r11),
        12 => offset_of!(pt_regs, r12),
        13 => offset_of!(pt_regs, r13),
        14 => offset_of!(pt_regs, r14),
        15 => offset_of!(pt_regs, r15),
        // rsp and rbp, which the daemon never names (see `fast_path`).
        _ => return 0,
    };
    // SAFETY: a helper reading kernel memory, which faults safely: a field of the probe's
    // registers, the context.
    unsafe { bpf_probe_read_kernel(ctx.regs.cast::<u8>().add(offset).cast::<u64>()) }.unwrap_or(0)
}

/// Entry and return of every allocator function in one uprobe session (Linux 6.13+): at the
/// entry, returning 1 spares the call its return probe, which a call sampled mode did not draw
/// does not need. The entry is where the instruction pointer is still the probed function's
/// (`bpf_get_func_ip` returns it in uprobes from Linux 6.6, before sessions existed).
///
/// Written out rather than with `#[uprobe]`, whose wrapper always returns 0.
#[unsafe(no_mangle)]
#[unsafe(link_section = "uprobe")]
pub fn alloc_session(raw: *mut c_void) -> u32 {
    let ctx = ProbeContext::new(raw);
    // SAFETY: the context is the running probe's; at a session's return the registers are those
    // after the function returned.
    let (ip, func_ip) = unsafe { ((*ctx.regs).rip, bpf_get_func_ip(ctx.as_ptr())) };
    if ip == func_ip {
        // A process this link does not record: its return is skipped too.
        let (cookie, shared_link) = cookie(&ctx);
        return u32::from(!(process::probed(shared_link) && entry(&ctx, cookie, true)));
    }
    record::on_return(&RetProbeContext::new(ctx.as_ptr()));
    0
}

/// The size `func` was asked for, and the pointer argument to keep (the old block of a resize,
/// posix_memalign's out-pointer), at the probe whose cookie is `cookie`.
fn entry_arguments(ctx: &ProbeContext, cookie: u64, func: AllocFn) -> (u64, u64) {
    // Each register read at a constant offset: the verifier refuses a computed one into the
    // context, which reading argument `n` for a variable `n` would compile to.
    let registers =
        (argument(ctx, cookie, 0), argument(ctx, cookie, 1), argument(ctx, cookie, 2), argument(ctx, cookie, 3));
    let nth = |n: usize| match n {
        0 => registers.0,
        1 => registers.1,
        2 => registers.2,
        3 => registers.3,
        _ => 0,
    };
    let args = func.arguments();
    let size = match args.count {
        Some(count) => product(nth(count), nth(args.size)),
        None => nth(args.size),
    };
    (size, args.pointer.map_or(0, nth))
}

fn arg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

/// Argument `n` (0 to 3) at the probe whose cookie is `cookie`: in the register the cookie names
/// where the function's first instructions moved it (see `profiler_common::MovedArguments`).
#[inline(always)]
fn argument(ctx: &ProbeContext, cookie: u64, n: usize) -> u64 {
    moved_or_own(ctx, moved_argument(cookie, n), n)
}

/// Argument `n` in register `moved`, or in its own.
#[inline(always)]
fn moved_or_own(ctx: &ProbeContext, moved: Option<RegisterNumber>, n: usize) -> u64 {
    match moved {
        Some(number) => register(ctx, number),
        None => arg(ctx, n),
    }
}

/// calloc's and reallocarray's `n * size`; `u64::MAX` when it overflows (the call then fails).
/// Done in 32-bit halves: LLVM turns any overflow check of a 64-bit multiply into a 128-bit one,
/// which BPF does not have.
fn product(n: u64, size: u64) -> u64 {
    let (n_hi, n_lo, s_hi, s_lo) = (n >> 32, n & 0xffff_ffff, size >> 32, size & 0xffff_ffff);
    if n_hi != 0 && s_hi != 0 {
        return u64::MAX;
    }
    let cross = n_hi * s_lo + n_lo * s_hi;
    if cross >> 32 != 0 {
        return u64::MAX;
    }
    (cross << 32).saturating_add(n_lo * s_lo)
}

/// One return program serves every allocator function: `INFLIGHT` says which one returned (and
/// has nothing for a call whose entry was not recorded). A traced process's own return link and
/// a shared one both fire at its returns: only the kind of link its entry was recorded by acts.
#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    // SAFETY: the context is the running probe's.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    // A perf-event uprobe's return runs in processes it was not opened for on Linux 6.1 (see
    // `RETURN_OWNER_SHIFT`): those returns are other processes' calls.
    let owner = return_owner(cookie);
    if owner != 0 && owner != (bpf_get_current_pid_tgid() >> 32) as u32 {
        return 0;
    }
    if process::probed(cookie & SHARED_LINK != 0) {
        record::on_return(&ctx);
    }
    0
}

/// Every free of every family: each takes the block as its first argument (`free`, `sdallocx`,
/// `operator delete`, `mi_free`, `__rg_dealloc`, ...).
#[uprobe]
pub fn free(ctx: ProbeContext) -> u32 {
    let (cookie, shared_link) = cookie(&ctx);
    if !process::probed(shared_link) {
        return 0;
    }
    record::on_free(&ctx, moved_or_own(&ctx, moved_block(cookie), 0), cookie);
    0
}

/// `sched_process_exit`, in every exiting thread of every process (one lookup for those not in an
/// allocator call): see `record::on_thread_exit` and `process::on_thread_exit`.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn thread_exit(_ctx: RawTracePointContext) -> i32 {
    record::on_thread_exit();
    process::on_thread_exit();
    0
}

/// Fires at the dynamic linker's `_dl_debug_state`, which glibc calls before and after it maps or
/// unmaps libraries (at start, dlopen, dlclose): the daemon reads the new mappings' unwind tables.
/// The cookie is the distance from `_dl_debug_state` to the linker's `_r_debug` (0: not found).
#[uprobe]
pub fn mappings_changed(ctx: ProbeContext) -> u32 {
    let (delta, shared_link) = cookie(&ctx);
    if !process::probed(shared_link) {
        return 0;
    }
    let here = record::probe_address(&ctx);
    let r_debug = if delta == 0 || here == 0 { 0 } else { here.wrapping_add(delta) };
    unwind::on_mappings_changed(r_debug);
    0
}

/// Does nothing: a link of it is made on a traced process's probe sites and closed at once. Its
/// closing has the kernel take those breakpoints out of every process no other link wants them
/// in: the children a traced process forked with copies of them, which are not traced.
#[uprobe]
pub fn sweep(_ctx: ProbeContext) -> u32 {
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
