//! Reads the maps into snapshots of the traced processes: per-stack totals and ages, counters,
//! histograms, each process's drops; and purges the maps of processes that are gone.
//!
//! Every interval reads `STACK_STATS` (one row per stack), whose generation counters give the
//! ages of outstanding memory (see `ages`): the cost grows with stacks, not live allocations.
//! Double-free events arrive through a ring buffer.

use std::collections::{HashMap, HashSet};

use anyhow::Context as _;
use aya::{
    maps::{HashMap as BpfHashMap, PerCpuArray},
    Ebpf,
};
use profiler_common::{
    process_event, stack_hash_step, stack_id_of, stack_table, AddrKey, DoubleFreeEvent, DropReason, Inflight,
    LiveAlloc, Log2Histogram, ProcCounters, ProcDrops, ProcHeap, ProcessEvent, RecentFree, Stack, StackEnd, StackKey,
    StackStats, ThreadPairKey, ThreadPairStats, COUNT_SCALE, NO_STACK, STACK_HASH_SEED,
};

use crate::{
    kernel::ages::{self, AgeBook, AgeSpan},
    kernel::batch,
    kernel::growth::Pages,
    kernel::live_filter,
    kernel::mappings::MappedStack,
    kernel::sample_rates,
    ring::Ring,
    unwind::{Completion, Registry},
};

/// What the kernel side knows at one moment, for the processes asked about.
#[derive(Debug, Clone, Default)]
pub struct KernelSnapshot {
    pub processes: HashMap<u32, Snapshot>,
    /// Events not recorded, by `DropReason`, that found no room in the per-process table: no
    /// process's in particular.
    pub unattributed_drops: [u64; DropReason::COUNT],
    /// Entries in use in the maps that fill up: (`LIVE`, `STACK_STATS`), all processes together.
    pub live_entries: u64,
    pub stack_stats_entries: u64,
    /// `live_entries` by process, for every process in `STACK_STATS`, asked about or not.
    pub live_by_process: HashMap<u32, u64>,
}

/// One process.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// CLOCK_MONOTONIC when the snapshot was read, in the kernel's `bpf_ktime_get_ns` time base.
    pub now_ns: u64,
    pub stacks: Vec<StackSnapshot>,
    pub counters: ProcCounters,
    /// The process's events not recorded, by `DropReason`.
    pub drops: ProcDrops,
    /// `AgeBook::missed_generations` of the process at the time of the read.
    pub missed_generations: u64,
    /// Mean bytes between samples when the process is sampled; 0 when every call is recorded.
    pub sample_bytes: u64,
    /// What of it its allocator's own sampler records (see `loader::usdt`).
    pub sampler: Sampler,
    pub sizes: Log2Histogram,
    /// Lifetimes of freed allocations, in ns.
    pub lifetimes: Log2Histogram,
    /// The most bytes the process had in use since tracing began, and when.
    pub peak: Peak,
    /// Frees by another thread than the allocating one.
    pub thread_pairs: Vec<(ThreadPairKey, ThreadPairStats)>,
    /// The anonymous memory it holds from `mmap`, `mremap` and `brk`, by stack (see `mappings`).
    pub mappings: Vec<MappedStack>,
    /// Traced by the pages it touches (`--growth`): its stacks hold pages, not blocks.
    pub growth: Option<Growth>,
}

/// What of a process its allocator's own sampler records: its `otel_memory` probes, or Go's
/// runtime's sampler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Sampler {
    /// Nothing: its calls are traced.
    #[default]
    None,
    /// All of it, and no call (`--usdt`, or a Go program without cgo).
    Only,
    /// Go's heap, beside its calls to the C library's allocator (a Go program with cgo).
    BesideCalls,
}

/// What a process traced by its page faults (`--growth`) touched and memprof did not count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Growth {
    /// Pages touched outside the anonymous memory memprof knows the process has.
    pub outside_pages: u64,
}

/// A process's high-water mark of bytes in use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peak {
    pub bytes: u64,
    /// CLOCK_MONOTONIC when it was reached (0: nothing allocated yet).
    pub at_ns: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct StackSnapshot {
    pub stack_id: u64,
    /// The id the kernel stored the stack's frames under: `stack_id`, but for a stack the kernel
    /// deferred, whose `stack_id` is the whole stack's (see `merge_deferred`).
    pub stored_id: u64,
    pub stats: StackStats,
    pub outstanding_bytes: u64,
    pub outstanding_allocations: u64,
    /// Outstanding allocations at least min-age old (to the generation).
    pub aged_bytes: u64,
    pub aged_allocations: u64,
    /// Earliest time the oldest outstanding allocation can have been made.
    pub oldest_ns: Option<u64>,
    /// Outstanding memory by age, oldest first.
    pub ages: Vec<AgeSpan>,
    /// Bytes the stack held at its process's peak.
    pub peak_bytes: u64,
}

pub fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Reads the maps once for all of `tgids`: each map is walked once, however many processes.
/// Allocations at least `min_age_ns` old are counted apart as aged.
/// Stacks cut in walks the kernel deferred (`unwind`) count with those the kernel cut.
/// A process traced by its page faults (`--growth`) has its `pages` for stacks instead.
pub fn read<'a>(
    ebpf: &Ebpf,
    unwind: &Registry,
    book: &mut AgeBook,
    tgids: &HashSet<u32>,
    min_age_ns: u64,
    pages: &dyn Fn(u32) -> Option<&'a Pages>,
) -> anyhow::Result<KernelSnapshot> {
    let now_ns = monotonic_now_ns();
    let counters: BpfHashMap<_, u32, ProcCounters> = BpfHashMap::try_from(map(ebpf, "PROC_COUNTERS")?)?;
    let sampling: BpfHashMap<_, u32, u64> = BpfHashMap::try_from(map(ebpf, "SAMPLING")?)?;
    let heaps: BpfHashMap<_, u32, ProcHeap> = BpfHashMap::try_from(map(ebpf, "PROC_HEAP")?)?;
    let proc_drops: BpfHashMap<_, u32, ProcDrops> = BpfHashMap::try_from(map(ebpf, "PROC_DROPS")?)?;

    let mut snapshot = KernelSnapshot::default();
    // Each process's peak generation, read before the stacks: a stack that changes after this
    // read and before its own counts its bytes since, as if read a moment later.
    let mut peak_generations = HashMap::new();
    // Each process's program: the totals an earlier one left until its exec is handled are not its.
    let mut images = HashMap::new();
    for &tgid in tgids {
        let heap = heaps.get(&tgid, 0).unwrap_or_default();
        peak_generations.insert(tgid, heap.peak_generation);
        images.insert(tgid, heap.image as u32);
        let process = Snapshot {
            now_ns,
            counters: whole_counts(counters.get(&tgid, 0).unwrap_or_default()),
            drops: proc_drops.get(&tgid, 0).unwrap_or_default(),
            sample_bytes: sampling.get(&tgid, 0).unwrap_or(0),
            sizes: unscale_histogram(heap.sizes),
            lifetimes: unscale_histogram(heap.lifetimes),
            peak: Peak { bytes: heap.peak, at_ns: heap.peak_ns },
            ..Snapshot::default()
        };
        snapshot.processes.insert(tgid, process);
    }
    let current = |tgid: &u32, image: u32| images.get(tgid) == Some(&image);
    batch::for_each(map(ebpf, "STACK_STATS")?, |key: &StackKey, stats: &StackStats| {
        snapshot.stack_stats_entries += 1;
        let live = unscale(stats.allocations.saturating_sub(stats.frees));
        snapshot.live_entries += live;
        *snapshot.live_by_process.entry(key.tgid).or_default() += live;
        // An entry that sends its stack's counts to another (`early_stacks`) has none of its own.
        let forwards = stats.counted_as != NO_STACK && stats.allocations == 0 && stats.frees == 0;
        if let Some(process) =
            snapshot.processes.get_mut(&key.tgid).filter(|_| current(&key.tgid, key.image) && !forwards)
        {
            let spans = book.observe(*key, stats, now_ns);
            let mut stack = stack_snapshot(key.stack_id, *stats, spans, book, now_ns, min_age_ns);
            if peak_generations.get(&key.tgid) == Some(&stats.peak_generation) {
                // Changed since the peak: it kept what it held then.
                stack.peak_bytes = stats.bytes_at_peak;
            }
            process.stacks.push(stack);
        }
    })?;
    batch::for_each(map(ebpf, "THREAD_PAIRS")?, |key: &ThreadPairKey, stats: &ThreadPairStats| {
        if let Some(process) = snapshot.processes.get_mut(&key.tgid).filter(|_| current(&key.tgid, key.image)) {
            let stats = ThreadPairStats { frees: unscale(stats.frees), ..*stats };
            process.thread_pairs.push((*key, stats));
        }
    })?;
    for (&tgid, process) in &mut snapshot.processes {
        if let Some(pages) = pages(tgid) {
            for (stack_id, stats) in pages.stacks() {
                let key = StackKey { tgid, image: 0, stack_id };
                let spans = book.observe(key, stats, now_ns);
                process.stacks.push(stack_snapshot(stack_id, *stats, spans, book, now_ns, min_age_ns));
            }
            process.growth = Some(Growth { outside_pages: pages.outside });
            process.peak = Peak { bytes: pages.peak.0, at_ns: pages.peak.1 };
        }
        process.stacks = merge_deferred(ebpf, unwind, tgid, std::mem::take(&mut process.stacks));
        book.woke(tgid);
        process.missed_generations = book.missed_generations(tgid);
        add_deferred_drops(&mut process.drops, unwind, tgid);
    }
    snapshot.unattributed_drops = unattributed_drops(ebpf)?;
    Ok(snapshot)
}

/// Process `tgid`'s events not recorded now, counted as `read` counts them.
pub fn drops_of(ebpf: &Ebpf, unwind: &Registry, tgid: u32) -> anyhow::Result<ProcDrops> {
    let drops: BpfHashMap<_, u32, ProcDrops> = BpfHashMap::try_from(map(ebpf, "PROC_DROPS")?)?;
    let mut drops = drops.get(&tgid, 0).unwrap_or_default();
    add_deferred_drops(&mut drops, unwind, tgid);
    Ok(drops)
}

/// Adds the drops of `tgid`'s walks the kernel deferred to memprof (see `unwind::deferred`).
fn add_deferred_drops(drops: &mut ProcDrops, unwind: &Registry, tgid: u32) {
    for (reason, count) in unwind.deferred_drops(tgid) {
        drops.counts[reason as usize] += count;
    }
}

/// The events not recorded that found no room in the per-process table, by `DropReason`.
pub fn unattributed_drops(ebpf: &Ebpf) -> anyhow::Result<[u64; DropReason::COUNT]> {
    let drops: PerCpuArray<_, u64> = PerCpuArray::try_from(map(ebpf, "DROPS")?)?;
    let mut totals = [0; DropReason::COUNT];
    for (index, total) in totals.iter_mut().enumerate() {
        *total = drops.get(&(index as u32), 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0);
    }
    Ok(totals)
}

/// What a process has asked of its allocator since it was traced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    /// Allocations and frees (estimates when sampled).
    pub calls: u64,
    /// As `Snapshot::sample_bytes`.
    pub sample_bytes: u64,
}

/// The allocator calls of each of `tgids` since it was traced: one walk of `STACK_STATS` and
/// nothing else of `read`'s work (no ages, no histograms), for a count between intervals.
pub fn calls(ebpf: &Ebpf, tgids: &HashSet<u32>) -> anyhow::Result<HashMap<u32, Calls>> {
    let sampling: BpfHashMap<_, u32, u64> = BpfHashMap::try_from(map(ebpf, "SAMPLING")?)?;
    let mut calls: HashMap<u32, Calls> = tgids
        .iter()
        .map(|&tgid| (tgid, Calls { calls: 0, sample_bytes: sampling.get(&tgid, 0).unwrap_or(0) }))
        .collect();
    batch::for_each(map(ebpf, "STACK_STATS")?, |key: &StackKey, stats: &StackStats| {
        if let Some(process) = calls.get_mut(&key.tgid) {
            process.calls += unscale(stats.allocations) + unscale(stats.frees);
        }
    })?;
    Ok(calls)
}

/// `stacks` with each stack the kernel deferred and memprof finished under the id the kernel
/// would have given the whole stack, merged with that stack's own counts: one stack, one id, for
/// the leak rule and the timelines as for the reports.
fn merge_deferred(ebpf: &Ebpf, unwind: &Registry, tgid: u32, stacks: Vec<StackSnapshot>) -> Vec<StackSnapshot> {
    let mut merged: Vec<StackSnapshot> = Vec::with_capacity(stacks.len());
    let mut at: std::collections::HashMap<u64, usize> = std::collections::HashMap::with_capacity(stacks.len());
    for mut stack in stacks {
        if unwind.completion(tgid, StackTable::Allocations.id(), stack.stack_id).is_some() {
            let (frames, end) = stack_frames(ebpf, unwind, tgid, StackTable::Allocations, stack.stack_id);
            stack.stack_id = whole_id(&frames, end);
        }
        match at.get(&stack.stack_id) {
            Some(&index) => merged[index].absorb(stack),
            None => {
                at.insert(stack.stack_id, merged.len());
                merged.push(stack);
            }
        }
    }
    merged
}

impl Snapshot {
    /// Bytes allocated and not freed since tracing began, all stacks together.
    pub fn outstanding_bytes(&self) -> u64 {
        self.stacks.iter().map(|s| s.stats.allocated_bytes.saturating_sub(s.stats.freed_bytes)).sum()
    }
}

impl StackSnapshot {
    /// Adds `other`'s counts, the same stack's under another id.
    fn absorb(&mut self, other: StackSnapshot) {
        let (s, o) = (&mut self.stats, other.stats);
        s.allocations += o.allocations;
        s.allocated_bytes += o.allocated_bytes;
        s.frees += o.frees;
        s.freed_bytes += o.freed_bytes;
        s.old_freed_bytes += o.old_freed_bytes;
        s.old_frees += o.old_frees;
        s.temporary_allocations += o.temporary_allocations;
        // Two ids with counts of their own (see `early_stacks`): their highs need not have come
        // at once, and their sum bounds the stack's from above.
        s.max_outstanding_bytes += o.max_outstanding_bytes;
        self.peak_bytes += other.peak_bytes;
        for (mine, theirs) in s.generation_bytes.iter_mut().zip(o.generation_bytes) {
            *mine = mine.wrapping_add(theirs);
        }
        for (mine, theirs) in s.generation_allocations.iter_mut().zip(o.generation_allocations) {
            *mine = mine.wrapping_add(theirs);
        }
        self.outstanding_bytes += other.outstanding_bytes;
        self.outstanding_allocations += other.outstanding_allocations;
        self.aged_bytes += other.aged_bytes;
        self.aged_allocations += other.aged_allocations;
        self.oldest_ns = match (self.oldest_ns, other.oldest_ns) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.ages.extend(other.ages);
        self.ages.sort_by_key(|span| span.first);
    }
}

/// `counters` with `usdt_counts` in whole counts, as the stacks' counts are read.
fn whole_counts(counters: ProcCounters) -> ProcCounters {
    ProcCounters { usdt_counts: unscale(counters.usdt_counts), ..counters }
}

/// A count the kernel keeps in 1/COUNT_SCALE units (see `profiler_common::weight`), rounded.
fn unscale(count: u64) -> u64 {
    (count + COUNT_SCALE / 2) / COUNT_SCALE
}

fn unscale_histogram(mut histogram: Log2Histogram) -> Log2Histogram {
    histogram.buckets.iter_mut().for_each(|count| *count = unscale(*count));
    histogram
}

fn stack_snapshot(
    stack_id: u64,
    scaled: StackStats,
    mut ages: Vec<AgeSpan>,
    book: &AgeBook,
    now_ns: u64,
    min_age_ns: u64,
) -> StackSnapshot {
    ages.iter_mut().for_each(|span| span.allocations = unscale(span.allocations));
    let (aged_bytes, aged_allocations) = ages::aged(&book.clock, &ages, now_ns, min_age_ns);
    let stats = StackStats {
        allocations: unscale(scaled.allocations),
        frees: unscale(scaled.frees),
        temporary_allocations: unscale(scaled.temporary_allocations),
        ..scaled
    };
    // Unchanged since the process's peak (see `read`): it holds what it held then.
    let outstanding_bytes = stats.allocated_bytes.saturating_sub(stats.freed_bytes);
    StackSnapshot {
        stack_id,
        stored_id: stack_id,
        stats,
        // Frees are only counted for allocations seen, so these never go negative.
        outstanding_bytes,
        outstanding_allocations: unscale(scaled.allocations.saturating_sub(scaled.frees)),
        aged_bytes,
        aged_allocations,
        oldest_ns: ages::oldest_ns(&book.clock, &ages),
        ages,
        peak_bytes: outstanding_bytes,
    }
}

/// What a purge removes from the maps.
#[derive(Debug, Clone, Copy)]
pub enum Doomed<'a> {
    /// Everything of these processes, which have exited (or were detached while running).
    Processes(&'a HashSet<u32>),
    /// What process `tgid`'s old program left when it exec'd into program `image` at `exec_ns`
    /// (see `ProcessEvent`): its blocks, its stacks' totals, thread pairs and recent frees. The
    /// new program's, recorded since, stay; its heap figures and counters the kernel restarted.
    OldImage { tgid: u32, image: u32, exec_ns: u64 },
}

impl Doomed<'_> {
    /// Entries of the whole process: counters, heap figures, in-flight calls, sampling.
    fn process(&self, tgid: u32) -> bool {
        matches!(self, Doomed::Processes(tgids) if tgids.contains(&tgid))
    }

    /// Entries made by program `image` of process `tgid` (stack totals, thread pairs).
    fn made_by(&self, tgid: u32, image: u32) -> bool {
        match *self {
            Doomed::Processes(tgids) => tgids.contains(&tgid),
            Doomed::OldImage { tgid: old, image: new, .. } => tgid == old && image < new,
        }
    }

    /// Entries of process `tgid` made at `time_ns` (blocks, recent frees).
    fn made_at(&self, tgid: u32, time_ns: u64) -> bool {
        match *self {
            Doomed::Processes(tgids) => tgids.contains(&tgid),
            Doomed::OldImage { tgid: old, exec_ns, .. } => tgid == old && time_ns < exec_ns,
        }
    }
}

/// Removes what `doomed` names from the maps: the entries of exited processes would otherwise
/// fill the maps and a reused pid would inherit them. Stacks that nothing else refers to go too
/// (`STACKS` never frees ids by itself). Each map is walked once, however many processes.
/// `held_elsewhere` gives the stacks that memprof's user space holds, asked after the stored ids
/// are read.
pub fn purge(ebpf: &mut Ebpf, doomed: Doomed, held_elsewhere: impl FnOnce() -> HashSet<u64>) -> anyhow::Result<()> {
    // The stored stack ids first: a stack another process stores while this runs is kept, though
    // the scans below may miss the counts that will refer to it. (One stored just before, whose
    // counts land only after the scans pass, can go; its next allocation stores it again.)
    let stored_stacks = stack_ids(ebpf, StackTable::Allocations)?;
    let stored_free_stacks = stack_ids(ebpf, StackTable::Frees)?;
    let held_elsewhere = held_elsewhere();
    // The stacks other processes refer to. Not only these processes' stacks go: a stack stored for
    // an allocation that the full LIVE table then refused has no counts that refer to it, and a
    // free stack is referenced only by a RECENT_FREES slot (or a double-free event, read before
    // this), which the next allocation at that address or a later free in the same slot empties.
    // Either is stored again if needed.
    let (mut used_stacks, mut used_free_stacks) = (held_elsewhere, HashSet::new());
    batch::for_each(map(ebpf, "STACK_STATS")?, |key: &StackKey, _: &StackStats| {
        if !doomed.made_by(key.tgid, key.image) {
            used_stacks.insert(key.stack_id);
        }
    })?;
    let mut own_recent_frees = Vec::new();
    batch::for_each(map(ebpf, "RECENT_FREES")?, |&slot: &u32, recent: &RecentFree| {
        if recent.key.addr == 0 {
            return;
        }
        if doomed.made_at(recent.key.tgid, recent.freed.free.time_ns) {
            own_recent_frees.push(slot);
        } else {
            used_stacks.insert(recent.freed.alloc.stack_id);
            used_free_stacks.insert(recent.freed.free.stack_id);
        }
    })?;
    // SAFETY: Pod, valid zeroed: an empty slot.
    let empty = unsafe { std::mem::zeroed::<RecentFree>() };
    batch::update(map(ebpf, "RECENT_FREES")?, &own_recent_frees, &vec![empty; own_recent_frees.len()])?;
    fn remove_matching<K: aya::Pod, V: aya::Pod>(
        ebpf: &Ebpf,
        name: &str,
        matches: impl Fn(&K, &V) -> bool,
    ) -> anyhow::Result<Vec<K>> {
        let mut doomed = Vec::new();
        batch::for_each(map(ebpf, name)?, |k: &K, v: &V| {
            if matches(k, v) {
                doomed.push(*k);
            }
        })?;
        batch::delete(map(ebpf, name)?, doomed)
    }
    // Threads that died inside the allocator leave their in-flight state behind.
    remove_matching::<u32, Inflight>(ebpf, "INFLIGHT", |_, state| doomed.process(state.tgid))?;
    let blocks = remove_matching::<AddrKey, LiveAlloc>(ebpf, "LIVE", |k, alloc| doomed.made_at(k.tgid, alloc.time_ns))?;
    live_filter::forget(ebpf, &blocks)?;
    let blocks: HashSet<AddrKey> = blocks.into_iter().collect();
    remove_matching::<AddrKey, u64>(ebpf, "USDT_WEIGHTS", |k, _| doomed.process(k.tgid) || blocks.contains(k))?;
    remove_matching::<StackKey, StackStats>(ebpf, "STACK_STATS", |k, _| doomed.made_by(k.tgid, k.image))?;
    remove_matching::<u32, ProcCounters>(ebpf, "PROC_COUNTERS", |k, _| doomed.process(*k))?;
    remove_matching::<u32, ProcDrops>(ebpf, "PROC_DROPS", |k, _| doomed.process(*k))?;
    sample_rates::forget(ebpf, |pid| doomed.process(pid))?;
    remove_matching::<u32, ProcHeap>(ebpf, "PROC_HEAP", |k, _| doomed.process(*k))?;
    remove_matching::<ThreadPairKey, ThreadPairStats>(ebpf, "THREAD_PAIRS", |k, _| doomed.made_by(k.tgid, k.image))?;
    let tables = [
        (StackTable::Allocations, stored_stacks, used_stacks),
        (StackTable::Frees, stored_free_stacks, used_free_stacks),
    ];
    for (table, stored, used) in tables {
        batch::delete(map(ebpf, table.map_name())?, stored.difference(&used).copied().collect())?;
    }
    Ok(())
}

fn stack_ids(ebpf: &Ebpf, table: StackTable) -> anyhow::Result<HashSet<u64>> {
    let mut ids = HashSet::new();
    batch::for_each(map(ebpf, table.map_name())?, |id: &u64, _: &Stack| {
        ids.insert(*id);
    })?;
    Ok(ids)
}

pub fn map<'a>(ebpf: &'a Ebpf, name: &str) -> anyhow::Result<&'a aya::maps::Map> {
    ebpf.map(name).with_context(|| format!("map {name} missing from the eBPF object"))
}

/// Where a stack id points: allocation stacks and free stacks are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StackTable {
    Allocations,
    Frees,
}

impl StackTable {
    /// Its `profiler_common::stack_table` constant.
    fn id(self) -> u32 {
        match self {
            StackTable::Allocations => stack_table::ALLOCATIONS,
            StackTable::Frees => stack_table::FREES,
        }
    }

    fn map_name(self) -> &'static str {
        match self {
            StackTable::Allocations => "STACKS",
            StackTable::Frees => "FREE_STACKS",
        }
    }
}

/// How many stacks a table holds. A walk of up to its capacity in keys: for the daemon's
/// metrics, not for every report.
pub fn stack_entries(ebpf: &Ebpf, table: StackTable) -> anyhow::Result<u64> {
    let mut entries = 0;
    batch::for_each(map(ebpf, table.map_name())?, |_: &u64, _: &Stack| entries += 1)?;
    Ok(entries)
}

/// How many stacks each process's totals name (`STACK_STATS`' entries by process): what it holds
/// of the stack table, which every traced process shares.
pub fn stacks_by_process(ebpf: &Ebpf) -> anyhow::Result<HashMap<u32, u64>> {
    let mut stacks: HashMap<u32, u64> = HashMap::new();
    batch::for_each(map(ebpf, "STACK_STATS")?, |key: &StackKey, _: &StackStats| {
        *stacks.entry(key.tgid).or_default() += 1;
    })?;
    Ok(stacks)
}

/// The addresses of a stored stack of process `tgid`, innermost first, and why its walk ended;
/// no frames for `NO_STACK`. A walk the kernel deferred goes on with the frames memprof found
/// (cut as `NoTable` until it has).
pub fn stack_frames(
    ebpf: &Ebpf,
    unwind: &Registry,
    tgid: u32,
    table: StackTable,
    stack_id: u64,
) -> (Vec<u64>, StackEnd) {
    let stored = (stack_id != NO_STACK)
        .then(|| map(ebpf, table.map_name()).ok())
        .flatten()
        .and_then(|m| BpfHashMap::<_, u64, Stack>::try_from(m).ok())
        .and_then(|stacks| stacks.get(&stack_id, 0).ok());
    match stored {
        Some(stack) => whole_frames(&stack, unwind.completion(tgid, table.id(), stack_id)),
        None => (Vec::new(), StackEnd::NoTable),
    }
}

/// The frames of `stack`, a stored stack, and why its walk ended: a walk the kernel deferred goes
/// on with `rest`, the frames memprof found (cut as `NoTable` until it has).
pub fn whole_frames(stack: &Stack, rest: Option<&Completion>) -> (Vec<u64>, StackEnd) {
    let len = (stack.len as usize).min(stack.frames.len());
    let mut frames = stack.frames[..len].to_vec();
    let end = match StackEnd::from_u32(stack.end) {
        StackEnd::Deferred => match rest {
            Some(rest) => {
                frames.extend_from_slice(&rest.frames);
                rest.end
            }
            None => StackEnd::NoTable,
        },
        end => end,
    };
    (frames, end)
}

/// The id the kernel gives a stack walked whole to `frames`, ended as `end`.
pub fn whole_id(frames: &[u64], end: StackEnd) -> u64 {
    stack_id_of(frames.iter().fold(STACK_HASH_SEED, |hash, &pc| stack_hash_step(hash, pc)), end as u32)
}

/// Receives double-free events for every traced process.
pub struct DoubleFreeReader {
    ring: Ring,
    /// Read by `drain_before_execs`, for the next `drain`.
    later: Vec<DoubleFreeEvent>,
}

impl DoubleFreeReader {
    pub fn new(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let map = ebpf.take_map("DOUBLE_FREES").context("map DOUBLE_FREES missing from the eBPF object")?;
        Ok(Self { ring: Ring::new("DOUBLE_FREES", map)?, later: Vec::new() })
    }

    /// For waiting on double frees with poll.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Every event that arrived since the last call.
    pub fn drain(&mut self) -> Vec<DoubleFreeEvent> {
        let mut events = std::mem::take(&mut self.later);
        self.ring.read_each(|event: DoubleFreeEvent| events.push(event));
        events
    }

    /// The events a program made before its process's first exec among `process_events`, to be
    /// symbolized before that exec is handled, while the old program's maps last. The rest wait
    /// for the next `drain`, which comes after the new program's maps are read.
    pub fn drain_before_execs(&mut self, process_events: &[ProcessEvent]) -> Vec<DoubleFreeEvent> {
        let (before, later) = split_around_execs(self.drain(), process_events);
        self.later = later;
        before
    }
}

fn split_around_execs(
    double_frees: Vec<DoubleFreeEvent>,
    process_events: &[ProcessEvent],
) -> (Vec<DoubleFreeEvent>, Vec<DoubleFreeEvent>) {
    let mut first_exec_ns = HashMap::new();
    for event in process_events.iter().filter(|event| event.kind == process_event::EXEC) {
        first_exec_ns.entry(event.tgid).or_insert(event.time_ns);
    }
    double_frees.into_iter().partition(|double_free| {
        first_exec_ns.get(&double_free.tgid).is_some_and(|&exec_ns| double_free.second.time_ns < exec_ns)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::ages::Clock;

    #[test]
    fn double_frees_made_before_their_processs_first_exec_come_first() {
        let double_free = |tgid, time_ns| {
            // SAFETY: integers only, for which all zeroes is a value.
            let mut event: DoubleFreeEvent = unsafe { std::mem::zeroed() };
            (event.tgid, event.second.time_ns) = (tgid, time_ns);
            event
        };
        let process_event = |kind, tgid, time_ns| {
            // SAFETY: integers and bytes only, for which all zeroes is a value.
            let mut event: ProcessEvent = unsafe { std::mem::zeroed() };
            (event.kind, event.tgid, event.time_ns) = (kind, tgid, time_ns);
            event
        };
        let events = [
            process_event(process_event::FORK, 1, 10),
            process_event(process_event::EXEC, 1, 100),
            process_event(process_event::EXEC, 1, 200),
            process_event(process_event::FORK, 2, 100),
        ];
        let double_frees = vec![double_free(1, 99), double_free(1, 101), double_free(1, 300), double_free(2, 50)];
        let (before, after) = split_around_execs(double_frees, &events);
        let times =
            |events: Vec<DoubleFreeEvent>| events.iter().map(|e| (e.tgid, e.second.time_ns)).collect::<Vec<_>>();
        assert_eq!(times(before), [(1, 99)]);
        assert_eq!(times(after), [(1, 101), (1, 300), (2, 50)]);
    }

    #[test]
    fn outstanding_is_allocated_minus_freed_and_aged_comes_from_generations() {
        let scale = COUNT_SCALE;
        let stats = StackStats {
            allocations: 10 * scale,
            allocated_bytes: 1000,
            frees: 4 * scale,
            freed_bytes: 400,
            ..StackStats::EMPTY
        };
        let book = AgeBook::new(Clock { base_ns: 0, length_ns: 10 });
        let ages = vec![
            AgeSpan { first: 0, last: 0, bytes: 100, allocations: scale },
            AgeSpan { first: 5, last: 5, bytes: 500, allocations: 5 * scale },
        ];
        let s = stack_snapshot(7, stats, ages, &book, 60, 30);
        assert_eq!((s.outstanding_bytes, s.outstanding_allocations), (600, 6));
        assert_eq!((s.stats.allocations, s.stats.frees), (10, 4), "counts are kept in 1/COUNT_SCALE units");
        assert_eq!((s.aged_bytes, s.aged_allocations), (100, 1), "generation 5 ended at 60, less than 30 ago");
        assert_eq!(s.oldest_ns, Some(0));
    }
}
