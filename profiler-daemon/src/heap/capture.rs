//! What `--inspect` marks, taken while the process is held still as briefly as can be: its
//! tracked blocks (`LIVE`), every thread's registers, and a copy of every writable mapping.
//! Above `PRECOPY_ABOVE` of such memory (or when asked), the memory is copied first while the
//! process runs, and the stop reads again only the pages written since where the kernel keeps
//! soft-dirty bits; every page into the warm copy elsewhere (`process::precopy`). Only when
//! asked (`Precopy::WriteProtect`), those of its anonymous memory that userfaultfd's write
//! protection says were written, set up by calls injected in a first brief stop: a memprof
//! killed while an injected call runs leaves the thread on memprof's registers, so no default
//! injects.
//!
//! `LIVE` (every traced process's blocks, about a microsecond an entry to read) is read before the
//! stop, after the pre-copy; in the stop, the process's heap figures (`PROC_HEAP`), which each
//! allocation and free changes after `LIVE`, say whether any was made since: then, and only
//! then, `LIVE` is read again, so that no block made or freed meanwhile is missed or classed
//! though gone.

use std::time::Instant;

use aya::Ebpf;
use serde::{Deserialize, Serialize};

use crate::{
    kernel::{
        live::{self, LiveBlock},
        live_watch,
    },
    process::{
        freeze::Frozen,
        image::{self, Image},
        memory,
        precopy::{PreCopy, Tracking},
        procfs::{self, Region},
    },
};

/// Under `--inspect-precopy auto`, memory is pre-copied when there is more than this to copy
/// (pages that hold data): below, copying it all in the stop takes about as long as reading its
/// soft-dirty bits.
const PRECOPY_ABOVE: u64 = 16 << 20;

/// When to copy the process's memory before the stop (`--inspect-precopy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Precopy {
    /// When it holds more than 16 MiB in writable mappings; nothing is injected.
    #[default]
    Auto,
    /// Always; nothing is injected.
    Always,
    Never,
    /// Always, and where the kernel keeps no soft-dirty bits, by userfaultfd's write protection,
    /// opened by calls injected into the process: memprof killed by SIGKILL meanwhile may crash it.
    WriteProtect,
}

/// How the process's memory was copied (JSON `"method"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// All of it while the process was held still.
    #[default]
    SingleStop,
    /// While it ran, then in the stop only the pages written meanwhile (soft-dirty bits).
    SoftDirty,
    /// While it ran, then in the stop the pages of its anonymous memory written meanwhile
    /// (userfaultfd's write protection, on a kernel without soft-dirty bits) and the rest whole.
    WriteProtect,
    /// While it ran, then in the stop all of it again, into memory the first copy made ready:
    /// neither soft-dirty bits nor write protection could be had.
    Recopy,
}

/// How long each stage took, in milliseconds (JSON `"stages"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stages {
    /// Before the stop, the process running: soft-dirty bits cleared (or the write protection
    /// set up, its first brief stop included) and memory copied, `LIVE` read.
    pub before_stop_ms: f64,
    /// The pause, in turn: every thread stopped; the heap figures compared (and the blocks that
    /// changed read again if they did); the mappings listed and copied (or the pages written since the
    /// pre-copy read again), and the threads released.
    pub stop_ms: f64,
    pub live_ms: f64,
    pub copy_ms: f64,
    /// After the pause: the marking of the copy.
    pub mark_ms: f64,
    /// With `write_protect`, the first brief stop, in `before_stop_ms`: a thread of the process
    /// made to open a userfaultfd.
    #[serde(default)]
    pub first_stop_ms: f64,
}

/// A process as it was in the stop.
pub struct Capture {
    /// Sorted by address.
    pub blocks: Vec<LiveBlock>,
    /// Its writable mappings, each copied whole, `/dev` and the kernel's (`[vdso]`, `[vvar]`) left out.
    pub regions: Vec<Region>,
    pub image: Image,
    /// Per thread, its general-purpose registers and stack pointer.
    pub threads: Vec<(Vec<u64>, u64)>,
    pub method: Method,
    /// Whether the whole of `LIVE` was read again in the stop: the process allocated or freed
    /// after it was first read, more often than `LIVE_CHANGES` could note (see `live_watch`).
    pub live_read_in_pause: bool,
    /// The blocks it allocated or freed after `LIVE` was first read, each read again in the stop.
    pub live_changes_in_pause: usize,
    /// How long the process was held still.
    pub pause_ms: f64,
    /// Bytes read while it was held still.
    pub bytes_copied_in_pause: u64,
    pub stages: Stages,
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("pid {pid} holds {} MiB in its writable mappings, more than half of the {room} to copy them into; it was not inspected (free memory or raise memprof's memory limit first)", bytes >> 20)]
    TooLarge { pid: u32, bytes: u64, room: memory::Room },
    #[error("pid {pid} holds {blocks} blocks memprof tracks, and classing them would take about {} MiB more, more than half of the {room}; it was not inspected (free memory or raise memprof's memory limit first)", bytes >> 20)]
    TooManyBlocks { pid: u32, blocks: usize, bytes: u64, room: memory::Room },
}

/// What classing a block memprof tracks takes at most, beside its entry in the list read from
/// `LIVE`: that list read again in the stop, its entry among the blocks marked and the marking's
/// state for it (measured: BENCHMARKS.md, "The pause of `--inspect`").
const CLASSED_BLOCK_BYTES: u64 = 112;

/// Takes `pid`'s capture.
pub fn capture(ebpf: &Ebpf, pid: u32, precopy: Precopy) -> anyhow::Result<Capture> {
    let mut stages = Stages::default();
    let started = Instant::now();
    // Measured before the stop, to keep it short: the mappings may grow a little meanwhile.
    let regions = copied(&procfs::regions(pid)?);
    let to_copy = image::bytes_to_copy(pid, &regions)?;
    check_size(pid, to_copy)?;
    let mut pre = match precopy {
        Precopy::Never => None,
        Precopy::Auto if to_copy <= PRECOPY_ABOVE => None,
        Precopy::Auto | Precopy::Always | Precopy::WriteProtect => {
            Some(PreCopy::start(pid, &regions, precopy == Precopy::WriteProtect)?)
        }
    };
    if let Some(PreCopy { tracking: Tracking::WriteProtect(watch), .. }) = &pre {
        stages.first_stop_ms = watch.stop_ms;
    }
    let mut watch = live_watch::Watch::start(ebpf, pid)?;
    let heap = live::heap_state(ebpf, pid)?;
    let listed = live::blocks(ebpf, pid)?;
    // The copy (unless made already) and the classing of the blocks must fit in what is left.
    let uncopied = if pre.is_some() { 0 } else { to_copy };
    check_blocks(pid, listed.len(), uncopied)?;
    stages.before_stop_ms = ms(started);

    let paused = Instant::now();
    let frozen = Frozen::stop(pid)?;
    stages.stop_ms = ms(paused);
    let at = Instant::now();
    let changed = heap.is_none() || live::heap_state(ebpf, pid)? != heap;
    let changes = if changed { watch.changed()? } else { Some(Vec::new()) };
    let live_read_in_pause = changes.is_none();
    let live_changes_in_pause = changes.as_ref().map_or(0, Vec::len);
    let blocks = match changes {
        Some(changes) if changes.is_empty() => listed,
        Some(changes) => live::with_changes(ebpf, pid, listed, &changes)?,
        None => {
            // Read again in its room, not beside it.
            drop(listed);
            live::blocks(ebpf, pid)?
        }
    };
    stages.live_ms = ms(at);
    let at = Instant::now();
    let regions = copied(&procfs::regions(pid)?);
    let (image, method) = match &mut pre {
        Some(pre) => {
            let method = match pre.tracking {
                Tracking::None => Method::Recopy,
                Tracking::SoftDirty => Method::SoftDirty,
                Tracking::WriteProtect(_) => Method::WriteProtect,
            };
            (pre.finish(&regions)?, method)
        }
        None => (Image::copy(pid, &regions)?, Method::SingleStop),
    };
    let bytes_copied_in_pause = image.bytes_read;
    let threads = frozen.threads.iter().map(|t| (t.registers.clone(), t.stack_pointer())).collect();
    drop(frozen);
    stages.copy_ms = ms(at);
    let pause_ms = ms(paused);
    // Ends the write protection and the watch, the process running.
    drop(pre);
    drop(watch);
    tracing::debug!(
        pid,
        ?method,
        live_read_in_pause,
        live_changes_in_pause,
        pause_ms,
        ?stages,
        blocks = blocks.len(),
        bytes_copied_in_pause,
        "captured"
    );
    Ok(Capture {
        blocks,
        regions,
        image,
        threads,
        method,
        live_read_in_pause,
        live_changes_in_pause,
        pause_ms,
        bytes_copied_in_pause,
        stages,
    })
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// The mappings copied: the writable ones but device memory and the kernel's.
fn copied(regions: &[Region]) -> Vec<Region> {
    regions.iter().filter(|r| r.writable && !is_device(&r.path) && !r.path.starts_with("[v")).cloned().collect()
}

/// A device's memory, which reading may disturb. Not shared anonymous memory, which the maps
/// show as `/dev/zero (deleted)`, nor POSIX shared memory (`/dev/shm/NAME`): a pointer kept
/// there keeps its block reachable.
fn is_device(path: &str) -> bool {
    path.starts_with("/dev/") && !path.starts_with("/dev/zero") && !path.starts_with("/dev/shm/")
}

/// A process with more memory to copy than memprof may take (a daemon under a cgroup limit) is
/// not copied.
fn check_size(pid: u32, bytes: u64) -> Result<(), CaptureError> {
    let room = memory::room();
    if bytes > room.bytes / 2 {
        return Err(CaptureError::TooLarge { pid, bytes, room });
    }
    Ok(())
}

/// A process whose tracked blocks would take more to class, with what is still to copy, than
/// memprof may take is not stopped.
fn check_blocks(pid: u32, blocks: usize, uncopied: u64) -> Result<(), CaptureError> {
    let room = memory::room();
    let bytes = (blocks as u64).saturating_mul(CLASSED_BLOCK_BYTES);
    if bytes.saturating_add(uncopied) > room.bytes / 2 {
        return Err(CaptureError::TooManyBlocks { pid, blocks, bytes, room });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_is_copied_and_devices_are_not() {
        for path in ["/dev/zero (deleted)", "/dev/shm/cache", "/memfd:x (deleted)", "/SYSV00000000 (deleted)", ""] {
            assert!(!is_device(path), "{path}");
        }
        for path in ["/dev/dri/card0", "/dev/nvidia0", "/dev/mem"] {
            assert!(is_device(path), "{path}");
        }
    }
}
