//! /metrics: every series is encoded from the latest `DaemonView` at scrape time, so series of
//! processes that exited disappear with them and a scrape never touches the kernel.

use std::sync::{Arc, RwLock};

use profiler_common::DropReason;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, NoLabelSet},
    metrics::MetricType,
    registry::Registry,
};

use super::{
    server,
    view::{DaemonView, TargetView},
};
use crate::{kernel::mapping_programs::MachineWide, process::procfs};

/// Histogram buckets up to 2^32 bytes; larger allocations land in +Inf.
const HISTOGRAM_BUCKETS: usize = 33;

#[derive(Debug)]
struct ViewCollector {
    view: Arc<RwLock<DaemonView>>,
}

pub fn registry(view: Arc<RwLock<DaemonView>>) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(ViewCollector { view }));
    registry
}

type Labels = Vec<(&'static str, String)>;

/// The series every traced process has: name (a counter's without `_total`, which the encoder
/// appends), help, type, and the value from its view.
type PerProcess = (&'static str, &'static str, MetricType, fn(&TargetView) -> u64);

const PER_PROCESS: &[PerProcess] = &[
    ("memprof_heap_inuse_bytes", "Bytes allocated and not yet freed.", MetricType::Gauge, |t| {
        t.report.totals.outstanding_bytes
    }),
    ("memprof_heap_inuse_objects", "Allocations not yet freed.", MetricType::Gauge, |t| {
        t.report.totals.outstanding_allocations
    }),
    (
        "memprof_heap_peak_bytes",
        "The most bytes allocated and not yet freed at once since tracing began.",
        MetricType::Gauge,
        |t| t.report.peak.bytes,
    ),
    (
        "memprof_rss_anon_bytes",
        "Anonymous resident memory of the process (RssAnon in /proc/PID/status), to set against memprof_heap_inuse_bytes.",
        MetricType::Gauge,
        |t| t.report.memory.map_or(0, |m| m.rss_anon_bytes),
    ),
    (
        "memprof_mmap_outstanding_bytes",
        "Anonymous private memory the process holds from mmap, mremap and brk made outside its allocator: memory memprof_heap_inuse_bytes does not count (docs: guide/mappings.md#memory-outside-malloc-mappings).",
        MetricType::Gauge,
        |t| t.report.mappings.outstanding_bytes,
    ),
    (
        "memprof_mmap_allocator_bytes",
        "Anonymous private memory the process's allocator holds from mmap, mremap and brk for its blocks: memprof_heap_inuse_bytes counts what of it is in use.",
        MetricType::Gauge,
        |t| t.report.mappings.allocator_bytes,
    ),
    (
        "memprof_heap_pinned_bytes",
        "Resident pages holding live heap blocks but less than a quarter of their bytes live (fragmentation: docs: guide/resident-memory.md#resident-memory-against-the-heap); 0 when sampled.",
        MetricType::Gauge,
        |t| t.report.memory.map_or(0, |m| m.pinned_bytes),
    ),
    ("memprof_allocations", "Successful allocator calls.", MetricType::Counter, |t| t.report.totals.allocations),
    (
        "memprof_temporary_allocations",
        "Allocations freed by their thread before it allocated or freed anything else (every call recorded only).",
        MetricType::Counter,
        |t| t.report.totals.temporary_allocations,
    ),
    ("memprof_allocated_bytes", "Bytes allocated.", MetricType::Counter, |t| t.report.totals.allocated_bytes),
    ("memprof_frees", "Frees of allocations seen.", MetricType::Counter, |t| t.report.totals.frees),
    ("memprof_freed_bytes", "Bytes freed.", MetricType::Counter, |t| t.report.totals.freed_bytes),
    ("memprof_failed_allocations", "Allocator calls that failed.", MetricType::Counter, |t| {
        t.report.totals.failed_allocations
    }),
    ("memprof_unknown_frees", "Frees of addresses not allocated since attach.", MetricType::Counter, |t| {
        t.report.totals.unknown_frees
    }),
    (
        "memprof_internal_frees",
        "Frees the C library made itself of blocks it allocated inside itself (its per-thread caches).",
        MetricType::Counter,
        |t| t.report.totals.internal_frees,
    ),
    ("memprof_double_frees", "Frees of addresses already freed.", MetricType::Counter, |t| t.double_frees),
    (
        "memprof_blind_spots",
        "Allocators memprof found but does not probe in the process, unseen growth of its anonymous memory, or memory it held before growth mode traced its pages; its report says which and what to do (docs: guide/allocators.md#blind-spots).",
        MetricType::Gauge,
        |t| t.report.blind_spots.len() as u64,
    ),
    (
        "memprof_sample_bytes",
        "Mean bytes between recorded allocations when the process is sampled (its other series are then estimates); 0 when every call is recorded.",
        MetricType::Gauge,
        |t| t.sample_bytes,
    ),
    (
        "memprof_growth_mode",
        "1 when the process is traced by the pages it touches (--growth): its bytes are pages by the stack that first touched each, its allocations pages.",
        MetricType::Gauge,
        |t| u64::from(t.report.growth.is_some()),
    ),
    (
        "memprof_usdt_samples",
        "Allocations the allocator's own sampler (its otel_memory probes, or Go's runtime) reported when the process is traced through it, alone or (Go's heap) beside its calls (its other series are then estimates, in part beside the calls); 0 otherwise.",
        MetricType::Counter,
        |t| t.report.usdt_samples.unwrap_or(0),
    ),
];

/// The leak rule's per-process gauges: absent while it warms up, when 0 would read "no leak".
const JUDGED: [PerProcess; 2] = [
    (
        "memprof_leak_candidate_bytes",
        "Bytes in use by the stacks the leak rule flags (docs: guide/leaks.md#leak-candidates); absent while memprof_leak_rule_warming_up is 1.",
        MetricType::Gauge,
        |t| t.leak_candidate_bytes,
    ),
    (
        "memprof_leak_candidates",
        "Stacks the leak rule flags as leak candidates; absent while memprof_leak_rule_warming_up is 1.",
        MetricType::Gauge,
        |t| t.leak_candidates,
    ),
];

/// Each process's labels. Its identity is its command name and slot (see `slots`), not its pid,
/// so that a restarted process continues its series; `--pid-labels` adds the pid to them all.
#[derive(Clone, Copy)]
struct Identity {
    pid_labels: bool,
}

impl Identity {
    fn of(&self, t: &TargetView) -> Labels {
        let mut labels = vec![("comm", t.comm.clone()), ("slot", t.slot.to_string())];
        if self.pid_labels {
            labels.push(("pid", t.pid.to_string()));
        }
        labels
    }

    /// The labels of a stack's series: the process's identity, not its exe and cgroup (one series
    /// per stack; they are on the process's series).
    fn stack(&self, t: &TargetView, stack: &str) -> Labels {
        let mut labels = self.of(t);
        labels.push(("stack", stack.to_string()));
        labels
    }

    /// The labels of the series of one process: one series each, so the executable and the
    /// cgroup (a container's, or a systemd unit's) cost no cardinality.
    fn process(&self, t: &TargetView) -> Labels {
        let mut labels = self.of(t);
        labels.extend([("exe", t.report.exe.clone()), ("cgroup", t.cgroup.clone().unwrap_or_default())]);
        labels
    }

    /// `memprof_target_attached`'s labels: the process's, its pid and its namespace pid.
    fn target(&self, t: &TargetView) -> Labels {
        let mut labels = self.process(t);
        if !self.pid_labels {
            labels.push(("pid", t.pid.to_string()));
        }
        labels.extend(t.report.ns_pid.map(|ns_pid| ("ns_pid", ns_pid.to_string())));
        labels
    }
}

/// Writes one metric family: `rows` gives each series' labels and value.
fn family<V>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: impl IntoIterator<Item = (Labels, V)>,
    mut write: impl FnMut(&mut prometheus_client::encoding::MetricEncoder, &V) -> std::fmt::Result,
) -> std::fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in rows {
        if labels.is_empty() {
            write(&mut metric, &value)?;
        } else {
            write(&mut metric.encode_family(&labels)?, &value)?;
        }
    }
    Ok(())
}

fn gauges<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, V)>,
) -> std::fmt::Result {
    family(encoder, name, help, MetricType::Gauge, rows, |m, v| m.encode_gauge(v))
}

/// `name` without `_total`: the encoder appends it.
fn counters<V: EncodeCounterValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, V)>,
) -> std::fmt::Result {
    family(encoder, name, help, MetricType::Counter, rows, |m, v| m.encode_counter::<NoLabelSet, _, u64>(v, None))
}

impl Collector for ViewCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let view = self.view.read().unwrap_or_else(|e| e.into_inner()).clone();
        let e = &mut encoder;
        let targets: Vec<&TargetView> = view.targets.values().map(|t| &**t).collect();
        let id = Identity { pid_labels: view.pid_labels };

        for (name, help, kind, value) in PER_PROCESS {
            let rows = targets.iter().map(|t| (id.process(t), value(t)));
            match kind {
                MetricType::Counter => counters(e, name, help, rows)?,
                _ => gauges(e, name, help, rows)?,
            }
        }
        // Rare: a series only for a process that has had one, as a drop reason.
        counters(
            e,
            "memprof_double_frees_unconfirmed",
            "Second frees of addresses first freed while memprof's probes went in: a double free, or a block given out again by a function not probed yet; not in memprof_double_frees_total. Only for a process that has had one.",
            targets.iter().filter(|t| t.report.double_frees_unconfirmed > 0).map(|t| (id.process(t), t.report.double_frees_unconfirmed)),
        )?;
        let judged: Vec<&TargetView> = targets.iter().copied().filter(|t| !t.leak_warming_up).collect();
        for (name, help, _, value) in JUDGED {
            gauges(e, name, help, judged.iter().map(|t| (id.process(t), value(t))))?;
        }
        gauges(
            e,
            "memprof_leak_rule_warming_up",
            "1 until the leak rule has watched the process for --leak-window intervals (after attach, exec or a daemon restart), then 0.",
            targets.iter().map(|t| (id.process(t), u64::from(t.leak_warming_up))),
        )?;
        if view.size_histograms {
            histograms(e, &targets, id)?;
        }
        gauges(
            e,
            "memprof_rss_anon_minus_heap_bytes",
            "memprof_rss_anon_bytes minus memprof_heap_inuse_bytes: allocator overhead and caches, fragmentation, anonymous memory not from malloc (negative while allocated memory is untouched).",
            targets.iter().filter_map(|t| t.report.memory.map(|m| (id.process(t), m.difference_bytes))),
        )?;

        let stack_rows = targets.iter().flat_map(|t| {
            let top = t.top_stacks.iter().map(move |s| (s.stack.clone(), s.bytes));
            let other = (!t.top_stacks.is_empty() || t.other_stack_bytes > 0)
                .then(|| ("other".to_string(), t.other_stack_bytes));
            top.chain(other).map(move |(stack, bytes)| (id.stack(t, &stack), bytes))
        });
        gauges(
            e,
            "memprof_stack_inuse_bytes",
            "In-use bytes of the top stacks of each process (leak candidates first, then the largest); the rest under stack=\"other\".",
            stack_rows,
        )?;
        let top_stacks = || targets.iter().flat_map(|t| t.top_stacks.iter().map(move |s| (*t, s)));
        gauges(
            e,
            "memprof_stack_info",
            "The allocation site of each exported stack (function and line, and the function alone), with the labels of its memprof_stack_inuse_bytes series.",
            top_stacks().map(|(t, s)| {
                let mut labels = id.stack(t, &s.stack);
                labels.extend([("site", s.site.clone()), ("function", s.function.clone())]);
                (labels, 1u64)
            }),
        )?;
        gauges(
            e,
            "memprof_stack_leak_candidate",
            "1 if the leak rule flags the exported stack, else 0; absent while memprof_leak_rule_warming_up is 1.",
            top_stacks()
                .filter(|(t, _)| !t.leak_warming_up)
                .map(|(t, s)| (id.stack(t, &s.stack), u64::from(s.leak_candidate))),
        )?;

        gauges(
            e,
            "memprof_build_info",
            "memprof's version.",
            [(vec![("version", env!("CARGO_PKG_VERSION").to_string())], 1u64)],
        )?;
        gauges(
            e,
            "memprof_target_attached",
            "Processes with probes attached, one series each: the pid of each comm and slot, and ns_pid, a container's process's pid in its own pid namespace.",
            targets.iter().map(|t| (id.target(t), 1u64)),
        )?;
        // Only the reasons a process has met: 17 series per target would mostly say 0.
        let process_drops = targets.iter().flat_map(|t| {
            t.report.dropped.iter().filter(|(_, count)| **count > 0).map(move |(reason, count)| {
                let mut labels = id.process(t);
                labels.push(("reason", reason.to_string()));
                (labels, *count)
            })
        });
        counters(
            e,
            "memprof_events_dropped",
            "Events the probes could not record, by process and reason (reasons met only).",
            process_drops,
        )?;
        counters(
            e,
            "memprof_all_events_dropped",
            "Events the probes could not record, of every process traced since the daemon started (exited ones and their programs before an exec included), by reason: each reason from 0.",
            view.all_drops.iter().map(|(reason, count)| (vec![("reason", reason.to_string())], *count)),
        )?;
        counters(
            e,
            "memprof_unattributed_events_dropped",
            "Events the probes could not record that no process's counters had room for, by reason; ring_bytes_skipped: bytes of records memprof's rings skipped, unread, when their positions made no sense.",
            DropReason::ALL
                .iter()
                .map(|r| (vec![("reason", r.name().to_string())], view.unattributed_drops[*r as usize]))
                .chain([(vec![("reason", crate::ring::SKIPPED_REASON.to_string())], crate::ring::skipped_bytes())]),
        )?;
        counters(
            e,
            "memprof_targets_refused",
            "Matching processes not traced because max_targets were traced already, or too few open files were left.",
            [(vec![], view.refused_targets)],
        )?;
        counters(
            e,
            "memprof_targets_missed",
            "Processes the rules matched that exited before their probes were attached: a program that runs for less time than attaching takes. Children of traced processes are memprof_children_missed.",
            [(vec![], view.missed_targets)],
        )?;
        counters(
            e,
            "memprof_discovery_scans",
            "Scans of /proc for the processes the rules match: at start, on reload and every resync_interval; new processes are found from their exec or fork without one.",
            [(vec![], view.discovery_scans)],
        )?;
        counters(
            e,
            "memprof_discovery_events",
            "Execs and forks of processes not traced that the kernel reported for the rules to judge; it keeps back those it can tell no rule matches.",
            [(vec![], view.discovery_events)],
        )?;
        gauges(
            e,
            "memprof_untraced_processes_sharing_probes",
            "Processes not traced that map an allocator file or dynamic linker whose probe links are shared (--probe-links), and so take a trap at each probed call; 0 while every traced process has links of its own.",
            [(vec![], view.untraced_sharing)],
        )?;
        gauges(
            e,
            "memprof_machine_wide_programs",
            "1 while memprof's programs run for every process on the machine: at each page fault, at the mapping calls, or at every system call where the kernel refuses fexit programs; only while a process is traced by its pages, or with --mappings.",
            MachineWide::ALL.map(|at| (vec![("at", at.to_string())], u64::from(view.machine_wide.contains(&at)))),
        )?;
        gauges(
            e,
            "memprof_last_read_timestamp_seconds",
            "When the daemon last read the kernel's maps for what /metrics shows (Unix time): the series stand still while its thread is held up (an inspection, a burst of exits).",
            [(vec![], view.read_at_seconds)],
        )?;
        gauges(
            e,
            "memprof_settled_targets",
            "Traced processes still for a leak window and two intervals: their stacks are not read again until they move.",
            [(vec![], view.settled_targets)],
        )?;
        counters(
            e,
            "memprof_children_followed",
            "Children of traced processes that matched the rules, attached from their fork.",
            [(vec![], view.children_followed)],
        )?;
        counters(
            e,
            "memprof_children_missed",
            "Children of traced processes that matched the rules but exited before their probes were attached.",
            [(vec![], view.children_missed)],
        )?;
        counters(
            e,
            "memprof_children_unseen_after_fork_seconds",
            "Time the followed children ran between their fork and their probes, their allocator calls unseen, all together.",
            [(vec![], view.children_unseen_ns as f64 / 1e9)],
        )?;
        gauges(
            e,
            "memprof_longest_child_unseen_after_fork_seconds",
            "The longest time one followed child ran between its fork and its probes, its allocator calls unseen.",
            [(vec![], view.longest_child_unseen_ns as f64 / 1e9)],
        )?;
        counters(
            e,
            "memprof_targets_unseen_after_start_seconds",
            "Time the other matching processes that started while the daemon ran (their fork or exec) ran before their probes, their allocator calls unseen, all together.",
            [(vec![], view.started_unseen_ns as f64 / 1e9)],
        )?;
        gauges(
            e,
            "memprof_longest_target_unseen_after_start_seconds",
            "The longest time one such process ran between its start and its probes, its allocator calls unseen.",
            [(vec![], view.longest_started_unseen_ns as f64 / 1e9)],
        )?;
        gauges(
            e,
            "memprof_bpf_map_entries",
            "Entries in use in the BPF maps that fill up.",
            view.maps.iter().map(|m| (vec![("map", m.name.to_string())], m.entries)),
        )?;
        gauges(
            e,
            "memprof_bpf_map_capacity",
            "Capacity of the BPF maps that fill up.",
            view.maps.iter().map(|m| (vec![("map", m.name.to_string())], m.capacity)),
        )?;
        let unwind = &view.unwind;
        gauges(
            e,
            "memprof_unwind_rows",
            "Rows of unwind tables in the kernel: used, idle (kept for the next process that maps their file, see --keep-unwind-tables), and free under --max-unwind-rows.",
            [
                (vec![("state", "used".to_string())], unwind.rows_used),
                (vec![("state", "idle".to_string())], unwind.rows_idle),
                (vec![("state", "free".to_string())], unwind.rows_free),
            ],
        )?;
        gauges(
            e,
            "memprof_unwind_kernel_bytes",
            "Kernel memory of the shards that hold the unwind tables' rows.",
            [(vec![], unwind.kernel_bytes)],
        )?;
        counters(
            e,
            "memprof_unwind_tables_built",
            "Unwind tables built, each read from its file: an idle table mapped again is not built again.",
            [(vec![], unwind.tables_built)],
        )?;
        counters(
            e,
            "memprof_unwind_tables_not_loaded",
            "Mapped files whose unwind table could not be loaded (no room, a shard refused, unreadable): their frames end stacks.",
            [(vec![], unwind.tables_not_loaded)],
        )?;
        counters(
            e,
            "memprof_unwind_deferred_walks",
            "Stack walks that met a file whose unwind table was not loaded yet, finished by memprof from a copy of the stack.",
            [(vec![], unwind.deferred_walks)],
        )?;
        counters(
            e,
            "memprof_unwind_deferred_unfinished",
            "Deferred stack walks that could not reach the outermost frame: their stacks are marked truncated.",
            [(vec![], unwind.deferred_unfinished)],
        )?;
        counters(
            e,
            "memprof_unwind_deferred_split",
            "Deferred stack walks whose allocation stack is counted under two ids: its high is the sum of both (an upper bound).",
            [(vec![], unwind.deferred_split)],
        )?;
        counters(
            e,
            "memprof_unwind_rows_not_loaded",
            "Rows the unwind tables that could not be loaded needed, where known.",
            [(vec![], unwind.rows_not_loaded)],
        )?;
        counters(
            e,
            "memprof_symbolization_failures",
            "Distinct addresses that got no function name, by reason.",
            view.symbolization_failures.iter().map(|(reason, n)| (vec![("reason", reason.to_string())], *n)),
        )?;
        let (cpu_seconds, resident_bytes) = own_usage();
        counters(e, "process_cpu_seconds", "CPU time memprof has used, user and system.", [(vec![], cpu_seconds)])?;
        gauges(e, "process_resident_memory_bytes", "memprof's resident memory.", [(vec![], resident_bytes)])?;
        Ok(())
    }
}

/// `memprof_allocation_size_bytes`: power-of-two buckets, counted in the kernel.
fn histograms(encoder: &mut DescriptorEncoder, targets: &[&TargetView], id: Identity) -> std::fmt::Result {
    let mut metric = encoder.encode_descriptor(
        "memprof_allocation_size_bytes",
        "Sizes of successful allocations, in power-of-two buckets.",
        None,
        MetricType::Histogram,
    )?;
    for t in targets {
        // Per-bucket counts: the encoder makes them cumulative.
        let counts = &t.sizes.buckets;
        let mut buckets: Vec<(f64, u64)> =
            counts.iter().take(HISTOGRAM_BUCKETS).enumerate().map(|(i, n)| ((1u64 << i) as f64, *n)).collect();
        buckets.push((f64::INFINITY, counts[HISTOGRAM_BUCKETS..].iter().sum()));
        let total: u64 = counts.iter().sum();
        let labels = id.process(t);
        metric.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
            t.report.totals.allocated_bytes as f64,
            total,
            &buckets,
            None,
        )?;
    }
    Ok(())
}

/// memprof's own CPU seconds and resident bytes, from /proc/self.
fn own_usage() -> (f64, f64) {
    let pid = std::process::id();
    let cpu = procfs::stat(pid).map_or(0.0, |s| s.cpu_ticks as f64 / procfs::clock_ticks_per_second());
    (cpu, procfs::resident_bytes(pid) as f64)
}

/// The HTTP listener's own series, from its counters.
#[derive(Debug)]
struct HttpCollector {
    stats: Arc<server::Stats>,
}

pub fn register_http(registry: &mut Registry, stats: Arc<server::Stats>) {
    registry.register_collector(Box::new(HttpCollector { stats }));
}

impl Collector for HttpCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let e = &mut encoder;
        let stats = &self.stats;
        let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
        counters(
            e,
            "memprof_http_connections",
            "Connections accepted by the HTTP listener.",
            [(vec![], load(&stats.accepted))],
        )?;
        gauges(e, "memprof_http_connections_open", "Connections open now.", [(vec![], load(&stats.open))])?;
        counters(
            e,
            "memprof_http_connections_queued",
            "Connections that found http.max_connections open and waited for one to close.",
            [(vec![], load(&stats.queued))],
        )?;
        counters(
            e,
            "memprof_http_refused",
            "Connections and requests the HTTP listener refused or cut off, by reason.",
            server::Refusal::ALL.iter().map(|r| (vec![("reason", r.name().to_string())], stats.refused(*r))),
        )
    }
}
