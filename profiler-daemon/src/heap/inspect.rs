//! `--inspect`: which of a live process's blocks are still reachable, as valgrind's memcheck
//! would say, without a restart. The process is held still only while its tracked blocks are
//! listed and its memory copied (`capture`); its roots (every thread's registers and stack,
//! every writable mapping that holds no heap block: data, bss, TLS) are then scanned and the
//! blocks marked from them (`reachability`) on the copy, the process running on. The blocks in
//! use that memprof did not see made are counted apart (`untracked`): nothing can class them.

use std::{collections::HashMap, time::Instant};

use aya::Ebpf;
use serde::{Deserialize, Serialize};

use crate::{
    heap::{
        capture::{self, Capture, Method, Precopy, Stages},
        heuristics::{Heuristic, Heuristics, Words},
        reachability::{Class, Marker, Memory, Owner},
        types::{self, TypeCount},
        untracked,
    },
    kernel::live::LiveBlock,
    process::{
        image::Image,
        memory,
        procfs::Region,
        vtables::{self, Lookalike},
    },
};

/// x86-64's red zone: a leaf function keeps data up to 128 bytes below the stack pointer, and
/// memcheck counts it addressable.
const RED_ZONE: u64 = 128;

/// What marking a block takes, at most: its entry among those marked and the marking's state
/// for it. The blocks memprof did not see made are marked only while they fit in half the
/// memory memprof may still take (a heap of small blocks holds millions).
const MARKED_BLOCK_BYTES: u64 = 64;

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
    /// Of these blocks, those held only through a pointer into their interior that a heuristic
    /// took for one to their start (memcheck's "reachable via heuristic").
    #[serde(default, skip_serializing_if = "ViaHeuristic::is_empty")]
    pub reachable_via_heuristic: ViaHeuristic,
}

/// Bytes and blocks per heuristic (JSON `"reachable_via_heuristic"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViaHeuristic {
    pub stdstring_bytes: u64,
    pub stdstring_blocks: u64,
    pub length64_bytes: u64,
    pub length64_blocks: u64,
    pub newarray_bytes: u64,
    pub newarray_blocks: u64,
    pub multipleinheritance_bytes: u64,
    pub multipleinheritance_blocks: u64,
}

impl ViaHeuristic {
    fn is_empty(&self) -> bool {
        *self == ViaHeuristic::default()
    }

    /// Each heuristic's bytes and blocks, in memcheck's order.
    pub fn each(&self) -> [(Heuristic, u64, u64); 4] {
        [
            (Heuristic::StdString, self.stdstring_bytes, self.stdstring_blocks),
            (Heuristic::Length64, self.length64_bytes, self.length64_blocks),
            (Heuristic::NewArray, self.newarray_bytes, self.newarray_blocks),
            (Heuristic::MultipleInheritance, self.multipleinheritance_bytes, self.multipleinheritance_blocks),
        ]
    }

    fn count(&mut self, heuristic: Heuristic, bytes: u64, blocks: u64) {
        let (b, n) = match heuristic {
            Heuristic::StdString => (&mut self.stdstring_bytes, &mut self.stdstring_blocks),
            Heuristic::Length64 => (&mut self.length64_bytes, &mut self.length64_blocks),
            Heuristic::NewArray => (&mut self.newarray_bytes, &mut self.newarray_blocks),
            Heuristic::MultipleInheritance => {
                (&mut self.multipleinheritance_bytes, &mut self.multipleinheritance_blocks)
            }
        };
        *b += bytes;
        *n += blocks;
    }

    fn add(&mut self, other: &ViaHeuristic) {
        for (heuristic, bytes, blocks) in other.each() {
            self.count(heuristic, bytes, blocks);
        }
    }
}

/// What one classified block adds: itself, or for a block recorded by sampling, the blocks and
/// bytes it stands for, as the report's in-use figures count it. What it retains is scaled alike.
#[derive(Debug, Clone, Copy)]
struct Counted {
    bytes: u64,
    blocks: u64,
    retained: u64,
}

impl Counted {
    /// The block as itself.
    fn itself(block: &LiveBlock, retained: u64) -> Self {
        Self { bytes: block.size, blocks: 1, retained }
    }

    fn of(block: &LiveBlock, retained: u64) -> Self {
        if block.weighted_bytes == block.size || block.size == 0 {
            return Self::itself(block, retained);
        }
        let scale = block.weighted_bytes as f64 / block.size as f64;
        Self { bytes: block.weighted_bytes, blocks: scale.round() as u64, retained: (retained as f64 * scale) as u64 }
    }
}

impl Reachability {
    fn count(&mut self, class: Class, counted: Counted, heuristic: Option<Heuristic>) {
        // memcheck counts a block's heuristic whatever its class came to be.
        if let Some(heuristic) = heuristic {
            self.reachable_via_heuristic.count(heuristic, counted.bytes, counted.blocks);
        }
        let (bytes, blocks) = match class {
            Class::Reachable => (&mut self.reachable_bytes, &mut self.reachable_blocks),
            Class::PossiblyLost => (&mut self.possibly_lost_bytes, &mut self.possibly_lost_blocks),
            Class::DefinitelyLost => (&mut self.definitely_lost_bytes, &mut self.definitely_lost_blocks),
            Class::IndirectlyLost => (&mut self.indirectly_lost_bytes, &mut self.indirectly_lost_blocks),
        };
        *bytes += counted.bytes;
        *blocks += counted.blocks;
        self.retained_bytes += counted.retained;
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
        self.reachable_via_heuristic.add(&other.reachable_via_heuristic);
    }

    /// Takes `other`'s blocks out of these classes (a suppressed stack's, out of the totals).
    pub fn remove(&mut self, other: &Reachability) {
        for (mine, theirs) in [
            (&mut self.definitely_lost_bytes, other.definitely_lost_bytes),
            (&mut self.definitely_lost_blocks, other.definitely_lost_blocks),
            (&mut self.indirectly_lost_bytes, other.indirectly_lost_bytes),
            (&mut self.indirectly_lost_blocks, other.indirectly_lost_blocks),
            (&mut self.possibly_lost_bytes, other.possibly_lost_bytes),
            (&mut self.possibly_lost_blocks, other.possibly_lost_blocks),
            (&mut self.reachable_bytes, other.reachable_bytes),
            (&mut self.reachable_blocks, other.reachable_blocks),
            (&mut self.retained_bytes, other.retained_bytes),
        ] {
            *mine = mine.saturating_sub(theirs);
        }
    }
}

/// One inspection of a process (JSON `"inspection"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Inspection {
    /// How long the process was held still.
    pub pause_ms: f64,
    /// How its memory was copied, whether `LIVE` was read in the stop, the bytes read while it
    /// was held still, and each stage's time (see `capture`).
    #[serde(default)]
    pub method: Method,
    #[serde(default)]
    pub live_read_in_pause: bool,
    #[serde(default)]
    pub live_changes_in_pause: usize,
    #[serde(default)]
    pub bytes_copied_in_pause: u64,
    #[serde(default)]
    pub stages: Stages,
    pub threads: usize,
    /// Bytes of roots (stacks, writable mappings) and of blocks read: pages of a root never
    /// written hold zeros, and are neither scanned nor counted.
    pub root_bytes_scanned: u64,
    pub block_bytes_scanned: u64,
    /// Bytes of roots or blocks that could not be read (device mappings, pages unmapped).
    pub bytes_unreadable: u64,
    /// Bytes of the heap's mappings (`[heap]` and those that hold a block) outside the tracked
    /// blocks and those `untracked_classes` classes: the allocator's own data, freed memory and,
    /// where glibc's chunks could not be walked, blocks memprof did not see made (before it
    /// attached, or not sampled). Not classified.
    pub heap_bytes_not_classified: u64,
    /// Whether those bytes were scanned as roots, but for the free chunks glibc's walk found:
    /// yes unless memprof saw every allocation of the process (`memprof run`, unsampled), since
    /// an unseen block may point to seen ones.
    pub unclassified_heap_scanned: bool,
    /// The blocks in use among those bytes, by glibc's chunk headers: made before memprof
    /// attached (or not sampled), not classified. None when the allocator is not glibc's.
    #[serde(default)]
    pub untracked_blocks: Option<u64>,
    #[serde(default)]
    pub untracked_bytes: Option<u64>,
    /// Those of the main heap and the threads' arenas, marked as blocks and classed together
    /// (a block lost before the attach is in no stack's figures); None when memprof saw every
    /// block made, or the allocator is not glibc's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub untracked_classes: Option<Reachability>,
    /// Why those blocks were not classed, when memprof had no room to mark them: they were
    /// scanned as roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub untracked_not_classed: Option<String>,
    /// The heuristics in use, as memcheck's `--leak-check-heuristics` takes them.
    #[serde(default)]
    pub heuristics: String,
    /// Every tracked block, by class. A sampled block counts the blocks it stands for, but where
    /// `untracked_classes` classes the blocks memprof did not record (those among them): there
    /// each counts as itself, and the two add up to the heap.
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
    /// When to copy its memory before the stop.
    pub precopy: Precopy,
    /// memcheck's heuristics to use.
    pub heuristics: Heuristics,
}

/// Stops `pid`, copies what it needs, lets it run on and classifies its tracked blocks.
pub fn inspect(ebpf: &Ebpf, pid: u32, settings: Settings) -> anyhow::Result<Inspection> {
    let Capture {
        blocks,
        regions,
        image,
        threads,
        method,
        live_read_in_pause,
        live_changes_in_pause,
        pause_ms,
        bytes_copied_in_pause,
        mut stages,
    } = capture::capture(ebpf, pid, settings.precopy)?;
    let marking_started = Instant::now();
    let mut inspection = Inspection {
        pause_ms,
        method,
        live_read_in_pause,
        live_changes_in_pause,
        bytes_copied_in_pause,
        threads: threads.len(),
        bytes_unreadable: image.unreadable,
        unclassified_heap_scanned: !settings.complete,
        heuristics: settings.heuristics.to_string(),
        ..Inspection::default()
    };
    let target = Target { image: &image, vtables: Lookalike::new(pid) };
    // On glibc, the blocks memprof did not see made are marked as blocks, as memcheck marks
    // every block, and free memory is no root: a stale pointer there, or in a block lost before
    // the attach, keeps no block reachable. Elsewhere, or where the walk of the heap stops, what
    // is outside the tracked blocks is scanned as roots, since an unseen block may point to a
    // seen one.
    let room = memory::room();
    // Nothing is unseen where memprof saw every block made.
    let max_unseen = if settings.complete { 0 } else { (room.bytes / 2 / MARKED_BLOCK_BYTES) as usize };
    let layout =
        if settings.glibc { untracked::layout(&target, &regions, &blocks, max_unseen) } else { Default::default() };
    let (unseen, free) = if settings.complete { (Vec::new(), Vec::new()) } else { (layout.unseen, layout.free) };
    let binned = layout.binned;
    if layout.unseen_over_budget && !settings.complete {
        let needed = layout.unseen_found.saturating_mul(MARKED_BLOCK_BYTES);
        inspection.untracked_not_classed = Some(format!(
            "marking them would take about {} MiB, more than half of the {room}; scanned as roots",
            needed >> 20
        ));
    }
    let any_unseen = !unseen.is_empty();
    let all = merged(&blocks, unseen);
    let mut marker = Marker::new(&all, &target, settings.glibc, settings.heuristics).with_binned_chunks(&binned);
    let (heap, roots): (Vec<&Region>, Vec<&Region>) =
        regions.iter().partition(|r| r.path == "[heap]" || holds_block(&all, r));
    for region in roots {
        // A stack is scanned from its thread's stack pointer (and red zone): below is garbage.
        let below = threads.iter().map(|(_, sp)| *sp).filter(|sp| (region.start..region.end).contains(sp));
        let start = below.min().map_or(region.start, |sp| sp.saturating_sub(RED_ZONE).max(region.start));
        let glibcs = settings.glibc && (is_c_library(region) || untracked::starts_arena(&target, region));
        let owner = if glibcs { Owner::Allocator } else { Owner::Program };
        for (start, end) in outside(&free, start, region.end) {
            scan_range(&image, &mut marker, (start, end), owner, &mut inspection);
        }
    }
    for region in &heap {
        // Outside the blocks marked: chunks' size fields, and, where glibc's walk was not
        // trusted or its blocks not marked, the program's blocks: the program's memory, but for
        // a thread arena's header (its bins, its top chunk).
        let header = settings.glibc && untracked::starts_arena(&target, region);
        let header_end = if header { region.start + untracked::ARENA_HEADER_MAX } else { region.start };
        for (start, end) in gaps(&all, region) {
            inspection.heap_bytes_not_classified += end - start;
            if !settings.complete {
                for (start, end) in outside(&free, start, end) {
                    let split = header_end.clamp(start, end);
                    for (part, owner) in [((start, split), Owner::Allocator), ((split, end), Owner::Program)] {
                        if part.0 < part.1 {
                            scan_range(&image, &mut marker, part, owner, &mut inspection);
                        }
                    }
                }
            }
        }
    }
    for (registers, _) in &threads {
        marker.scan_registers(registers);
    }
    let marking = marker.finish();
    if settings.glibc {
        (inspection.untracked_blocks, inspection.untracked_bytes) =
            (Some(layout.untracked.blocks), Some(layout.untracked.bytes));
    }
    let first_words = types::first_words(&target, &blocks);
    stages.mark_ms = marking_started.elapsed().as_secs_f64() * 1e3;
    inspection.stages = stages;
    tracing::debug!(pid, ?stages, "marked");
    inspection.block_bytes_scanned = marking.block_bytes_scanned;
    inspection.bytes_unreadable += marking.block_bytes_unreadable;
    if any_unseen {
        inspection.untracked_classes = Some(Reachability::default());
    }
    for (at, block) in all.iter().enumerate() {
        let (class, retained, heuristic) = (marking.classes[at], marking.retained[at], marking.heuristics[at]);
        let counted = Counted::of(block, retained);
        if block.stack_id == untracked::UNSEEN {
            if let Some(classes) = &mut inspection.untracked_classes {
                classes.count(class, counted, heuristic);
            }
            continue;
        }
        // Where the blocks memprof did not record are classed, they include those a sampled
        // block stands for: the totals count each block as itself, so that with those classes
        // they add up to the heap. A stack's figures stay estimates, as its in-use figures.
        let in_totals = if any_unseen { Counted::itself(block, retained) } else { counted };
        inspection.totals.count(class, in_totals, heuristic);
        inspection.per_stack.entry(block.stack_id).or_default().count(class, counted, heuristic);
    }
    // After the release: reading the process's files takes no part in the pause.
    let names = vtables::types(pid, &first_words);
    (inspection.types, inspection.per_stack_types) = types::tally(&blocks, &first_words, &names);
    Ok(inspection)
}

/// The tracked `blocks` and the `unseen` ones, by address, in the memory of `unseen`: there may
/// be millions of them.
fn merged(blocks: &[LiveBlock], unseen: Vec<LiveBlock>) -> Vec<LiveBlock> {
    let mut all = unseen;
    all.reserve_exact(blocks.len());
    all.extend_from_slice(blocks);
    all.sort_unstable_by_key(|block| block.addr);
    all
}

/// The parts of `start..end` outside the ranges `free` (sorted, apart).
fn outside(free: &[(u64, u64)], start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
    let first = free.partition_point(|&(_, free_end)| free_end <= start);
    uncovered(free[first..].iter().copied(), start, end)
}

/// The C library's own data, where glibc's main arena is (a thread arena's is at its start,
/// `untracked::starts_arena`).
fn is_c_library(region: &Region) -> bool {
    let name = region.path.rsplit('/').next().unwrap_or_default();
    name.starts_with("libc.so") || name.starts_with("libc-2.")
}

fn holds_block(blocks: &[LiveBlock], region: &Region) -> bool {
    let at = blocks.partition_point(|b| b.addr < region.start);
    blocks.get(at).is_some_and(|b| b.addr < region.end)
}

/// The parts of `region` outside the blocks.
fn gaps<'a>(blocks: &'a [LiveBlock], region: &Region) -> impl Iterator<Item = (u64, u64)> + 'a {
    let first = blocks.partition_point(|b| b.addr < region.start);
    let ranges = blocks[first..].iter().map(|b| (b.addr, b.addr.saturating_add(b.size)));
    uncovered(ranges, region.start, region.end)
}

/// The parts of `start..end` that none of `ranges` (sorted by start) covers, one by one: a
/// heap of small blocks has millions.
fn uncovered(ranges: impl Iterator<Item = (u64, u64)>, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> {
    let mut ranges = ranges.take_while(move |&(range_start, _)| range_start < end);
    let (mut at, mut done) = (start, false);
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        for (range_start, range_end) in ranges.by_ref() {
            let part = (range_start > at).then_some((at, range_start));
            at = at.max(range_end);
            if part.is_some() {
                return part;
            }
        }
        done = true;
        (at < end).then_some((at, end))
    })
}

/// Scans the copy of `start..end`: only where it may hold other than zeros, which point nowhere
/// (a heap reserved ahead is gigabytes of pages never touched).
fn scan_range(
    image: &Image,
    marker: &mut Marker<Target>,
    (start, end): (u64, u64),
    owner: Owner,
    inspection: &mut Inspection,
) {
    let len = image.from(start).len().min((end - start) as usize);
    for (addr, bytes) in image.data_from(start, len) {
        marker.scan_root(addr, bytes, owner);
        inspection.root_bytes_scanned += bytes.len() as u64;
    }
}

/// The process as the marking reads it: its blocks' bytes from the copy, vtables from the
/// process itself.
struct Target<'a> {
    image: &'a Image,
    vtables: Lookalike,
}

impl Words for Target<'_> {
    fn word(&self, addr: u64) -> Option<u64> {
        let bytes = self.image.from(addr).get(..8)?;
        Some(u64::from_ne_bytes(bytes.try_into().expect("8 bytes")))
    }

    fn is_vtable(&self, addr: u64) -> bool {
        self.vtables.is_vtable(addr)
    }
}

impl Memory for Target<'_> {
    fn read(&self, addr: u64, buf: &mut [u8]) -> usize {
        let copy = self.image.from(addr);
        let n = copy.len().min(buf.len());
        buf[..n].copy_from_slice(&copy[..n]);
        n
    }

    fn readable_from(&self, addr: u64) -> Option<u64> {
        self.image.copied_from(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_are_the_region_outside_its_blocks() {
        let region = Region { start: 0x1000, end: 0x2000, writable: true, shared: false, path: "[heap]".into() };
        let block = |addr, size| LiveBlock { addr, size, stack_id: 0, weighted_bytes: size };
        let blocks = [block(0x800, 0x10), block(0x1010, 0x20), block(0x1030, 0x10), block(0x1f00, 0x200)];
        assert_eq!(gaps(&blocks, &region).collect::<Vec<_>>(), [(0x1000, 0x1010), (0x1040, 0x1f00)]);
        assert!(holds_block(&blocks, &region));
        assert_eq!(gaps(&[], &region).collect::<Vec<_>>(), [(0x1000, 0x2000)]);
    }

    #[test]
    fn outside_is_what_no_free_range_covers() {
        let free = [(0x800, 0x1010), (0x1020, 0x1030), (0x1030, 0x1040), (0x1f00, 0x2100)];
        assert_eq!(outside(&free, 0x1000, 0x2000).collect::<Vec<_>>(), [(0x1010, 0x1020), (0x1040, 0x1f00)]);
        assert_eq!(outside(&free, 0x1040, 0x1f00).collect::<Vec<_>>(), [(0x1040, 0x1f00)]);
        assert_eq!(outside(&[], 0x1000, 0x2000).collect::<Vec<_>>(), [(0x1000, 0x2000)]);
    }
}
