//! A traced process's stack ids and times, as frames and seconds.

use std::collections::BTreeSet;

use aya::Ebpf;
use profiler_common::{DoubleFreeEvent, FreeSite, StackEnd, NO_STACK};

use super::{seconds, DoubleFreeReport, SiteReport};
use crate::{
    heap::{
        known_stacks::{KnownStacks, Symbolized},
        wrappers::Wrappers,
    },
    kernel::aggregate::{self, StackTable},
    symbolize::{Frame, Frames, Module, Resolved, SymbolizerHandle},
    unwind::Registry,
};

/// The stacks a request to the symbolizer carries at most (see `Stacks::symbolize_stored_all`).
const STACKS_PER_REQUEST: usize = 256;

/// Turns a traced process's stack ids and times into frames and seconds.
pub struct Stacks<'a> {
    pub ebpf: &'a Ebpf,
    /// For the walks the kernel deferred (see `unwind::Registry::completion`).
    pub unwind: &'a Registry,
    pub symbolizer: &'a SymbolizerHandle,
    pub pid: u32,
    /// CLOCK_MONOTONIC when tracing began.
    pub start_ns: u64,
    /// The process's stacks symbolized already, if kept: in earlier intervals (the daemon's), or
    /// earlier in this report (`run`'s and `attach`'s).
    pub known: Option<&'a KnownStacks>,
    /// Folded into the allocator at each stack's leaf end.
    pub wrappers: &'a Wrappers,
}

impl Stacks<'_> {
    pub(super) fn seconds_since_start(&self, time_ns: u64) -> f64 {
        seconds(time_ns.saturating_sub(self.start_ns))
    }

    /// Symbolizes a stored stack and hashes it, its wrappers folded (the hash is the whole
    /// walk's); an allocation stack known already is not read again.
    pub(super) fn symbolize(&self, table: StackTable, stack_id: u64) -> Symbolized {
        let whole = match self.known {
            Some(known) if table == StackTable::Allocations => {
                known.get_or(stack_id, || self.symbolize_stored(table, stack_id))
            }
            _ => self.symbolize_stored(table, stack_id),
        };
        let (frames, via) = self.wrappers.fold(whole.frames);
        Symbolized { frames, via, ..whole }
    }

    /// Symbolizes those of the allocation stacks `stack_ids` not known yet, in requests of
    /// `STACKS_PER_REQUEST` stacks (see `SymbolizerHandle::symbolize`).
    pub(super) fn symbolize_all(&self, stack_ids: impl IntoIterator<Item = u64>) {
        let Some(known) = self.known else { return };
        known.fill(stack_ids, |missing| self.symbolize_stored_all(StackTable::Allocations, missing));
    }

    fn symbolize_stored(&self, table: StackTable, stack_id: u64) -> Symbolized {
        self.symbolize_stored_all(table, &[stack_id]).pop().expect("one stack asked, one named")
    }

    /// `stack_ids` read and symbolized a few hundred at a time: a request's addresses, and its
    /// answer's frame by frame, are held at once (a module path and names for each address), and
    /// for a process's tens of thousands of stacks they would take tens of megabytes.
    fn symbolize_stored_all(&self, table: StackTable, stack_ids: &[u64]) -> Vec<Symbolized> {
        let mut symbolized = Vec::with_capacity(stack_ids.len());
        for ids in stack_ids.chunks(STACKS_PER_REQUEST) {
            let (walks, truncated): (Vec<Vec<u64>>, Vec<bool>) = (ids.iter())
                .map(|&id| {
                    let (addresses, end) = aggregate::stack_frames(self.ebpf, self.unwind, self.pid, table, id);
                    (addresses, end != StackEnd::Complete)
                })
                .unzip();
            let resolved = self.symbolizer.symbolize(self.pid, walks);
            symbolized
                .extend(resolved.into_iter().zip(truncated).map(|(resolved, truncated)| named(resolved, truncated)));
        }
        symbolized
    }

    fn symbolize_frames(&self, addresses: Vec<u64>, truncated: bool) -> Symbolized {
        let resolved = self.symbolizer.symbolize(self.pid, vec![addresses]).pop().unwrap_or_default();
        named(resolved, truncated)
    }

    fn site_report(&self, table: StackTable, stack_id: u64, tid: u32, time_ns: u64) -> SiteReport {
        let stack = self.symbolize(table, stack_id);
        SiteReport {
            tid,
            time_s: self.seconds_since_start(time_ns),
            truncated: stack.truncated,
            caller_only: false,
            via: stack.via,
            frames: stack.frames,
        }
    }

    /// A free's stack, or only its caller where the stack was not walked (marked truncated).
    fn free_site(&self, site: &FreeSite) -> SiteReport {
        if site.stack_id != NO_STACK || site.caller == 0 {
            return self.site_report(StackTable::Frees, site.stack_id, site.tid, site.time_ns);
        }
        let frames = self.symbolize_frames(vec![site.caller], true).frames;
        SiteReport {
            tid: site.tid,
            time_s: self.seconds_since_start(site.time_ns),
            truncated: true,
            caller_only: true,
            via: Vec::new(),
            frames,
        }
    }

    /// The code mappings that hold `frames`.
    pub(super) fn modules<'f>(&self, frames: impl Iterator<Item = &'f Frame>) -> Vec<Module> {
        // Borrowed while deduplicated: a report has a module name per frame, its modules are few,
        // and a stack's frames come in runs of one module (a set's insert per frame was a
        // quarter of a daemon's time at rest with 65,536 deep stacks).
        let mut paths: BTreeSet<&str> = BTreeSet::new();
        let mut last = None;
        for module in frames.map(|f| f.module.as_str()) {
            if last != Some(module) {
                paths.insert(module);
                last = Some(module);
            }
        }
        let paths = paths.into_iter().map(str::to_string).collect();
        let ask = |paths| self.symbolizer.modules(self.pid, paths);
        match self.known {
            Some(known) => known.modules_or(paths, ask),
            None => ask(paths),
        }
    }

    /// Symbolizes a double free when it arrives: its free stacks may be replaced later.
    pub fn double_free(&self, event: &DoubleFreeEvent) -> DoubleFreeReport {
        DoubleFreeReport {
            address: format!("{:#x}", event.addr),
            size: event.first.alloc.size,
            alloc: self.site_report(
                StackTable::Allocations,
                event.first.alloc.stack_id,
                event.first.alloc.tid,
                event.first.alloc.time_ns,
            ),
            first_free: self.free_site(&event.first.free),
            second_free: self.free_site(&event.second),
        }
    }
}

/// A walk's frames as resolved, hashed.
fn named(mut resolved: Vec<Resolved>, truncated: bool) -> Symbolized {
    if resolved.is_empty() {
        return Symbolized { frames: Frames::default(), via: Vec::new(), id: "none".to_string(), truncated };
    }
    // A walk that reached memory holding no code went wrong there: the stack ends before it, so
    // that one site's walks, each wrong at another stack address, are one stack. Not before its
    // first address, which the probe read from the call itself.
    let truncated = match resolved.iter().skip(1).position(Resolved::is_not_code).map(|at| at + 1) {
        Some(at) => {
            resolved.truncate(at);
            true
        }
        None => truncated,
    };
    let id = stack_hash(&resolved);
    Symbolized { frames: resolved.into_iter().flat_map(|r| r.frames).collect(), via: Vec::new(), id, truncated }
}

/// FNV-1a over the frames' (module, file offset), as 16 hex digits.
fn stack_hash(resolved: &[Resolved]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for r in resolved {
        for byte in r.module.bytes().chain(r.file_offset.to_le_bytes()) {
            hash = (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_ids_depend_on_file_offsets_not_addresses() {
        let at = |module: &str, file_offset| Resolved { module: module.into(), file_offset, frames: vec![] };
        assert_eq!(stack_hash(&[at("/a", 1)]), stack_hash(&[at("/a", 1)]));
        assert_ne!(stack_hash(&[at("/a", 1)]), stack_hash(&[at("/a", 2)]));
        assert_eq!(stack_hash(&[at("/a", 1)]).len(), 16);
    }
}
