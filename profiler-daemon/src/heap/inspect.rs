//! `--inspect`: which of a live process's blocks are still reachable, as valgrind's memcheck
//! would say, without a restart. The process is held still (`process::freeze`) while its roots
//! (every thread's registers and stack, every writable mapping that holds no heap block: data,
//! bss, TLS) are scanned and the blocks the kernel tracks (`LIVE`) marked from them
//! (`reachability`); then it runs on.

use std::{collections::HashMap, time::Instant};

use aya::Ebpf;
use serde::{Deserialize, Serialize};

use crate::{
    heap::{
        reachability::{Class, Marker, Memory},
        types::{self, TypeCount},
    },
    kernel::live::{self, LiveBlock},
    process::{
        freeze::Frozen,
        procfs::{self, Region},
        vtables,
    },
};

/// x86-64's red zone: a leaf function keeps data up to 128 bytes below the stack pointer, and
/// memcheck counts it addressable.
const RED_ZONE: u64 = 128;

/// Roots are read this many bytes at a time.
const ROOT_CHUNK: u64 = 1 << 20;

/// Bytes and blocks per class, for one stack or all (JSON `"reachability"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reachability {
    pub definitely_lost_bytes: u64,
    pub definitely_lost_blocks: u64,
    pub indirectly_lost_bytes: u64,
    pub indirectly_lost_blocks: u64,
    pub possibly_lost_bytes: u64,
    pub possibly_lost_blocks: u64,
    pub reachable_bytes: u64,
    pub reachable_blocks: u64,
    /// What freeing the definitely lost blocks would free: theirs and the blocks only they reach.
    pub retained_bytes: u64,
}

impl Reachability {
    fn count(&mut self, class: Class, size: u64, retained: u64) {
        let (bytes, blocks) = match class {
            Class::Reachable => (&mut self.reachable_bytes, &mut self.reachable_blocks),
            Class::PossiblyLost => (&mut self.possibly_lost_bytes, &mut self.possibly_lost_blocks),
            Class::DefinitelyLost => (&mut self.definitely_lost_bytes, &mut self.definitely_lost_blocks),
            Class::IndirectlyLost => (&mut self.indirectly_lost_bytes, &mut self.indirectly_lost_blocks),
        };
        *bytes += size;
        *blocks += 1;
        self.retained_bytes += retained;
    }

    pub fn add(&mut self, other: &Reachability) {
        self.definitely_lost_bytes += other.definitely_lost_bytes;
        self.definitely_lost_blocks += other.definitely_lost_blocks;
        self.indirectly_lost_bytes += other.indirectly_lost_bytes;
        self.indirectly_lost_blocks += other.indirectly_lost_blocks;
        self.possibly_lost_bytes += other.possibly_lost_bytes;
        self.possibly_lost_blocks += other.possibly_lost_blocks;
        self.reachable_bytes += other.reachable_bytes;
        self.reachable_blocks += other.reachable_blocks;
        self.retained_bytes += other.retained_bytes;
    }
}

/// One inspection of a process (JSON `"inspection"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Inspection {
    /// How long the process was held still.
    pub pause_ms: f64,
    pub threads: usize,
    /// Bytes of roots (stacks, writable mappings) and of blocks read.
    pub root_bytes_scanned: u64,
    pub block_bytes_scanned: u64,
    /// Bytes of roots or blocks that could not be read (device mappings, pages unmapped).
    pub bytes_unreadable: u64,
    /// Bytes of the heap's mappings (`[heap]` and those that hold a tracked block) outside the
    /// tracked blocks: the allocator's own data, freed memory and blocks memprof did not see
    /// made (before it attached, or not sampled). Not classified.
    pub heap_bytes_not_classified: u64,
    /// Whether those bytes were scanned as roots: yes unless memprof saw every allocation of the
    /// process (`memprof run`, unsampled), since an unseen block may point to seen ones.
    pub unclassified_heap_scanned: bool,
    /// Every tracked block, by class.
    pub totals: Reachability,
    /// Every tracked C++ object, by type (see `types`).
    #[serde(default)]
    pub types: Vec<TypeCount>,
    /// Per kernel stack id: the report gives each of its stacks its share.
    #[serde(skip)]
    pub per_stack: HashMap<u64, Reachability>,
    #[serde(skip)]
    pub per_stack_types: HashMap<u64, Vec<TypeCount>>,
}

/// What an inspection needs to know of the process beyond its memory.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The process's allocator is glibc's malloc (see `reachability::is_chunk_header`).
    pub glibc: bool,
    /// memprof has seen every allocation the process made (see `unclassified_heap_scanned`).
    pub complete: bool,
}

/// Stops `pid`, classifies its tracked blocks and lets it run on.
pub fn inspect(ebpf: &Ebpf, pid: u32, settings: Settings) -> anyhow::Result<Inspection> {
    let started = Instant::now();
    let frozen = Frozen::stop(pid)?;
    let stopped = started.elapsed();
    let blocks = live::blocks(ebpf, pid)?;
    let listed = started.elapsed();
    let regions = procfs::regions(pid)?;
    let mut inspection = Inspection {
        threads: frozen.threads.len(),
        unclassified_heap_scanned: !settings.complete,
        ..Inspection::default()
    };
    let mut marker = Marker::new(&blocks, settings.glibc);
    let (heap, roots): (Vec<&Region>, Vec<&Region>) = regions
        .iter()
        .filter(|r| r.writable && !r.path.starts_with("/dev/") && !r.path.starts_with("[v"))
        .partition(|r| r.path == "[heap]" || holds_block(&blocks, r));
    for region in roots {
        // A stack is scanned from its thread's stack pointer (and red zone): below is garbage.
        let below =
            frozen.threads.iter().map(|t| t.stack_pointer()).filter(|sp| (region.start..region.end).contains(sp));
        let start = below.min().map_or(region.start, |sp| sp.saturating_sub(RED_ZONE).max(region.start));
        scan_range(&frozen, &mut marker, start, region.end, &mut inspection);
    }
    for region in &heap {
        for (start, end) in gaps(&blocks, region) {
            inspection.heap_bytes_not_classified += end - start;
            if !settings.complete {
                scan_range(&frozen, &mut marker, start, end, &mut inspection);
            }
        }
    }
    for thread in &frozen.threads {
        marker.scan_registers(&thread.registers);
    }
    let mut memory = HeapCopy { frozen: &frozen, regions: heap.iter().map(|r| (r.start, r.end, None)).collect() };
    let marking = marker.finish(&mut memory);
    let first_words = types::first_words(&mut memory, &blocks);
    drop(memory);
    drop(frozen);
    inspection.pause_ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::debug!(pid, ?stopped, ?listed, pause_ms = inspection.pause_ms, blocks = blocks.len(), "inspected");
    inspection.block_bytes_scanned = marking.block_bytes_scanned;
    inspection.bytes_unreadable += marking.block_bytes_unreadable;
    for ((block, class), retained) in blocks.iter().zip(&marking.classes).zip(&marking.retained) {
        inspection.totals.count(*class, block.size, *retained);
        inspection.per_stack.entry(block.stack_id).or_default().count(*class, block.size, *retained);
    }
    // After the release: reading the process's files takes no part in the pause.
    let names = vtables::types(pid, &first_words);
    (inspection.types, inspection.per_stack_types) = types::tally(&blocks, &first_words, &names);
    Ok(inspection)
}

fn holds_block(blocks: &[LiveBlock], region: &Region) -> bool {
    let at = blocks.partition_point(|b| b.addr < region.start);
    blocks.get(at).is_some_and(|b| b.addr < region.end)
}

/// The parts of `region` outside the blocks.
fn gaps(blocks: &[LiveBlock], region: &Region) -> Vec<(u64, u64)> {
    let mut gaps = Vec::new();
    let mut at = region.start;
    let first = blocks.partition_point(|b| b.addr < region.start);
    for block in blocks[first..].iter().take_while(|b| b.addr < region.end) {
        if block.addr > at {
            gaps.push((at, block.addr));
        }
        at = at.max((block.addr + block.size).min(region.end));
    }
    if at < region.end {
        gaps.push((at, region.end));
    }
    gaps
}

fn scan_range(frozen: &Frozen, marker: &mut Marker, start: u64, end: u64, inspection: &mut Inspection) {
    let mut buf = vec![0u8; ROOT_CHUNK as usize];
    let mut at = start;
    while at < end {
        let len = (end - at).min(ROOT_CHUNK) as usize;
        let read = frozen.read(at, &mut buf[..len]);
        marker.scan_root(at, &buf[..read]);
        inspection.root_bytes_scanned += read as u64;
        inspection.bytes_unreadable += (len - read) as u64;
        at += len as u64;
    }
}

/// The heap's mappings, each read whole the first time a block in it is scanned: one large
/// read per mapping rather than one per block.
struct HeapCopy<'a> {
    frozen: &'a Frozen,
    regions: Vec<(u64, u64, Option<Vec<u8>>)>,
}

impl Memory for HeapCopy<'_> {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        let Some(at) = self.regions.partition_point(|r| r.0 <= addr).checked_sub(1) else { return 0 };
        let (start, end, copy) = &mut self.regions[at];
        if addr >= *end {
            return 0;
        }
        let copy = copy.get_or_insert_with(|| {
            let mut bytes = vec![0u8; (*end - *start) as usize];
            let read = self.frozen.read(*start, &mut bytes);
            bytes.truncate(read);
            bytes
        });
        let from = (addr - *start) as usize;
        let n = copy.len().saturating_sub(from).min(buf.len());
        buf[..n].copy_from_slice(&copy[from..from + n]);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_are_the_region_outside_its_blocks() {
        let region = Region { start: 0x1000, end: 0x2000, writable: true, path: "[heap]".into() };
        let block = |addr, size| LiveBlock { addr, size, stack_id: 0 };
        let blocks = [block(0x800, 0x10), block(0x1010, 0x20), block(0x1030, 0x10), block(0x1f00, 0x200)];
        assert_eq!(gaps(&blocks, &region), [(0x1000, 0x1010), (0x1040, 0x1f00)]);
        assert!(holds_block(&blocks, &region));
        assert_eq!(gaps(&[], &region), [(0x1000, 0x2000)]);
    }
}
