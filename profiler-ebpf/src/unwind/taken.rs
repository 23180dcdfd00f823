//! The return addresses the kernel's uretprobes took from a thread's stack, found again for a
//! walk from inside probed calls, and written back into a deferred walk's copy of the stack.

use aya_ebpf::{
    helpers::{bpf_get_current_task, bpf_probe_read_kernel},
    Global,
};

use super::Walk;
use crate::shared::kernel_word;

/// The return addresses the kernel's uretprobes took from a thread's stack: each call's slot
/// holds the return trampoline's address instead, and the kernel keeps the real one in a list,
/// innermost first (`struct return_instance`).
#[derive(Clone, Copy)]
pub struct TakenReturns {
    /// The process's return trampoline (0: none to look for).
    pub trampoline: u64,
    /// The thread's innermost `return_instance`.
    pub innermost: u64,
}

impl TakenReturns {
    pub const NONE: TakenReturns = TakenReturns { trampoline: 0, innermost: 0 };

    /// The current thread's, given its process's return trampoline.
    pub fn current(trampoline: u64) -> TakenReturns {
        TakenReturns { trampoline, innermost: innermost() }
    }

    /// The real return address of the slot at `sp`, whose value is `slot`: the one the kernel
    /// keeps for it when the current thread has returns taken and `slot` is the trampoline
    /// (`trampoline` is asked for only then). A tail call's instance shares its caller's slot
    /// and keeps the same address; an instance left by a call that was jumped out of lies below.
    /// Not inlined: its reads would add to the frame of the program that walks the stack next.
    #[inline(never)]
    pub fn real_return(slot: u64, sp: u64, trampoline: impl FnOnce() -> u64) -> u64 {
        let mut instance = innermost();
        if instance == 0 || slot != trampoline() {
            return slot;
        }
        for _ in 0..TAKEN_MAX {
            if instance == 0 {
                break;
            }
            if kernel_word(instance, RETURN_STACK_OFFSET.load()) == sp {
                return kernel_word(instance, RETURN_ADDRESS_OFFSET.load());
            }
            instance = kernel_word(instance, RETURN_NEXT_OFFSET.load());
        }
        slot
    }
}

/// The current thread's innermost `return_instance`; 0 when it has none.
fn innermost() -> u64 {
    // SAFETY: a helper without arguments.
    let task = unsafe { bpf_get_current_task() };
    let utask = kernel_word(task, TASK_UTASK_OFFSET.load());
    if utask == 0 {
        0
    } else {
        kernel_word(utask, UTASK_RETURNS_OFFSET.load())
    }
}

/// Offsets, read by the daemon from the kernel's BTF: `task->utask->return_instances`, and a
/// `return_instance`'s `orig_ret_vaddr`, `chained`, `next` and `stack` (the slot's address).
#[unsafe(no_mangle)]
static TASK_UTASK_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static UTASK_RETURNS_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_ADDRESS_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_CHAINED_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_NEXT_OFFSET: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static RETURN_STACK_OFFSET: Global<u32> = Global::new(0);

/// Instances looked at: a walk meets as many as probed calls are in flight in its thread
/// (nested allocator calls), and a probed function tail-called by another probed function adds
/// a `chained` instance that shares its caller's slot.
const TAKEN_MAX: usize = 4;

/// The real return address of the next slot holding the trampoline, walking outward; moves past
/// the instances that share it. 0 when the list has no more (the walk then ends).
pub(super) fn taken_return(walk: &mut Walk) -> u64 {
    let address = kernel_word(walk.taken, RETURN_ADDRESS_OFFSET.load());
    for _ in 0..TAKEN_MAX {
        let instance = walk.taken;
        if instance == 0 {
            break;
        }
        // SAFETY: a read through the helper, which faults safely; `chained` is a bool.
        let chained = unsafe { bpf_probe_read_kernel((instance + RETURN_CHAINED_OFFSET.load() as u64) as *const u8) };
        walk.taken = kernel_word(instance, RETURN_NEXT_OFFSET.load());
        if chained.unwrap_or(0) == 0 {
            break;
        }
    }
    address
}

/// Writes back, in a deferred walk's copy of the stack (`copied` bytes from `window_start`), the
/// return addresses uretprobes took from it (see `TakenReturns`), from `instance` outward: user
/// space finishes the walk from the copy, where their slots hold the trampoline.
///
/// # Safety
/// `window` must be the event's copy, `WINDOW_BYTES` long.
pub(super) unsafe fn restore_taken<const WINDOW_BYTES: usize>(
    mut instance: u64,
    window_start: u64,
    copied: u64,
    window: *mut u8,
) {
    for _ in 0..TAKEN_MAX {
        if instance == 0 {
            break;
        }
        let offset = kernel_word(instance, RETURN_STACK_OFFSET.load()).wrapping_sub(window_start);
        if offset + 8 <= copied && offset <= (WINDOW_BYTES - 8) as u64 {
            let slot = window.add(offset as usize).cast::<u64>();
            slot.write_unaligned(kernel_word(instance, RETURN_ADDRESS_OFFSET.load()));
        }
        instance = kernel_word(instance, RETURN_NEXT_OFFSET.load());
    }
}
