//! The blocks in use that memprof did not see made (`--inspect`): those made before it attached
//! (or not sampled) are in the heap but in no table of memprof's, so nothing can class them.
//! glibc's malloc tells them from free memory in its chunk headers: a chunk's size is the word
//! 8 bytes before its data, with bit 0 of the next chunk's size set while it is in use. Free
//! chunks kept in the thread caches (tcache) and fast bins still read as in use; each has a
//! mark, the tcache's key at its data's second word and, in a fast bin, a first word that is
//! the next free chunk's header (or none) encoded with the chunk's own address (glibc's safe
//! linking).
//!
//! Chunks are walked where glibc lays them out from a known first chunk: the main heap
//! (`[heap]`, from its start), a thread's arena (from the arena's first chunk, its thread
//! cache of 0x290 bytes) and blocks mapped one by one (`mmap`, from a mapping's start).

use std::collections::HashSet;

use crate::{heap::reachability::Memory, kernel::live::LiveBlock, process::procfs::Region};

/// Bytes and blocks in use that memprof did not see made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Untracked {
    pub blocks: u64,
    /// Their usable sizes (`malloc_usable_size`): what was asked, rounded up.
    pub bytes: u64,
}

/// The heap as the walk found it (see `layout`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layout {
    pub untracked: Untracked,
    /// The untracked blocks in use in the main heap and the threads' arenas, as blocks
    /// (`stack_id` `UNSEEN`), by address. Those mapped one by one are left out: two words mark
    /// such a block, too weak a test to class what they point at by it.
    pub unseen: Vec<LiveBlock>,
    /// The ranges, by address, that hold only free memory: free chunks, those the heap's thread
    /// cache lists (their words past the header, and the next chunk's first word, theirs while
    /// they were in use) and the top chunk. What they hold is stale: no root.
    pub free: Vec<(u64, u64)>,
    /// The chunks among them free by glibc's in-use bit, in its bins (not the top chunk, nor
    /// those the thread cache lists), by the address of their header.
    pub binned: Vec<u64>,
    /// Whether the trusted walks found more untracked blocks than `layout` was to keep: `unseen`
    /// is empty.
    pub unseen_over_budget: bool,
    /// The untracked blocks the trusted walks found, kept or not.
    pub unseen_found: u64,
}

/// The `stack_id` of a block in use that memprof did not see made (`Layout::unseen`).
pub const UNSEEN: u64 = u64::MAX;

/// The size field of a thread cache's chunk (`tcache_perthread_struct`, 0x290 bytes), in use.
const TCACHE_CHUNK: u64 = 0x291;
/// glibc's thread arenas are reserved at addresses aligned to their largest size.
const ARENA_ALIGN: u64 = 64 << 20;
/// An arena's first chunk follows its header within this many bytes.
pub const ARENA_HEADER_MAX: u64 = 4096;
/// The largest chunk a fast bin holds.
const FAST_MAX: u64 = 0x80;
const IN_USE: u64 = 1;
const MMAPPED: u64 = 2;
/// Set in every size field of a thread arena's chunks.
const NON_MAIN_ARENA: u64 = 4;

/// The untracked blocks in use in glibc's heaps among `regions` (at most `max_unseen` kept as
/// blocks), and their free ranges; `blocks` sorted by address.
///
/// A heap grown after a fork is a mapping of its own beside the one the fork copied: a heap is
/// walked across the mappings that continue it, the main heap's `[heap]` ones, an arena's within
/// its reservation. Its end is where none continues it.
pub fn layout(memory: &impl Memory, regions: &[Region], blocks: &[LiveBlock], max_unseen: usize) -> Layout {
    let mut walk = Walk { memory, blocks, max_unseen, key: None, found: Layout::default() };
    let writable: Vec<&Region> = regions.iter().filter(|r| r.writable && !r.shared).collect();
    // The end of the mappings from `at` on, laid end to end, that `continues` takes.
    let end_from = |at: usize, continues: &dyn Fn(&Region) -> bool| {
        let mut end = writable[at].end;
        for region in &writable[at + 1..] {
            if region.start != end || !continues(region) {
                break;
            }
            end = region.end;
        }
        end
    };
    // A heap's walk ends at its top chunk only where no writable mapping continues it: a chunk
    // in use that ends at a mapping's end would read as the top chunk otherwise.
    let ended = |end: u64| !writable.iter().any(|region| region.start == end);
    for (at, region) in writable.iter().enumerate() {
        if region.path == "[heap]" {
            let continued = at > 0 && writable[at - 1].path == "[heap]" && writable[at - 1].end == region.start;
            if !continued {
                let end = end_from(at, &|r| r.path == "[heap]");
                walk.heap(region.start..end, true, ended(end));
            }
        } else if region.path.is_empty() {
            match walk.arena_start(region) {
                Some(first) => {
                    let reserved = region.start + ARENA_ALIGN;
                    let end = end_from(at, &|r| r.path.is_empty() && r.end <= reserved);
                    walk.heap(first..end, false, ended(end));
                }
                None => walk.mapped(region),
            }
        }
    }
    let mut found = walk.found;
    if found.unseen_over_budget {
        found.unseen = Vec::new();
    }
    found.unseen.sort_unstable_by_key(|block| block.addr);
    found.free.sort_unstable();
    found.binned.sort_unstable();
    found
}

/// Whether `region` starts a thread arena: glibc's `heap_info` there points at the arena's
/// `malloc_state` just after it, whose bins and top chunk point at chunk headers.
pub fn starts_arena(memory: &impl Memory, region: &Region) -> bool {
    region.start.is_multiple_of(ARENA_ALIGN)
        && memory
            .word(region.start)
            .is_some_and(|arena| (region.start..region.start + ARENA_HEADER_MAX).contains(&arena))
}

struct Walk<'a, M> {
    memory: &'a M,
    blocks: &'a [LiveBlock],
    max_unseen: usize,
    /// The thread caches' key, from the first cached chunk met.
    key: Option<u64>,
    found: Layout,
}

impl<M: Memory> Walk<'_, M> {
    fn word(&self, addr: u64) -> Option<u64> {
        self.memory.word(addr)
    }

    fn tracked(&self, data: u64) -> bool {
        self.blocks.binary_search_by_key(&data, |b| b.addr).is_ok()
    }

    /// The first chunk of a thread arena at `region`'s start: its header points at the arena,
    /// and the arena's first chunk is its first thread's cache.
    fn arena_start(&self, region: &Region) -> Option<u64> {
        if !starts_arena(self.memory, region) {
            return None;
        }
        let arena = self.word(region.start)?;
        (arena..(arena + ARENA_HEADER_MAX).min(region.end))
            .step_by(8)
            .find(|&chunk| (chunk + 16).is_multiple_of(16) && self.is_tcache(chunk))
    }

    /// Walks the chunks laid end to end across `heap`, the last (the top chunk) free; `main` for
    /// the main heap, whose chunks lack `NON_MAIN_ARENA`, where an arena's in use all have it;
    /// `ended` when no writable mapping continues the heap at its end.
    ///
    /// Its untracked blocks and free ranges (`Layout`) decide what the marking scans, so they are
    /// kept only from a walk that is surely glibc's heap, surely in step: one that reached the top
    /// chunk at the heap's end, every size field with the flags glibc gives there, every tracked
    /// block of it met at a chunk's start. Any other heap is scanned as roots. And a chunk is
    /// free only by glibc's own bit, or listed in its heap's thread cache: one that only reads
    /// as cached by its marks (`cached`) is counted neither free nor a block, and scanned as a
    /// root.
    fn heap(&mut self, heap: std::ops::Range<u64>, main: bool, ended: bool) {
        let (first, end) = (heap.start, heap.end);
        let cache = self.is_tcache(first);
        if cache {
            self.learn_key(first + 16);
        }
        let listed = if cache { self.listed(first + 16, first..end) } else { HashSet::new() };
        // Kept only if the walk is trusted: they are pushed as found, to hold each once.
        let (unseen_from, free_from, binned_from) =
            (self.found.unseen.len(), self.found.free.len(), self.found.binned.len());
        // Its untracked blocks, and whether more than `max_unseen` leaves room for.
        let (mut unseen_here, mut over_budget) = (0, false);
        let mut tracked_met = 0;
        let mut chunk = first;
        let whole = loop {
            let Some(field) = self.word(chunk + 8) else { break false };
            let size = field & !7;
            // No chunk of a heap is mapped alone, and none of the main heap's is an arena's.
            let flags_right = field & MMAPPED == 0 && (!main || field & NON_MAIN_ARENA == 0);
            // A size field is the process's to write: one past the address space would wrap
            // `next` back behind `chunk`, and the walk would go round for good.
            let next = chunk.saturating_add(size);
            if !flags_right || size < 32 || !size.is_multiple_of(16) || next.saturating_add(16) > end {
                // The top chunk, free, reaches the heap's end; any other end leaves the rest
                // unknown.
                let top =
                    ended && flags_right && size >= 32 && size.is_multiple_of(16) && next <= end && end - next < 32;
                if top {
                    self.found.free.push((chunk + 8, end));
                }
                break top;
            }
            let in_use = self.word(next + 8).is_some_and(|field| field & IN_USE != 0);
            // glibc marks an arena's chunks in use as its own (free ones it need not).
            if !main && in_use && field & NON_MAIN_ARENA == 0 {
                break false;
            }
            let data = chunk + 16;
            let tracked = self.tracked(data);
            tracked_met += usize::from(tracked);
            if (chunk == first && cache) || tracked {
                // The thread cache's own chunk, or a block memprof saw made.
            } else if !in_use || listed.contains(&data) {
                self.found.free.push((chunk + 8, next + 8));
                if !in_use {
                    self.found.binned.push(chunk);
                }
            } else if !self.cached(data, size, first..end) {
                self.found.untracked.blocks += 1;
                self.found.untracked.bytes += size - 8;
                unseen_here += 1;
                if self.found.unseen.len() < self.max_unseen {
                    let block = LiveBlock { addr: data, size: size - 8, stack_id: UNSEEN, weighted_bytes: size - 8 };
                    self.found.unseen.push(block);
                } else {
                    over_budget = true;
                }
            }
            chunk = next;
        };
        let tracked_here =
            self.blocks.partition_point(|b| b.addr < end) - self.blocks.partition_point(|b| b.addr < first);
        if whole && tracked_met == tracked_here {
            self.found.unseen_over_budget |= over_budget;
            self.found.unseen_found += unseen_here;
        } else {
            self.found.unseen.truncate(unseen_from);
            self.found.free.truncate(free_from);
            self.found.binned.truncate(binned_from);
        }
    }

    /// The data of the chunks the thread cache at `cache` (its `tcache_perthread_struct`'s data)
    /// lists, in `heap`: 64 counts of 2 bytes, then the 64 lists' heads; each listed chunk's first
    /// word links the next, with glibc's safe linking (2.32 on), its second is the key. A list
    /// that leaves the heap or the key ends there.
    fn listed(&self, cache: u64, heap: std::ops::Range<u64>) -> HashSet<u64> {
        let mut listed = HashSet::new();
        let Some(key) = self.key else { return listed };
        for bin in 0..64u64 {
            let count = self.word(cache + bin / 4 * 8).map_or(0, |counts| (counts >> (bin % 4 * 16)) & 0xffff);
            let mut entry = self.word(cache + 128 + 8 * bin).unwrap_or(0);
            for _ in 0..count {
                if !entry.is_multiple_of(16) || !heap.contains(&entry) || self.word(entry + 8) != Some(key) {
                    break;
                }
                listed.insert(entry);
                entry = self.word(entry).map_or(0, |link| link ^ (entry >> 12));
            }
        }
        listed
    }

    /// Whether `chunk` is a thread cache's, in use, in the main heap or a thread arena.
    fn is_tcache(&self, chunk: u64) -> bool {
        self.word(chunk + 8).is_some_and(|field| field & !NON_MAIN_ARENA == TCACHE_CHUNK)
    }

    /// Walks blocks mapped one by one, laid end to end from `region`'s start.
    fn mapped(&mut self, region: &Region) {
        let mut chunk = region.start;
        while let (Some(0), Some(field)) = (self.word(chunk), self.word(chunk + 8)) {
            let size = field & !7;
            // Checked: a size that wraps would lead back to an earlier chunk, for ever.
            let Some(next) = chunk.checked_add(size).filter(|&next| next <= region.end) else { return };
            if field & MMAPPED == 0 || size == 0 || !size.is_multiple_of(4096) {
                return;
            }
            if !self.tracked(chunk + 16) {
                self.found.untracked.blocks += 1;
                self.found.untracked.bytes += size - 16;
            }
            chunk = next;
        }
    }

    /// The key from a thread cache (`tcache_perthread_struct` at `cache`): 64 counts of 2 bytes,
    /// then the first cached chunk's data for each size; its second word is the key.
    fn learn_key(&mut self, cache: u64) {
        if self.key.is_some() {
            return;
        }
        self.key = (0..64u64)
            .filter_map(|bin| self.word(cache + 128 + 8 * bin))
            .find(|&entry| entry != 0)
            .and_then(|entry| self.word(entry + 8))
            .filter(|&key| key != 0);
    }

    /// Whether the chunk whose data is at `data` is free, in a thread cache or a fast bin (whose
    /// chunks are in `heap`).
    fn cached(&self, data: u64, size: u64, heap: std::ops::Range<u64>) -> bool {
        if self.key.is_some() && self.word(data + 8) == self.key {
            return true;
        }
        // Safe linking: the next free chunk's header, or 0, XOR the chunk's page number.
        size <= FAST_MAX
            && self.word(data).is_some_and(|link| {
                let next = link ^ (data >> 12);
                next == 0
                    || (next.is_multiple_of(16)
                        && heap.contains(&next)
                        && self.word(next + 8).is_some_and(|f| f & !7 == size))
            })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::heap::reachability::tests::Map;

    fn region(start: u64, end: u64, path: &str) -> Region {
        Region { start, end, writable: true, shared: false, path: path.into() }
    }

    #[test]
    fn chunks_in_use_and_not_tracked_are_counted() {
        // [heap] at 0x10000: the thread cache (one cached chunk, at 0x10300), then chunks of
        // 0x30 (tracked), 0x40 (untracked), 0x30 (cached), two of 0x20 (free, in a fast bin:
        // 0x10350 then 0x10330), 0x50 (free: the next chunk's bit 0 is clear), 0x40 (untracked),
        // then the top chunk.
        let key = 0x5eed_5eed_5eed_5eed;
        let mut words = BTreeMap::new();
        let mut chunk = 0x10000;
        for (size, prev_in_use) in
            [(0x290, 1), (0x30, 1), (0x40, 1), (0x30, 1), (0x20, 1), (0x20, 1), (0x50, 1), (0x40, 0), (0x1000, 1)]
        {
            words.insert(chunk + 8, size | prev_in_use);
            chunk += size;
        }
        words.insert(0x10010, 1 << 16); // the cache's counts: one chunk of 0x30
        words.insert(0x10010 + 128 + 8, 0x10310); // the cache's bin for 0x30: the chunk's data
        words.insert(0x10318, key);
        words.insert(0x10340, 0x10340 >> 12); // the fast bin's last chunk
        words.insert(0x10360, 0x10330 ^ (0x10360 >> 12)); // its first, linked to the last
        let blocks = [LiveBlock { addr: 0x10290 + 16, size: 0x20, stack_id: 1, weighted_bytes: 0x20 }];
        let found = layout(&Map(words.clone()), &[region(0x10000, chunk, "[heap]")], &blocks, usize::MAX);
        assert_eq!(found.untracked, Untracked { blocks: 2, bytes: 0x38 + 0x38 });
        let unseen: Vec<(u64, u64)> = found.unseen.iter().map(|b| (b.addr, b.size)).collect();
        assert_eq!(unseen, [(0x102d0, 0x38), (0x103d0, 0x38)]);
        assert!(found.unseen.iter().all(|b| b.stack_id == UNSEEN));
        // Each free chunk from its size field to the next chunk's first word, the top chunk to
        // the heap's end; the cached chunk the thread cache lists, not those of the fast bin, free
        // by their marks only (scanned as roots).
        assert_eq!(found.free, [(0x10308, 0x10338), (0x10378, 0x103c8), (0x10408, chunk)]);
        assert_eq!(found.binned, [0x10370]);

        // More untracked blocks than may be marked: none kept as a block, the rest as before.
        let found = layout(&Map(words.clone()), &[region(0x10000, chunk, "[heap]")], &blocks, 1);
        assert!(found.unseen_over_budget && found.unseen.is_empty() && found.unseen_found == 2, "{found:?}");
        assert_eq!(found.untracked, Untracked { blocks: 2, bytes: 0x38 + 0x38 });
        assert_eq!(found.free.len(), 3);

        // Out of step: a tracked block that starts at no chunk's data. Counted as before, and
        // no block nor free range taken from the walk.
        let inside = [blocks[0], LiveBlock { addr: 0x102e0, size: 8, stack_id: 2, weighted_bytes: 8 }];
        let found = layout(&Map(words.clone()), &[region(0x10000, chunk, "[heap]")], &inside, usize::MAX);
        assert_eq!(found.untracked, Untracked { blocks: 2, bytes: 0x38 + 0x38 });
        assert!(found.unseen.is_empty() && found.free.is_empty(), "{found:?}");
        // Nor is its want of room said.
        let found = layout(&Map(words.clone()), &[region(0x10000, chunk, "[heap]")], &inside, 1);
        assert!(!found.unseen_over_budget && found.unseen_found == 0, "{found:?}");
        // A walk that stops short of the top chunk: the same.
        let mut short = words.clone();
        short.insert(0x103c8, 0x48 | 1);
        let found = layout(&Map(short), &[region(0x10000, chunk, "[heap]")], &blocks, usize::MAX);
        assert!(found.unseen.is_empty() && found.free.is_empty(), "{found:?}");
        // An untracked block's first word that, so decoded, is no chunk of its size: in use.
        words.insert(0x102d0, 0x10300 ^ (0x102d0 >> 12));
        let found = layout(&Map(words), &[region(0x10000, chunk, "[heap]")], &blocks, usize::MAX).untracked;
        assert_eq!(found, Untracked { blocks: 2, bytes: 0x38 + 0x38 });
    }

    /// Size fields the process wrote to lead the walk back to an earlier chunk (one past the
    /// address space wraps): in the heap, two chunks of 0x20 and -0x20, both free by their bits;
    /// mapped alone, two of 4096 and -4096. Each walk ends, and the heap's is not trusted.
    #[test]
    fn size_fields_that_wrap_end_the_walk() {
        let mut words = BTreeMap::new();
        let mut chunk = 0x10000;
        for size in [0x290, 0x50] {
            words.insert(chunk + 8, size | IN_USE);
            chunk += size;
        }
        words.insert(chunk + 8, 0x20);
        words.insert(chunk + 0x20 + 8, 0x20u64.wrapping_neg());
        let found = layout(&Map(words), &[region(0x10000, 0x11000, "[heap]")], &[], usize::MAX);
        assert!(found.unseen.is_empty() && found.free.is_empty() && found.binned.is_empty(), "{found:?}");

        let start = 0x7f00_0000_1000;
        let words = BTreeMap::from([(start + 8, 4096 | MMAPPED), (start + 4096 + 8, 4096u64.wrapping_neg() | MMAPPED)]);
        let found = layout(&Map(words), &[region(start, start + 3 * 4096, "")], &[], usize::MAX);
        assert_eq!(found.untracked, Untracked { blocks: 1, bytes: 4096 - 16 });
    }

    /// A heap grown after a fork is two mappings, a chunk in use ending where the first ends:
    /// walked across both, that chunk is a block, not the top chunk.
    #[test]
    fn a_heap_of_two_mappings_is_walked_across_both() {
        let mut words = BTreeMap::new();
        let mut chunk = 0x10000;
        for size in [0x290, 0xd70, 0x100, 0xf00] {
            words.insert(chunk + 8, size | IN_USE);
            chunk += size;
        }
        let split = [region(0x10000, 0x11000, "[heap]"), region(0x11000, chunk, "[heap]")];
        let found = layout(&Map(words.clone()), &split, &[], usize::MAX);
        let unseen: Vec<u64> = found.unseen.iter().map(|b| b.addr).collect();
        assert_eq!(unseen, [0x10290 + 16, 0x11000 + 16]);
        assert_eq!(found.free, [(0x11100 + 8, chunk)]);
        // Continued by a mapping that is not the heap's: the chunk ending at the first one's end
        // is no top chunk, and nothing of the walk is kept.
        let continued = [region(0x10000, 0x11000, "[heap]"), region(0x11000, chunk, "")];
        let found = layout(&Map(words), &continued, &[], usize::MAX);
        assert!(found.unseen.is_empty() && found.free.is_empty(), "{found:?}");
    }

    #[test]
    fn a_thread_arena_is_walked_from_its_thread_cache() {
        // At 64 MiB: the heap's header pointing at the arena 0x30 in, the thread cache at 0x8d0,
        // then a chunk of 0x50 in use, one of 0x60 free and the top chunk. As glibc sets them,
        // NON_MAIN_ARENA is on the chunks in use only; each size field's bit 0 says whether the
        // chunk before is in use.
        let start = 0x7f00_0000_0000;
        let mut words = BTreeMap::from([(start, start + 0x30)]);
        let mut chunk = start + 0x8d0;
        let cache = chunk;
        for (size, flags) in [(0x290, NON_MAIN_ARENA), (0x50, NON_MAIN_ARENA | IN_USE), (0x60, IN_USE), (0x1000, 0)] {
            words.insert(chunk + 8, size | flags | if chunk == cache { IN_USE } else { 0 });
            chunk += size;
        }
        let found = layout(&Map(words), &[region(start, chunk, "")], &[], usize::MAX);
        assert_eq!(found.untracked, Untracked { blocks: 1, bytes: 0x48 });
        let unseen: Vec<u64> = found.unseen.iter().map(|b| b.addr).collect();
        assert_eq!(unseen, [cache + 0x290 + 16]);
        let free = [(cache + 0x2e0 + 8, cache + 0x340 + 8), (cache + 0x340 + 8, chunk)];
        assert_eq!(found.free, free);
    }

    #[test]
    fn blocks_mapped_one_by_one_are_walked_from_the_mappings_start() {
        let words = BTreeMap::from([(0x7000_0008, 0x21000 | MMAPPED), (0x7002_1008, 0x3000 | MMAPPED)]);
        let blocks = [LiveBlock { addr: 0x7002_1010, size: 0x2000, stack_id: 1, weighted_bytes: 0x2000 }];
        let found = layout(&Map(words), &[region(0x7000_0000, 0x7002_4000, "")], &blocks, usize::MAX).untracked;
        assert_eq!(found, Untracked { blocks: 1, bytes: 0x21000 - 16 });
    }
}
