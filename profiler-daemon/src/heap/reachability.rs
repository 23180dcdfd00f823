//! Conservative marking of live blocks from a process's roots, as valgrind's memcheck does it
//! (`mc_leakcheck.c`), so that each block gets memcheck's class:
//!
//! - every aligned 8-byte word of the roots that points into a block marks it: a pointer to its
//!   start makes it *reachable*, one into its interior only *possibly lost*, unless one of the
//!   heuristics in use takes it for a pointer to the start (`heuristics`); marked blocks are
//!   scanned in turn, a reachable block's start pointers making reachable, a possibly lost
//!   block's pointers only possibly lost;
//! - the blocks left are lost. Taken in address order, each still unreached block leads a clique:
//!   what it reaches (by any pointer, start or interior) and nothing else reached is *indirectly
//!   lost*, and a block led a clique before is absorbed with its clique. The leaders left are
//!   *definitely lost*; each retains its own bytes and its clique's.

use crate::{
    heap::{
        block_index::BlockIndex,
        heuristics::{self, Heuristic, Heuristics, Words},
    },
    kernel::live::LiveBlock,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Reachable,
    PossiblyLost,
    DefinitelyLost,
    IndirectlyLost,
}

/// Reads the target's memory: how many of `buf.len()` bytes at `addr` could be read.
pub trait Memory: Words {
    fn read(&self, addr: u64, buf: &mut [u8]) -> usize;

    /// The first address from `addr` on that `read` may give bytes of; None when none does.
    /// What lies between reads as zeros, which point nowhere: the marking skips it.
    fn readable_from(&self, addr: u64) -> Option<u64> {
        Some(addr)
    }
}

/// Each block's class, in the blocks' order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marking {
    pub classes: Vec<Class>,
    /// A definitely lost block's bytes with its clique's; 0 for the others.
    pub retained: Vec<u64>,
    /// The heuristic that took a pointer into a block's interior for one to its start, as
    /// memcheck keeps it: set by the last interior pointer met before the block was reachable,
    /// cleared by a pointer to its start met after.
    pub heuristics: Vec<Option<Heuristic>>,
    /// Bytes of blocks read (roots are counted by the caller).
    pub block_bytes_scanned: u64,
    /// Bytes of blocks that could not be read (unmapped meanwhile): scanned as zeros.
    pub block_bytes_unreadable: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Unreached,
    Possible,
    Reachable,
    Indirect,
}

/// The marking in progress.
pub struct Marker<'a, M> {
    /// Sorted by address, not overlapping.
    blocks: &'a [LiveBlock],
    memory: &'a M,
    index: BlockIndex,
    /// glibc's arenas point at chunk headers: see `is_chunk_header`.
    glibc: bool,
    /// The headers of the chunks glibc's walk found in its bins (`untracked::Layout::binned`): a
    /// pointer at one is a link glibc left (a block carved from a binned chunk keeps its links).
    binned: &'a [u64],
    heuristics: Heuristics,
    heuristic: Vec<Option<Heuristic>>,
    /// The lowest and highest address in a block.
    low: u64,
    high: u64,
    state: Vec<State>,
    /// Per clique leader, the bytes of its clique (memcheck's `indirect_szB`).
    indirect: Vec<u64>,
    pending: Vec<usize>,
    buf: Vec<u8>,
    scanned: u64,
    unreadable: u64,
}

/// Blocks are read this many bytes at a time.
const READ_CHUNK: usize = 1 << 20;

impl<'a, M: Memory> Marker<'a, M> {
    pub fn new(blocks: &'a [LiveBlock], memory: &'a M, glibc: bool, heuristics: Heuristics) -> Self {
        debug_assert!(blocks.windows(2).all(|w| w[0].addr <= w[1].addr));
        Self {
            blocks,
            memory,
            index: BlockIndex::new(blocks),
            glibc,
            binned: &[],
            heuristics,
            heuristic: vec![None; blocks.len()],
            low: blocks.first().map_or(u64::MAX, |b| b.addr),
            high: blocks.iter().map(|b| b.addr.saturating_add(b.size).saturating_sub(1).max(b.addr)).max().unwrap_or(0),
            state: vec![State::Unreached; blocks.len()],
            indirect: vec![0; blocks.len()],
            pending: Vec::new(),
            buf: Vec::new(),
            scanned: 0,
            unreadable: 0,
        }
    }

    /// The block `ptr` points into, if any; read from memory `from`.
    fn find(&self, ptr: u64, from: Owner) -> Option<usize> {
        // Most words are no pointer into the heap (zeros, small numbers, text): out at once.
        if !(self.low..=self.high).contains(&ptr) {
            return None;
        }
        let at = self.index.find(self.blocks, ptr)?;
        let allocators = self.glibc
            && is_chunk_header(&self.blocks[at], ptr)
            && (from == Owner::Allocator || self.binned.binary_search(&ptr).is_ok());
        (!allocators).then_some(at)
    }

    /// Takes the headers of the chunks in glibc's bins (`untracked::Layout::binned`), sorted.
    pub fn with_binned_chunks(mut self, binned: &'a [u64]) -> Self {
        self.binned = binned;
        self
    }

    /// Marks from one root word, or from a word of a block whose own mark is `definite`.
    fn mark(&mut self, ptr: u64, definite: bool, from: Owner) {
        let Some(at) = self.find(ptr, from) else { return };
        let start = ptr == self.blocks[at].addr;
        if self.state[at] == State::Reachable {
            if start {
                self.heuristic[at] = None;
            }
            return;
        }
        let as_start = start || {
            if !self.heuristics.is_empty() {
                self.heuristic[at] = heuristics::accepting(self.heuristics, &self.blocks[at], ptr, self.memory);
            }
            self.heuristic[at].is_some()
        };
        if as_start && definite {
            self.state[at] = State::Reachable;
            self.pending.push(at);
        } else if self.state[at] == State::Unreached {
            self.state[at] = State::Possible;
            self.pending.push(at);
        }
    }

    /// Marks from roots: the words of a memory range (`start` the address of `bytes[0]`) that
    /// `owner` keeps, or a thread's registers (which may be glibc's, a thread stopped in
    /// malloc). The blocks marked are scanned by `finish` (the marks' fixpoint does not depend on
    /// the order).
    pub fn scan_root(&mut self, start: u64, bytes: &[u8], owner: Owner) {
        for ptr in words(start, bytes) {
            self.mark(ptr, true, owner);
        }
    }

    pub fn scan_registers(&mut self, registers: &[u64]) {
        for &ptr in registers {
            self.mark(ptr, true, Owner::Allocator);
        }
    }

    /// Scans the marked blocks until none is left; in clique `leader` when given.
    fn drain(&mut self, leader: Option<usize>) {
        while let Some(at) = self.pending.pop() {
            let block = self.blocks[at];
            let definite = self.state[at] == State::Reachable;
            let mut offset = 0;
            while offset < block.size {
                // A block's size is what its allocator returned with it: a process's own
                // allocator may say 2^62 bytes. Only what was copied is read, a chunk at a time;
                // the rest is skipped, as unreadable.
                let Some(addr) = block.addr.checked_add(offset).filter(|&addr| addr < u64::MAX) else {
                    self.unreadable = self.unreadable.saturating_add(block.size - offset);
                    break;
                };
                let readable = self.memory.readable_from(addr).unwrap_or(u64::MAX);
                if readable > addr {
                    let skipped = (readable - addr).min(block.size - offset);
                    self.unreadable = self.unreadable.saturating_add(skipped);
                    offset += skipped;
                    continue;
                }
                let len = (block.size - offset).min(READ_CHUNK as u64) as usize;
                let mut buf = std::mem::take(&mut self.buf);
                buf.resize(len, 0);
                let read = self.memory.read(addr, &mut buf);
                buf[read..].fill(0);
                self.scanned += read as u64;
                self.unreadable = self.unreadable.saturating_add((len - read) as u64);
                for ptr in words(addr, &buf) {
                    match leader {
                        None => self.mark(ptr, definite, Owner::Program),
                        Some(leader) => self.join_clique(ptr, leader, Owner::Program),
                    }
                }
                self.buf = buf;
                offset += len as u64;
            }
        }
    }

    fn join_clique(&mut self, ptr: u64, leader: usize, from: Owner) {
        let Some(at) = self.find(ptr, from) else { return };
        if at != leader && self.state[at] == State::Unreached {
            self.state[at] = State::Indirect;
            self.indirect[leader] += self.blocks[at].size + std::mem::take(&mut self.indirect[at]);
            self.pending.push(at);
        }
    }

    /// Forms the cliques of the blocks left and returns every block's class.
    pub fn finish(mut self) -> Marking {
        self.drain(None);
        for leader in 0..self.blocks.len() {
            if self.state[leader] == State::Unreached {
                self.pending.push(leader);
                self.drain(Some(leader));
            }
        }
        let classes: Vec<Class> = self
            .state
            .iter()
            .map(|state| match state {
                State::Reachable => Class::Reachable,
                State::Possible => Class::PossiblyLost,
                State::Unreached => Class::DefinitelyLost,
                State::Indirect => Class::IndirectlyLost,
            })
            .collect();
        let retained = classes
            .iter()
            .zip(self.blocks.iter().zip(&self.indirect))
            .map(|(class, (block, indirect))| if *class == Class::DefinitelyLost { block.size + indirect } else { 0 })
            .collect();
        Marking {
            classes,
            retained,
            heuristics: self.heuristic,
            block_bytes_scanned: self.scanned,
            block_bytes_unreadable: self.unreadable,
        }
    }
}

/// The aligned 8-byte words of `bytes`, which start at address `start`.
fn words(start: u64, bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    let skip = (start.wrapping_neg() % 8) as usize;
    bytes.get(skip..).unwrap_or_default().chunks_exact(8).map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
}

/// Whose memory a root is, for `is_chunk_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The program's: its data, its stacks, its blocks.
    Program,
    /// Where glibc's malloc keeps its own pointers: its arenas (in the C library's data, at a
    /// thread arena's start).
    Allocator,
}

/// glibc keeps a chunk's size 8 bytes before its data and lends the last 8 bytes of a chunk in
/// use to the next chunk's header; its arenas (free lists, the top chunk) point at chunk
/// headers. A block whose size is not a multiple of 16 so holds the address of the next
/// chunk's header 16 bytes before its chunk ends: such a pointer, in the allocator's memory, is
/// the allocator's (a bin's, the top's, or one a free chunk held). In the program's, it is the
/// program's: a structure whose last word a list links is pointed to there.
fn is_chunk_header(block: &LiveBlock, ptr: u64) -> bool {
    // malloc's chunk size: the request and the size field, rounded up to 16, at least 32.
    let chunk = (block.size.saturating_add(8 + 15) & !15).max(32);
    !block.size.is_multiple_of(16) && ptr == block.addr.wrapping_add(chunk - 16)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Memory as a map of 8-byte words (0 where none is given), without vtables.
    #[derive(Default)]
    pub(crate) struct Map(pub(crate) BTreeMap<u64, u64>);

    impl Words for Map {
        fn word(&self, addr: u64) -> Option<u64> {
            Some(self.0.get(&addr).copied().unwrap_or(0))
        }
        fn is_vtable(&self, _: u64) -> bool {
            false
        }
    }

    impl Memory for Map {
        fn read(&self, addr: u64, buf: &mut [u8]) -> usize {
            for (i, chunk) in buf.chunks_mut(8).enumerate() {
                let word = self.0.get(&(addr + 8 * i as u64)).copied().unwrap_or(0);
                chunk.copy_from_slice(&word.to_ne_bytes()[..chunk.len()]);
            }
            buf.len()
        }
    }

    fn block(addr: u64, size: u64) -> LiveBlock {
        LiveBlock { addr, size, stack_id: addr, weighted_bytes: size }
    }

    fn classify(blocks: &[LiveBlock], memory: &Map, roots: &[u64]) -> Marking {
        classify_with(blocks, memory, roots, Heuristics::NONE)
    }

    fn classify_with(blocks: &[LiveBlock], memory: &Map, roots: &[u64], heuristics: Heuristics) -> Marking {
        let mut marker = Marker::new(blocks, memory, false, heuristics);
        let bytes: Vec<u8> = roots.iter().flat_map(|w| w.to_ne_bytes()).collect();
        marker.scan_root(0x10, &bytes, Owner::Program);
        marker.finish()
    }

    use Class::*;

    /// `Map`'s words between `copied`'s bounds alone, as a copy of some of a process's memory.
    struct Copied {
        map: Map,
        copied: std::ops::Range<u64>,
    }

    impl Words for Copied {
        fn word(&self, addr: u64) -> Option<u64> {
            self.copied.contains(&addr).then(|| self.map.word(addr)).flatten()
        }
        fn is_vtable(&self, _: u64) -> bool {
            false
        }
    }

    impl Memory for Copied {
        fn read(&self, addr: u64, buf: &mut [u8]) -> usize {
            let len = self.copied.end.saturating_sub(addr).min(buf.len() as u64) as usize;
            if !self.copied.contains(&addr) {
                return 0;
            }
            self.map.read(addr, &mut buf[..len])
        }
        fn readable_from(&self, addr: u64) -> Option<u64> {
            (addr < self.copied.end).then(|| addr.max(self.copied.start))
        }
    }

    /// A block of 2^62 bytes, as a process's own allocator may say it made: its copied part is
    /// scanned, the rest counted unreadable, at once (it was read a MiB at a time, for ever).
    #[test]
    fn a_block_larger_than_the_copy_is_scanned_where_copied() {
        let blocks = [block(0x1000, 32), block(0x2000, 1 << 62)];
        let memory = Copied { map: Map([(0x2008, 0x1000)].into()), copied: 0x2000..0x3000 };
        let mut marker = Marker::new(&blocks, &memory, true, Heuristics::NONE);
        marker.scan_registers(&[0x2000]);
        let marking = marker.finish();
        assert_eq!(marking.classes, [Reachable, Reachable]);
        // The small block is outside the copy too.
        assert_eq!(marking.block_bytes_unreadable, (1 << 62) - 0x1000 + 32);
    }

    #[test]
    fn a_list_whose_head_is_lost_is_lost_through_its_head() {
        // Head at 0x3000, nodes at 0x1000 -> 0x2000: the nodes are led first, then absorbed.
        let blocks = [block(0x1000, 32), block(0x2000, 32), block(0x3000, 64)];
        let memory = Map([(0x1000, 0x2000), (0x3000, 0x1000)].into());
        let marking = classify(&blocks, &memory, &[]);
        assert_eq!(marking.classes, [IndirectlyLost, IndirectlyLost, DefinitelyLost]);
        assert_eq!(marking.retained, [0, 0, 128]);
    }

    #[test]
    fn a_cycle_nobody_points_to_is_led_by_its_lowest_block() {
        let blocks = [block(0x1000, 48), block(0x2000, 48)];
        let memory = Map([(0x1000, 0x2000), (0x2000, 0x1000)].into());
        let marking = classify(&blocks, &memory, &[]);
        assert_eq!(marking.classes, [DefinitelyLost, IndirectlyLost]);
        assert_eq!(marking.retained, [96, 0]);
    }

    #[test]
    fn interior_pointers_make_possibly_lost_and_what_they_reach_too() {
        // Root -> interior of A; A -> start of B; root -> start of C; C -> start of B upgrades B.
        let blocks = [block(0x1000, 64), block(0x2000, 16), block(0x3000, 16), block(0x4000, 16)];
        let memory = Map([(0x1000, 0x2000), (0x3000, 0x4000)].into());
        let marking = classify(&blocks, &memory, &[0x1028]);
        assert_eq!(marking.classes, [PossiblyLost, PossiblyLost, DefinitelyLost, IndirectlyLost]);
        let marking = classify(&blocks, &memory, &[0x1028, 0x3000]);
        assert_eq!(marking.classes, [PossiblyLost, PossiblyLost, Reachable, Reachable]);
    }

    #[test]
    fn one_past_the_end_is_no_pointer_but_a_zero_sized_blocks_start_is() {
        let blocks = [block(0x1000, 16), block(0x1010, 0)];
        let marking = classify(&blocks, &Map::default(), &[0x1010]);
        assert_eq!(marking.classes, [DefinitelyLost, Reachable]);
    }

    #[test]
    fn glibcs_pointer_to_the_next_chunk_header_is_not_the_programs() {
        // malloc(24): a 32-byte chunk whose last 8 bytes are the next chunk's header.
        let blocks = [block(0x1010, 24)];
        let memory = Map::default();
        let mut marker = Marker::new(&blocks, &memory, true, Heuristics::NONE);
        marker.scan_registers(&[0x1020]);
        assert_eq!(marker.finish().classes, [DefinitelyLost]);
        let mut marker = Marker::new(&blocks, &memory, true, Heuristics::NONE);
        marker.scan_registers(&[0x1018]);
        assert_eq!(marker.finish().classes, [PossiblyLost]);
        // The same address kept by the program (a list linking the structure's last word).
        let in_data = 0x1020u64.to_ne_bytes();
        let mut marker = Marker::new(&blocks, &memory, true, Heuristics::NONE);
        marker.scan_root(0x500, &in_data, Owner::Program);
        assert_eq!(marker.finish().classes, [PossiblyLost]);
        let mut marker = Marker::new(&blocks, &memory, true, Heuristics::NONE);
        marker.scan_root(0x500, &in_data, Owner::Allocator);
        assert_eq!(marker.finish().classes, [DefinitelyLost]);
        // From a reachable block: the program's, unless the chunk there is in a bin (a link
        // glibc left in a block it carved from a binned chunk).
        let held = [block(0x1010, 24), block(0x2000, 64)];
        for (binned, class) in [(vec![], PossiblyLost), (vec![0x1020], DefinitelyLost)] {
            let mut memory = Map::default();
            memory.0.insert(0x2008, 0x1020);
            let mut marker = Marker::new(&held, &memory, true, Heuristics::NONE).with_binned_chunks(&binned);
            marker.scan_registers(&[0x2000]);
            assert_eq!(marker.finish().classes, [class, Reachable], "binned {binned:x?}");
        }
    }

    #[test]
    fn unaligned_words_are_not_pointers() {
        let blocks = [block(0x1000, 16)];
        let memory = Map::default();
        let mut marker = Marker::new(&blocks, &memory, false, Heuristics::NONE);
        let mut bytes = vec![0u8; 20];
        bytes[4..12].copy_from_slice(&0x1000u64.to_ne_bytes());
        marker.scan_root(0x100, &bytes, Owner::Program);
        assert_eq!(marker.finish().classes, [DefinitelyLost]);
    }

    #[test]
    fn a_pointer_a_heuristic_takes_is_one_to_the_start() {
        // new T[3] of 16-byte T at 0x1000 (count first), held only past its count; from it a
        // pointer to the start of 0x2000.
        let blocks = [block(0x1000, 56), block(0x2000, 16)];
        let memory = Map([(0x1000, 3), (0x1010, 0x2000)].into());
        let marking = classify_with(&blocks, &memory, &[0x1008], Heuristics::ALL);
        assert_eq!(marking.classes, [Reachable, Reachable]);
        assert_eq!(marking.heuristics, [Some(Heuristic::NewArray), None]);
        let marking = classify_with(&blocks, &memory, &[0x1008], Heuristics::NONE);
        assert_eq!(marking.classes, [PossiblyLost, PossiblyLost]);
        assert_eq!(marking.heuristics, [None, None]);
        // A pointer to the start met as well clears the heuristic, as in memcheck.
        let marking = classify_with(&blocks, &memory, &[0x1008, 0x1000], Heuristics::ALL);
        assert_eq!(marking.heuristics, [None, None]);
        // Lost blocks' cliques take interior pointers whatever the heuristics.
        let marking = classify_with(&blocks, &Map([(0x2000, 0x1008)].into()), &[], Heuristics::ALL);
        assert_eq!(marking.classes, [IndirectlyLost, DefinitelyLost]);
    }
}
