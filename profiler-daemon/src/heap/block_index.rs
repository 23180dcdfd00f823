//! Which tracked block an address falls in, asked of every aligned word of every root and block
//! the marking reads: it must cost a few instructions, not a search of all the blocks. Blocks
//! lying less than `JOIN` apart form a span; within a span, a table per 4 KiB page holds the
//! first block that can hold an address of that page, so a lookup is a range check, a search
//! among the few spans, and one among the blocks of a single page.

use crate::kernel::live::LiveBlock;

const PAGE: u64 = 4096;

/// Blocks closer than this share a span: a gap costs 4 bytes per page of the table.
const JOIN: u64 = 64 * 1024;

/// Pages of table a span may have per block in it: a block's size is what its allocator said,
/// and a process's own allocator may say 2^46 bytes, a table of 64 GiB. A span beyond it is
/// searched block by block.
const PAGES_PER_BLOCK: u64 = 64;

#[derive(Debug)]
struct Span {
    /// Page-aligned bounds.
    start: u64,
    end: u64,
    /// Per page, then one more: the index of the first block that ends after the page starts.
    /// Empty when the span has more pages than `PAGES_PER_BLOCK` for each block.
    first: Vec<u32>,
    /// Its blocks.
    blocks: std::ops::Range<usize>,
}

#[derive(Debug)]
pub struct BlockIndex {
    spans: Vec<Span>,
}

/// Where a block's addresses end: a zero-sized block is pointed to at its start.
fn end(block: &LiveBlock) -> u64 {
    block.addr.saturating_add(block.size.max(1))
}

impl BlockIndex {
    /// `blocks` are sorted by address and apart.
    pub fn new(blocks: &[LiveBlock]) -> Self {
        let mut spans = Vec::new();
        let mut at = 0;
        while at < blocks.len() {
            let start = blocks[at].addr / PAGE * PAGE;
            let mut stop = at + 1;
            let mut last_end = end(&blocks[at]);
            while stop < blocks.len() && blocks[stop].addr < last_end.saturating_add(JOIN) {
                last_end = last_end.max(end(&blocks[stop]));
                stop += 1;
            }
            let end_page = last_end.checked_next_multiple_of(PAGE).unwrap_or(u64::MAX);
            let pages = (end_page - start) / PAGE;
            let mut first = Vec::new();
            if pages <= (stop - at) as u64 * PAGES_PER_BLOCK {
                first.reserve(pages as usize + 1);
                let mut block = at;
                for page in 0..=pages {
                    let page_start = start + page * PAGE;
                    while block < stop && end(&blocks[block]) <= page_start {
                        block += 1;
                    }
                    first.push(block as u32);
                }
            }
            spans.push(Span { start, end: end_page, first, blocks: at..stop });
            at = stop;
        }
        Self { spans }
    }

    /// The index of the block `ptr` falls in.
    pub fn find(&self, blocks: &[LiveBlock], ptr: u64) -> Option<usize> {
        let span = self.spans.partition_point(|s| s.start <= ptr).checked_sub(1).map(|at| &self.spans[at])?;
        if ptr >= span.end {
            return None;
        }
        let page = ((ptr - span.start) / PAGE) as usize;
        // The blocks that may hold `ptr`: from the first ending after its page starts, to the
        // first ending after the next page starts (which may begin before `ptr`); or, without a
        // table, the span's.
        let (from, to) = match span.first.get(page..=page + 1) {
            Some(&[from, next]) => (from as usize, (next as usize + 1).min(blocks.len())),
            _ => (span.blocks.start, span.blocks.end),
        };
        let candidates = &blocks[from..to.max(from)];
        let at = candidates.partition_point(|b| b.addr <= ptr).checked_sub(1)?;
        let block = &candidates[at];
        (ptr < end(block)).then_some(from + at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(addr: u64, size: u64) -> LiveBlock {
        LiveBlock { addr, size, stack_id: 0, weighted_bytes: size }
    }

    #[test]
    fn finds_the_block_of_every_address_as_a_search_of_all_would() {
        // Small blocks sharing pages, one spanning pages, a zero-sized one, and blocks far apart.
        let blocks = [
            block(0x1010, 0x20),
            block(0x1030, 0x10),
            block(0x1ff0, 0x2020),
            block(0x4010, 0),
            block(0x4020, 8),
            block(0x9_0000, 0x10),
            block(0x7f00_0000_0000, 0x40),
        ];
        let index = BlockIndex::new(&blocks);
        assert_eq!(index.spans.len(), 3);
        let slow = |ptr: u64| blocks.iter().position(|b| b.addr <= ptr && ptr < end(b));
        let mut probes: Vec<u64> = (0..0x6000).chain(0x8_ff00..0x9_0100).collect();
        probes.extend([0, u64::MAX, 0x7f00_0000_0000 - 1, 0x7f00_0000_0000, 0x7f00_0000_003f, 0x7f00_0000_0040]);
        for ptr in probes {
            assert_eq!(index.find(&blocks, ptr), slow(ptr), "{ptr:#x}");
        }
        assert_eq!(BlockIndex::new(&[]).find(&[], 0x1000), None);
    }

    /// Sizes a process's own allocator made up: spans of 2^46 bytes, and one to the end of the
    /// address space, are searched without a table of their pages.
    #[test]
    fn blocks_of_any_size_are_found_without_a_table_of_their_pages() {
        let blocks = [block(0x1000, 0x10), block(0x1010, 1 << 46), block(0x7f00_0000_0000, u64::MAX - 0x40)];
        let index = BlockIndex::new(&blocks);
        assert!(index.spans.iter().all(|span| span.first.is_empty()), "{:?}", index.spans.len());
        let slow = |ptr: u64| blocks.iter().position(|b| b.addr <= ptr && ptr < end(b));
        for ptr in
            [0, 0xfff, 0x1000, 0x100f, 0x1010, 0x1010 + (1 << 46) - 1, 0x1010 + (1 << 46), 0x7f00_0000_0000, u64::MAX]
        {
            assert_eq!(index.find(&blocks, ptr), slow(ptr), "{ptr:#x}");
        }
    }
}
