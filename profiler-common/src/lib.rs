//! Types shared by the eBPF programs and the daemon.
//!
//! Everything here crosses the kernel/user boundary through BPF maps, so every type is `#[repr(C)]`,
//! has no implicit padding (asserted below) and holds plain integers only.
#![cfg_attr(not(test), no_std)]

mod alloc_fn;
mod blocks;
pub mod completion;
mod drops;
mod events;
pub mod generations;
mod probe_cookies;
mod sampling;
mod stack;
mod totals;
mod unwind;
pub mod usdt;

pub use alloc_fn::*;
pub use blocks::*;
pub use drops::*;
pub use events::*;
pub use probe_cookies::*;
pub use sampling::*;
pub use stack::*;
pub use totals::*;
pub use unwind::*;

use generations::GENERATIONS;

const _: () = {
    assert!(core::mem::size_of::<Inflight>() == 128);
    assert!(core::mem::size_of::<FreeNote>() == 32);
    assert!(core::mem::size_of::<AddrKey>() == 16);
    assert!(core::mem::size_of::<LiveAlloc>() == 32);
    assert!(core::mem::size_of::<FreeSite>() == 32);
    assert!(core::mem::size_of::<FreedAlloc>() == 64);
    assert!(core::mem::size_of::<RecentFree>() == 80);
    assert!(core::mem::size_of::<DoubleFreeEvent>() == 112);
    assert!(core::mem::size_of::<StackKey>() == 16);
    assert!(core::mem::size_of::<Stack>() == 16 + 8 * MAX_FRAMES);
    assert!(core::mem::size_of::<UnwindRow>() == 12);
    assert!(core::mem::size_of::<ExecMapping>() == 40);
    assert!(core::mem::size_of::<ProcMappings>() == 16 + 40 * MAX_MAPPINGS);
    assert!(core::mem::size_of::<StackStats>() == 88 + 16 * GENERATIONS);
    assert!(core::mem::size_of::<ThreadPairKey>() == 16);
    assert!(core::mem::size_of::<ThreadPairStats>() == 16);
    assert!(core::mem::size_of::<ProcCounters>() == 40);
    assert!(core::mem::size_of::<SampleRate>() == 16);
    assert!(core::mem::size_of::<usdt::ProbeSpec>() == 24 * usdt::ARGS + 8);
    assert!(core::mem::size_of::<ProcDrops>() == 8 * DropReason::COUNT);
    assert!(core::mem::size_of::<Log2Histogram>() == 8 * LOG2_BUCKETS);
    assert!(core::mem::size_of::<ProcHeap>() == 40 + 16 * LOG2_BUCKETS);
    assert!(core::mem::size_of::<ProcessEvent>() == 32 + EXEC_PATH_BYTES);
    assert!(core::mem::size_of::<MappingEvent>() == 72);
};

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are repr(C), padding-free (asserted above) and valid for any bit pattern.
    unsafe impl aya::Pod for AddrKey {}
    unsafe impl aya::Pod for LiveAlloc {}
    unsafe impl aya::Pod for LiveWatch {}
    unsafe impl aya::Pod for StackKey {}
    unsafe impl aya::Pod for StackStats {}
    unsafe impl aya::Pod for ProcCounters {}
    unsafe impl aya::Pod for SampleRate {}
    unsafe impl aya::Pod for ProcDrops {}
    unsafe impl aya::Pod for Log2Histogram {}
    unsafe impl aya::Pod for ProcHeap {}
    unsafe impl aya::Pod for ThreadPairKey {}
    unsafe impl aya::Pod for ThreadPairStats {}
    unsafe impl aya::Pod for FreedAlloc {}
    unsafe impl aya::Pod for RecentFree {}
    unsafe impl aya::Pod for Inflight {}
    unsafe impl aya::Pod for Stack {}
    unsafe impl aya::Pod for UnwindRow {}
    unsafe impl aya::Pod for ProcMappings {}
    unsafe impl aya::Pod for ProcessEvent {}
    unsafe impl aya::Pod for DoubleFreeEvent {}
    unsafe impl aya::Pod for MappingEvent {}
    unsafe impl aya::Pod for usdt::ProbeSpec {}
}
