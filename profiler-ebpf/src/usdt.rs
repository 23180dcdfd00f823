//! The `otel_memory` USDT probes an allocator fires for the allocations its own sampler picks,
//! and the functions where Go's runtime records its samples (see `profiler_common::usdt`): the
//! only probes of a process traced with `--usdt`, so that its cost is one trap per sampled
//! allocation and free, whatever its allocation rate.

use aya_ebpf::{
    helpers::{bpf_get_attach_cookie, bpf_probe_read_kernel, bpf_probe_read_user},
    macros::{map, uprobe},
    maps::Array,
    programs::ProbeContext,
    EbpfContext,
};
use profiler_common::{
    exponential_weight,
    usdt::{self, kind, sampler, ArgSpec, ProbeSpec},
};

use crate::record;

/// Where each probe site's arguments are, filled by the daemon from the sites' notes: a probe's
/// cookie is its index here.
#[map]
static USDT_SPECS: Array<ProbeSpec> = Array::with_max_entries(usdt::MAX_SPECS, 0);

/// `otel_memory:alloc(ptr, size, weight)`; Go's `mProf_Malloc(ptr, size)`, with the mean bytes
/// between samples for third argument.
#[uprobe]
pub fn usdt_alloc(ctx: ProbeContext) -> u32 {
    if let Some(spec) = spec(&ctx) {
        let (ptr, size, third) = (arg(&ctx, &spec.args[0]), arg(&ctx, &spec.args[1]), arg(&ctx, &spec.args[2]));
        let weight = if spec.sampler == sampler::GO { exponential_weight(size, third) } else { third };
        record::on_usdt_alloc(&ctx, ptr, size, weight);
    }
    0
}

/// `otel_memory:free(ptr)`; Go's `freeSpecial(special, ptr, size)`, where only a heap profile's
/// special record ends a sample (the second and third arguments read equal; both are 0 for the
/// contract's probe).
#[uprobe]
pub fn usdt_free(ctx: ProbeContext) -> u32 {
    if let Some(spec) = spec(&ctx) {
        if arg(&ctx, &spec.args[1]) == arg(&ctx, &spec.args[2]) {
            record::on_usdt_free(&ctx, arg(&ctx, &spec.args[0]));
        }
    }
    0
}

/// The spec of the probe site that fired.
fn spec(ctx: &ProbeContext) -> Option<&'static ProbeSpec> {
    // SAFETY: the context is the running probe's.
    let index = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    USDT_SPECS.get(index)
}

/// The argument `arg` locates; 0 when unreadable.
fn arg(ctx: &ProbeContext, arg: &ArgSpec) -> u64 {
    let word = match arg.kind {
        kind::CONSTANT => arg.value as u64,
        kind::REGISTER | kind::MEMORY if arg.register_offset <= usdt::PT_REGS_SIZE - 8 => {
            // A register at an offset known only at run time: read through the helper, as the
            // verifier refuses a direct load from the context at a variable offset.
            // SAFETY: the offset is inside the probe's `pt_regs`; the helper faults safely.
            let register_at = unsafe { (ctx.regs as *const u8).add(arg.register_offset as usize) };
            let register = unsafe { bpf_probe_read_kernel(register_at as *const u64) }.unwrap_or(0);
            if arg.kind == kind::REGISTER {
                register
            } else {
                // SAFETY: a read of the target's memory through the helper, which faults safely.
                unsafe { bpf_probe_read_user(register.wrapping_add(arg.value as u64) as *const u64) }.unwrap_or(0)
            }
        }
        _ => 0,
    };
    usdt::extend(word, arg)
}
