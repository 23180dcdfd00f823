//! The daemon's side of the live blocks' filter (see `profiler_common::LIVE_FILTER_SLOTS`): the
//! programs count every `LIVE` entry in its slot, and the daemon takes off the entries it removes
//! itself. Through a shared mapping of the array, so that each subtraction is atomic against the
//! programs' adds: a slot counted too low would hide a live block.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use anyhow::{bail, Context as _};
use aya::{maps::Map, Ebpf};
use profiler_common::{live_filter_slot, AddrKey, LIVE_FILTER_SLOTS};

use crate::kernel::aggregate;

const FILTER_BYTES: usize = LIVE_FILTER_SLOTS as usize * size_of::<u64>();

/// Takes the `LIVE` entries this daemon removed off their slots.
pub fn forget(ebpf: &Ebpf, removed: &[AddrKey]) -> anyhow::Result<()> {
    if removed.is_empty() {
        return Ok(());
    }
    let Map::Array(data) = aggregate::map(ebpf, "LIVE_FILTER")? else {
        bail!("map LIVE_FILTER is not an array");
    };
    // SAFETY: a new shared mapping of a BPF array created with BPF_F_MMAPABLE, of its whole size
    // (a whole number of pages), unmapped below.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            FILTER_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            data.fd().as_fd().as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error()).context("mapping LIVE_FILTER");
    }
    let slots = NonNull::new(address.cast::<AtomicU64>()).context("mapping LIVE_FILTER: NULL")?;
    for key in removed {
        // SAFETY: the slot is inside the mapping (`live_filter_slot` is below LIVE_FILTER_SLOTS)
        // and 8-aligned; the programs only add to it atomically.
        let slot = unsafe { slots.add(live_filter_slot(key) as usize).as_ref() };
        slot.fetch_sub(1, Ordering::Relaxed);
    }
    // SAFETY: the mapping made above; no reference into it outlives the loop.
    unsafe { libc::munmap(address, FILTER_BYTES) };
    Ok(())
}
