//! The anonymous private memory traced processes hold from `mmap`, `mremap` and `brk`, kept from
//! the calls the system calls' programs send (`mapping_programs`):
//! each process's ranges, each with the stack that asked for it, and what each stack holds; and,
//! for a process traced by its page faults (`--growth`), the pages of those ranges it touched
//! (`growth`).
//!
//! Ranges are kept here, not in the kernel: a `munmap` of part of a mapping splits it, and only
//! an ordered map finds the ranges an address range crosses.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    os::fd::AsFd as _,
};

use anyhow::Context as _;
use aya::Ebpf;
use profiler_common::{mapping_event, MappingEvent, NO_STACK};

use crate::{
    bell::EdgeBell,
    kernel::{
        ages::Clock,
        growth::{Pages, PAGE},
        mapping_programs::MappingPrograms,
    },
    ring::Ring,
};

/// What one stack of a process holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MappedStack {
    /// In `STACKS`, as an allocation's.
    pub stack_id: u64,
    /// Mapped inside a probed allocator call (see `mapping_event::IN_ALLOCATOR`).
    pub in_allocator: bool,
    pub bytes: u64,
    /// Ranges it holds: one cut in two by a `munmap` counts twice.
    pub ranges: u64,
}

/// Every traced process's ranges, as the calls received so far left them.
pub struct MappedRanges {
    programs: MappingPrograms,
    ring: Ring,
    /// Rung by the kernel when a burst of events waits (see `MAPPING_EVENTS`).
    bell: EdgeBell,
    spaces: HashMap<u32, Space>,
}

impl MappedRanges {
    /// Loads the system-call programs, attached to nothing until `wake`, and takes their ring.
    pub fn load(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let programs = MappingPrograms::load(ebpf)?;
        let map = ebpf.take_map("MAPPING_EVENTS").context("map MAPPING_EVENTS missing")?;
        let ring = Ring::new("MAPPING_EVENTS", map)?;
        let bell = EdgeBell::new(ring.as_fd()).context("waiting on the mapping events")?;
        Ok(Self { programs, ring, bell, spaces: HashMap::new() })
    }

    /// Attaches the system-call programs, if they rest.
    pub fn wake(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        self.programs.wake(ebpf)
    }

    /// Detaches the system-call programs until `wake`, once no process is traced by its pages:
    /// every process's ranges go, as the calls it makes meanwhile are not seen.
    pub fn rest(&mut self, ebpf: &mut Ebpf, clock: &Clock) {
        self.rest_programs(ebpf);
        // The events still in the ring go with the ranges, not into spaces made anew.
        self.drain(clock);
        self.spaces.clear();
    }

    /// Detaches the system-call programs until `wake`, the ranges kept: for the processes whose
    /// own probes read their calls (see `Loaded::rest_unneeded_mapping_programs`). Returns where
    /// they ran, if they were attached.
    pub fn rest_programs(&mut self, ebpf: &mut Ebpf) -> Option<&'static str> {
        let at = self.programs.runs_at()?;
        self.programs.rest(ebpf);
        Some(at)
    }

    /// Where the system-call programs run, while attached (see `MappingPrograms::runs_at`).
    pub fn programs_run_at(&self) -> Option<&'static str> {
        self.programs.runs_at()
    }

    /// Where they run once attached, attached or not.
    pub fn programs_would_run_at(&self) -> &'static str {
        self.programs.would_run_at()
    }

    /// Whether a process is traced by the pages it touches.
    pub fn watches_pages(&self) -> bool {
        self.spaces.values().any(|space| space.pages.is_some())
    }

    /// Polls readable once the kernel has rung for a burst of events.
    pub fn bell(&self) -> &EdgeBell {
        &self.bell
    }

    /// Applies the calls and page touches that arrived since the last drain, in their order.
    pub fn drain(&mut self, clock: &Clock) {
        self.ring.read_each(|event: MappingEvent| self.spaces.entry(event.tgid).or_default().apply(clock, &event));
    }

    /// Keeps the pages `tgid` touches from now on (`--growth`), in the anonymous memory it has
    /// now, `existing` (start, end) ranges, and in the memory it maps from now on.
    pub fn watch_pages(&mut self, tgid: u32, existing: &[(u64, u64)]) {
        let space = self.spaces.entry(tgid).or_default();
        space.pages = Some(Pages::default());
        for &(start, end) in existing {
            space.clear(start, end);
            space.ranges.insert(start, Range { end, stack_id: NO_STACK, in_allocator: false, before: true });
        }
    }

    /// The events of `tgid` applied so far (see `kernel::stillness`).
    pub fn events(&self, tgid: u32) -> u64 {
        self.spaces.get(&tgid).map_or(0, |space| space.events)
    }

    /// The pages `tgid` holds, when it is traced by them.
    pub fn pages(&self, tgid: u32) -> Option<&Pages> {
        self.spaces.get(&tgid).and_then(|space| space.pages.as_ref())
    }

    /// Every stack the ranges and pages of processes other than `except` refer to.
    pub fn stack_ids(&self, except: &HashSet<u32>) -> HashSet<u64> {
        let spaces = self.spaces.iter().filter(|(tgid, _)| !except.contains(tgid)).map(|(_, space)| space);
        let mut ids = HashSet::new();
        for space in spaces {
            ids.extend(space.ranges.values().map(|range| range.stack_id));
            ids.extend(space.pages.iter().flat_map(|pages| pages.stacks().map(|(id, _)| id)));
        }
        ids
    }

    /// What each stack of `tgid` holds, most bytes first.
    pub fn stacks(&self, tgid: u32) -> Vec<MappedStack> {
        let Some(space) = self.spaces.get(&tgid) else { return Vec::new() };
        let mut by_stack: HashMap<(u64, bool), MappedStack> = HashMap::new();
        for (start, range) in space.ranges.iter().filter(|(_, range)| !range.before) {
            let key = (range.stack_id, range.in_allocator);
            let stack = by_stack.entry(key).or_insert(MappedStack {
                stack_id: range.stack_id,
                in_allocator: range.in_allocator,
                ..MappedStack::default()
            });
            stack.bytes += range.end - start;
            stack.ranges += 1;
        }
        let mut stacks: Vec<MappedStack> = by_stack.into_values().collect();
        stacks.sort_by_key(|s| (std::cmp::Reverse(s.bytes), s.stack_id, s.in_allocator));
        stacks
    }

    /// `tgid` has exited or is no longer traced: the calls it made until now are applied first,
    /// so that none arrives later for a process forgotten.
    pub fn forget(&mut self, tgid: u32, clock: &Clock) {
        self.drain(clock);
        self.spaces.remove(&tgid);
    }
}

/// One process's ranges, by start.
#[derive(Debug, Default)]
struct Space {
    /// The memory the ranges are in (`MappingEvent::mm`): a new one after an exec.
    mm: u64,
    ranges: BTreeMap<u64, Range>,
    /// The program break after the process's latest `brk` seen: the first one seen (glibc's
    /// query at start, for a process traced from its exec) only sets it.
    brk: Option<u64>,
    /// `--growth`: the pages touched in the ranges.
    pages: Option<Pages>,
    /// Events applied so far: what changed the ranges and pages.
    events: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    end: u64,
    stack_id: u64,
    in_allocator: bool,
    /// Mapped before memprof traced the process: held by no stack, not in `stacks`.
    before: bool,
}

fn page_up(address: u64) -> u64 {
    address.saturating_add(PAGE - 1) & !(PAGE - 1)
}

impl Space {
    fn apply(&mut self, clock: &Clock, event: &MappingEvent) {
        self.events += 1;
        if event.mm != self.mm {
            // The first event of a process watched before it sent any: its ranges are this
            // memory's. Otherwise an exec: the old program's ranges went with its memory.
            if self.mm != 0 {
                (self.ranges, self.brk) = (BTreeMap::new(), None);
                self.pages = self.pages.take().map(|_| Pages::default());
            }
            self.mm = event.mm;
        }
        let made = Range {
            end: 0,
            stack_id: event.stack_id,
            in_allocator: event.flags & mapping_event::IN_ALLOCATOR != 0,
            before: false,
        };
        let now_ns = crate::kernel::aggregate::monotonic_now_ns();
        match event.kind {
            mapping_event::MAP => {
                let end = event.addr.saturating_add(page_up(event.len));
                self.give_back(clock, event.addr, end, now_ns);
                self.ranges.insert(event.addr, Range { end, ..made });
            }
            mapping_event::UNMAP => {
                self.give_back(clock, event.addr, event.addr.saturating_add(page_up(event.len)), now_ns)
            }
            mapping_event::REMAP => self.remap(event, made, clock, now_ns),
            mapping_event::BRK => {
                let Some(old) = self.brk.replace(event.new_addr) else { return };
                // The kernel maps the break's pages: [page_up(start), page_up(break)).
                let (old, new) = (page_up(old), page_up(event.new_addr));
                if new > old {
                    self.clear(old, new);
                    self.ranges.insert(old, Range { end: new, ..made });
                } else {
                    self.give_back(clock, new, old, now_ns);
                }
            }
            mapping_event::RELEASE => {
                if let Some(pages) = &mut self.pages {
                    pages.release(clock, event.addr, event.addr.saturating_add(page_up(event.len)), now_ns);
                }
            }
            mapping_event::FAULT => self.touch(clock, event),
            _ => {}
        }
    }

    /// A page fault: held when it is in the process's anonymous memory. A fault the kernel
    /// answered with a transparent huge page mapped all of it (`MappingEvent::len`): each of its
    /// pages is held (no other faults there follow), when the ranges cover it whole.
    fn touch(&mut self, clock: &Clock, event: &MappingEvent) {
        let in_range = self.covers(event.addr, event.addr + 1);
        let mapped = event.len.max(PAGE);
        let block = event.addr & !(mapped - 1);
        let whole = mapped > PAGE && mapped.is_power_of_two() && self.covers(block, block + mapped);
        let Some(pages) = &mut self.pages else { return };
        if !in_range {
            pages.outside += 1;
        } else if whole {
            pages.touch_all(clock, block, block + mapped, event.stack_id, event.time_ns);
        } else {
            pages.touch(clock, event.addr, event.stack_id, event.time_ns);
        }
    }

    /// Whether `[start, end)` is all in the ranges (one, or several end to end).
    fn covers(&self, start: u64, end: u64) -> bool {
        let mut reached = start;
        while reached < end {
            match self.ranges.range(..=reached).next_back() {
                Some((_, range)) if range.end > reached => reached = range.end,
                _ => return false,
            }
        }
        true
    }

    /// `[start, end)` is no longer the process's anonymous memory: its ranges and pages go.
    fn give_back(&mut self, clock: &Clock, start: u64, end: u64, now_ns: u64) {
        self.clear(start, end);
        if let Some(pages) = &mut self.pages {
            pages.release(clock, start, end, now_ns);
        }
    }

    /// `mremap`: the old range's parts move with their stacks and pages; growth belongs to the
    /// call's. A range memprof does not hold (a file's, one mapped before tracing) stays not held.
    fn remap(&mut self, event: &MappingEvent, made: Range, clock: &Clock, now_ns: u64) {
        let (old, old_len, new, new_len) = (event.addr, page_up(event.len), event.new_addr, page_up(event.new_len));
        if let Some(pages) = &mut self.pages {
            // What a shrink cuts off is given back; what was at the destination is replaced.
            pages.release(clock, old.saturating_add(new_len.min(old_len)), old.saturating_add(old_len), now_ns);
            if new != old {
                pages.release(clock, new, new.saturating_add(new_len), now_ns);
            }
            pages.moved(old, new_len.min(old_len), new);
        }
        let moved = self.clear(old, old.saturating_add(old_len));
        if event.flags & mapping_event::KEEP_OLD != 0 {
            // MREMAP_DONTUNMAP: the old range stays mapped, emptied.
            for &(start, range) in &moved {
                self.ranges.insert(start, range);
            }
        }
        let new_end = new.saturating_add(new_len);
        self.clear(new, new_end);
        if moved.is_empty() {
            return;
        }
        for (start, range) in moved {
            let (start, end) = (start - old + new, (range.end - old + new).min(new_end));
            if start < end {
                self.ranges.insert(start, Range { end, ..range });
            }
        }
        if new_len > old_len {
            self.ranges.insert(new + old_len, Range { end: new_end, ..made });
        }
    }

    /// Removes `[start, end)` from the ranges; returns the parts removed, by start.
    fn clear(&mut self, start: u64, end: u64) -> Vec<(u64, Range)> {
        let first = self.ranges.range(..start).next_back().filter(|(_, r)| r.end > start).map(|(&s, _)| s);
        let crossed: Vec<u64> = first.into_iter().chain(self.ranges.range(start..end).map(|(&s, _)| s)).collect();
        let mut removed = Vec::new();
        for at in crossed {
            let Some(range) = self.ranges.remove(&at) else { continue };
            if at < start {
                self.ranges.insert(at, Range { end: start, ..range });
            }
            if range.end > end {
                self.ranges.insert(end, range);
            }
            removed.push((at.max(start), Range { end: range.end.min(end), ..range }));
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLOCK: Clock = Clock { base_ns: 0, length_ns: 1_000_000_000 };

    fn event(kind: u32, addr: u64, len: u64, stack_id: u64) -> MappingEvent {
        MappingEvent {
            tgid: 1,
            kind,
            mm: 7,
            addr,
            len,
            new_addr: 0,
            new_len: 0,
            stack_id,
            flags: 0,
            _pad: 0,
            time_ns: 0,
        }
    }

    fn held(space: &Space) -> Vec<(u64, u64, u64)> {
        space.ranges.iter().map(|(&s, r)| (s, r.end, r.stack_id)).collect()
    }

    #[test]
    fn a_munmap_inside_a_mapping_splits_it_and_rounds_to_pages() {
        let mut space = Space::default();
        space.apply(&CLOCK, &event(mapping_event::MAP, 0x10000, 10 * PAGE - 100, 1));
        space.apply(&CLOCK, &event(mapping_event::UNMAP, 0x10000 + 2 * PAGE, 3 * PAGE, 0));
        assert_eq!(held(&space), [(0x10000, 0x12000, 1), (0x15000, 0x1a000, 1)]);
        // Across both parts and past the end.
        space.apply(&CLOCK, &event(mapping_event::UNMAP, 0x11000, 0x10000, 0));
        assert_eq!(held(&space), [(0x10000, 0x11000, 1)]);
    }

    #[test]
    fn a_fixed_mapping_replaces_what_was_there() {
        let mut space = Space::default();
        space.apply(&CLOCK, &event(mapping_event::MAP, 0x10000, 4 * PAGE, 1));
        space.apply(&CLOCK, &event(mapping_event::MAP, 0x11000, PAGE, 2));
        assert_eq!(held(&space), [(0x10000, 0x11000, 1), (0x11000, 0x12000, 2), (0x12000, 0x14000, 1)]);
    }

    #[test]
    fn mremap_moves_ranges_with_their_stacks_and_gives_growth_to_its_own() {
        let mut space = Space::default();
        space.apply(&CLOCK, &event(mapping_event::MAP, 0x10000, 2 * PAGE, 1));
        let grow =
            MappingEvent { new_addr: 0x40000, new_len: 5 * PAGE, ..event(mapping_event::REMAP, 0x10000, 2 * PAGE, 3) };
        space.apply(&CLOCK, &grow);
        assert_eq!(held(&space), [(0x40000, 0x42000, 1), (0x42000, 0x45000, 3)]);
        let shrink =
            MappingEvent { new_addr: 0x40000, new_len: PAGE, ..event(mapping_event::REMAP, 0x40000, 5 * PAGE, 4) };
        space.apply(&CLOCK, &shrink);
        assert_eq!(held(&space), [(0x40000, 0x41000, 1)]);
        // A file's mapping moved: still not held.
        let file =
            MappingEvent { new_addr: 0x90000, new_len: 8 * PAGE, ..event(mapping_event::REMAP, 0x80000, PAGE, 5) };
        space.apply(&CLOCK, &file);
        assert_eq!(held(&space), [(0x40000, 0x41000, 1)]);
    }

    #[test]
    fn brk_grows_and_shrinks_by_pages_and_an_exec_starts_afresh() {
        let mut space = Space::default();
        let brk = |new, stack| MappingEvent { new_addr: new, ..event(mapping_event::BRK, 0, 0, stack) };
        // The first only says where the break is.
        space.apply(&CLOCK, &brk(0x100010, 9));
        assert_eq!(held(&space), []);
        space.apply(&CLOCK, &brk(0x103000, 1));
        space.apply(&CLOCK, &brk(0x105800, 2));
        assert_eq!(held(&space), [(0x101000, 0x103000, 1), (0x103000, 0x106000, 2)]);
        space.apply(&CLOCK, &brk(0x102000, 3));
        assert_eq!(held(&space), [(0x101000, 0x102000, 1)]);
        space.apply(&CLOCK, &MappingEvent { mm: 8, ..event(mapping_event::MAP, 0x10000, PAGE, 4) });
        assert_eq!(held(&space), [(0x10000, 0x11000, 4)]);
    }

    #[test]
    fn pages_are_held_in_anonymous_ranges_and_go_with_them() {
        let mut space = Space { mm: 7, pages: Some(Pages::default()), ..Space::default() };
        space.apply(&CLOCK, &event(mapping_event::MAP, 0x10000, 4 * PAGE, 1));
        for page in [0x10000, 0x11000, 0x12000, 0x90000] {
            space.apply(&CLOCK, &event(mapping_event::FAULT, page, 0, 5));
        }
        let pages = |space: &Space| space.pages.as_ref().map(|p| (p.held_bytes(), p.outside));
        // The page outside any range is a file's or the stack's: not held.
        assert_eq!(pages(&space), Some((3 * PAGE, 1)));
        space.apply(&CLOCK, &event(mapping_event::RELEASE, 0x11000, PAGE, 0));
        assert_eq!(pages(&space), Some((2 * PAGE, 1)));
        // Moved, then cut short by the move: the page past the new end goes.
        let remap =
            MappingEvent { new_addr: 0x40000, new_len: 2 * PAGE, ..event(mapping_event::REMAP, 0x10000, 4 * PAGE, 3) };
        space.apply(&CLOCK, &remap);
        assert_eq!(pages(&space), Some((PAGE, 1)));
        space.apply(&CLOCK, &event(mapping_event::UNMAP, 0x40000, 2 * PAGE, 0));
        assert_eq!(pages(&space), Some((0, 1)));
    }

    /// A fault that mapped a huge page holds each of its pages, as long as the ranges hold them
    /// all; a part given back right after goes, the rest stays.
    #[test]
    fn a_huge_pages_fault_holds_the_whole_huge_page() {
        const HUGE: u64 = 2 << 20;
        let mut space = Space { mm: 7, pages: Some(Pages::default()), ..Space::default() };
        space.apply(&CLOCK, &event(mapping_event::MAP, HUGE, 2 * HUGE, 1));
        space.apply(&CLOCK, &event(mapping_event::FAULT, HUGE + 5 * PAGE, HUGE, 5));
        let held = |space: &Space| space.pages.as_ref().map(|p| p.held_bytes());
        assert_eq!(held(&space), Some(HUGE));
        space.apply(&CLOCK, &event(mapping_event::RELEASE, HUGE + HUGE / 2, HUGE / 2, 0));
        assert_eq!(held(&space), Some(HUGE / 2));
        // A huge page's span the ranges do not hold whole (a stale event): only the page.
        space.apply(&CLOCK, &event(mapping_event::UNMAP, 2 * HUGE + HUGE / 2, HUGE / 2, 0));
        space.apply(&CLOCK, &event(mapping_event::FAULT, 2 * HUGE, HUGE, 5));
        assert_eq!(held(&space), Some(HUGE / 2 + PAGE));
    }
}
