//! Pages the heap's live blocks pin: resident pages that hold live blocks but few live bytes
//! (fragmentation), and the stacks whose blocks are on them.
//!
//! A page is *pinned* when it is resident (present in `/proc/PID/pagemap`), holds at least one
//! live block's byte and has less than a quarter of its bytes live: the allocator cannot give it
//! back while those blocks live, and most of it is free memory. A page filled by one block is
//! never pinned, so only the first and last page of each block are looked at.

use std::collections::HashMap;

use crate::{
    kernel::live::LiveBlock,
    process::{pagemap, procfs},
};

/// A page with less than `1 / SPARSE` of its bytes live is pinned.
const SPARSE: u64 = 4;

/// What one stack's blocks pin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StackPinned {
    /// Pinned pages its blocks are on: a page shared by two stacks counts for each.
    pub pages: u64,
    /// Its share of those pages' bytes, in proportion to its live bytes on each page: the
    /// stacks' shares add up to the process's `bytes` (to rounding down).
    pub bytes: u64,
}

impl StackPinned {
    pub fn add(&mut self, other: StackPinned) {
        self.pages += other.pages;
        self.bytes += other.bytes;
    }
}

/// One reading of a process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pinned {
    pub pages: u64,
    /// `pages` times the page size.
    pub bytes: u64,
    /// Per kernel stack id (`LiveBlock::stack_id`).
    pub per_stack: HashMap<u64, StackPinned>,
}

impl Pinned {
    /// What the blocks of kernel stack `stack_id` pin.
    pub fn of(&self, stack_id: u64) -> StackPinned {
        self.per_stack.get(&stack_id).copied().unwrap_or_default()
    }
}

/// The pages `blocks` (of process `pid`) pin now; none once the process has exited.
pub fn read(pid: u32, blocks: &[LiveBlock]) -> Option<Pinned> {
    // An exited process's pagemap reads empty, and with no page to ask about that goes unseen.
    if procfs::stat(pid).is_none_or(|stat| stat.zombie) {
        return None;
    }
    // SAFETY: sysconf has no preconditions.
    let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pinned(blocks, page_size, |pages| pagemap::present_pages(pid, pages))
}

/// One block's bytes on one page.
#[derive(Debug, Clone, Copy)]
struct Share {
    page: u64,
    stack_id: u64,
    bytes: u64,
}

/// The pages `blocks` pin, given which of a list of pages (ascending) are `resident`.
fn pinned(blocks: &[LiveBlock], page_size: u64, resident: impl FnOnce(&[u64]) -> Option<Vec<bool>>) -> Option<Pinned> {
    let mut shares = Vec::new();
    for block in blocks.iter().filter(|b| b.size > 0) {
        let end = block.addr.saturating_add(block.size);
        let (first, last) = (block.addr / page_size, (end - 1) / page_size);
        for page in [first, last].into_iter().take(1 + usize::from(first != last)) {
            let bytes = end.min((page + 1) * page_size) - block.addr.max(page * page_size);
            if bytes < page_size {
                shares.push(Share { page, stack_id: block.stack_id, bytes });
            }
        }
    }
    // Blocks come sorted by address, so pages nearly are (a block's last page may pass the next
    // block's first): the sort has little to do.
    shares.sort_unstable_by_key(|s| s.page);
    let sparse: Vec<&[Share]> = shares
        .chunk_by(|a, b| a.page == b.page)
        .filter(|on_page| on_page.iter().map(|s| s.bytes).sum::<u64>() * SPARSE < page_size)
        .collect();
    let pages: Vec<u64> = sparse.iter().map(|on_page| on_page[0].page).collect();
    let present = resident(&pages)?;
    let mut pinned = Pinned::default();
    for (on_page, _) in sparse.iter().zip(present).filter(|(_, present)| *present) {
        pinned.pages += 1;
        pinned.bytes += page_size;
        let live: u64 = on_page.iter().map(|s| s.bytes).sum();
        let mut by_stack: Vec<(u64, u64)> = Vec::with_capacity(on_page.len());
        for share in *on_page {
            match by_stack.iter_mut().find(|(id, _)| *id == share.stack_id) {
                Some((_, bytes)) => *bytes += share.bytes,
                None => by_stack.push((share.stack_id, share.bytes)),
            }
        }
        for (stack_id, bytes) in by_stack {
            pinned
                .per_stack
                .entry(stack_id)
                .or_default()
                .add(StackPinned { pages: 1, bytes: page_size * bytes / live });
        }
    }
    Some(pinned)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    fn block(addr: u64, size: u64, stack_id: u64) -> LiveBlock {
        LiveBlock { addr, size, stack_id, weighted_bytes: size }
    }

    fn all_resident(pages: &[u64]) -> Option<Vec<bool>> {
        Some(vec![true; pages.len()])
    }

    #[test]
    fn a_page_under_a_quarter_live_is_pinned_by_the_stacks_on_it() {
        // Page 1: 256 bytes of stack 7 and 768 of stack 8 (1024: a quarter, not pinned). Page 2:
        // 256 of stack 7 and 512 of stack 8 (pinned, shared 1:2).
        let blocks =
            [block(PAGE, 256, 7), block(PAGE + 1024, 768, 8), block(2 * PAGE, 256, 7), block(2 * PAGE + 2048, 512, 8)];
        let pinned = pinned(&blocks, PAGE, all_resident).unwrap();
        assert_eq!((pinned.pages, pinned.bytes), (1, PAGE));
        assert_eq!(pinned.of(7), StackPinned { pages: 1, bytes: PAGE / 3 });
        assert_eq!(pinned.of(8), StackPinned { pages: 1, bytes: PAGE * 2 / 3 });
        assert_eq!(pinned.of(9), StackPinned::default());
    }

    #[test]
    fn a_block_across_pages_counts_on_each_and_filled_pages_are_not_pinned() {
        // 100 bytes at the end of page 3, page 4 whole, 100 bytes at the start of page 5.
        let blocks = [block(4 * PAGE - 100, PAGE + 200, 1)];
        let pinned = pinned(&blocks, PAGE, all_resident).unwrap();
        assert_eq!(pinned.pages, 2);
        assert_eq!(pinned.of(1), StackPinned { pages: 2, bytes: 2 * PAGE });
    }

    #[test]
    fn pages_not_resident_are_not_pinned_and_an_exited_process_gives_none() {
        let blocks = [block(PAGE, 16, 1), block(3 * PAGE, 16, 1)];
        let asked = std::cell::RefCell::new(Vec::new());
        let pinned = pinned(&blocks, PAGE, |pages| {
            asked.borrow_mut().extend_from_slice(pages);
            Some(vec![false, true])
        })
        .unwrap();
        assert_eq!(*asked.borrow(), [1, 3]);
        assert_eq!(pinned.of(1), StackPinned { pages: 1, bytes: PAGE });
        assert_eq!(super::pinned(&blocks, PAGE, |_| None), None);
    }
}
