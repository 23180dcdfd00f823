//! The embedded eBPF object: loading it with the chosen map sizes (here), attaching a process's
//! probes (`attach`), and what its maps hold of each traced process (`tracked`).

mod attach;
mod own_probes;
mod probe_thread;
mod tracked;
pub use crate::unwind::Reads;
mod usdt;

use std::{
    collections::{HashMap, HashSet},
    fs,
    path::Path,
};

use anyhow::Context as _;
use aya::{Ebpf, EbpfLoader};

pub use crate::kernel::probes::Attachment;
use crate::{
    error::UserError,
    kernel::ages::{AgeBook, Clock},
    kernel::btf,
    kernel::detacher::Detacher,
    kernel::events::{self, ProcessEvents},
    kernel::faults,
    kernel::map_memory,
    kernel::mappings::MappedRanges,
    kernel::probe_threads::ProbeThreads,
    kernel::probes::{self, Method},
    kernel::settings::LoadSettings,
    kernel::shared::{ProbeLinks, SharedLinks},
    kernel::stillness::Stillness,
    process::memory,
    unwind::{Registry, UnwindEvents},
};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler-ebpf"));

/// Says what the maps take and can grow to, and warns when that is more than memprof's memory
/// cgroup (or the host) leaves it: the kernel would OOM-kill memprof once they fill.
fn say_room_for_maps(unwind: &Registry) {
    let maps = map_memory::own_maps();
    let growth = maps.growth_bytes + unwind.kernel_growth_bytes();
    let full = maps.now_bytes + growth;
    tracing::info!(
        "BPF maps: {} MiB of kernel memory, up to {} MiB once full at these sizes",
        maps.now_bytes >> 20,
        full >> 20
    );
    let room = memory::room();
    if growth > room.bytes {
        tracing::warn!(
            "memprof's BPF maps take {} MiB of kernel memory and can grow to {} MiB as traced processes fill them, more than the {room}: the kernel would OOM-kill memprof then; raise the limit, or lower --max-live, --max-stacks and --max-unwind-rows (docs: reference/limits.md#kernel-memory)",
            maps.now_bytes >> 20,
            full >> 20
        );
    }
}

/// What the kernel's verifier takes at once while it checks one of memprof's largest programs,
/// beyond what memprof holds once its maps are made, with room to spare. The verifier charges it
/// to memprof's memory cgroup on Linux 6.17 and later (`verifier_charged`), and a hard limit short
/// of it has the kernel OOM-kill memprof, with nothing said. The same for every command, option
/// and map size, since the programs are verified one at a time; measured on Linux 6.18 only
/// (docs: reference/limits.md#the-verifiers-memory).
const VERIFIER_BYTES: u64 = 64 << 20;

/// What memprof takes of its memory cgroup before its maps are made, with room to spare: its
/// code, its heap, and the kernel's BTF, read for the fields its programs read (measured on Linux
/// 6.18, docs: reference/limits.md#the-verifiers-memory).
const START_BYTES: u64 = 32 << 20;

/// Refuses, in one line, to load programs the kernel's verifier would need more memory for than
/// memprof's memory cgroup leaves it (`VERIFIER_BYTES`).
fn room_to_verify() -> Result<(), UserError> {
    match memory::hard_limit() {
        Some(limit) if verifier_charged() && limit.room < VERIFIER_BYTES => Err(no_room_to_verify(limit)),
        _ => Ok(()),
    }
}

fn no_room_to_verify(limit: memory::HardLimit) -> UserError {
    UserError::NoRoomToVerify {
        need_mib: VERIFIER_BYTES >> 20,
        room_mib: limit.room >> 20,
        short_mib: VERIFIER_BYTES.saturating_sub(limit.room).div_ceil(1 << 20),
        cgroup: limit.cgroup,
        file: limit.file,
    }
}

/// Why the maps could not be made, or not even begun (`START_BYTES`), under memprof's memory
/// cgroup's limit, said from the room it left at start (`limit`): where the verifier charges the
/// cgroup and will need more than that room, smaller maps would not make room, and their flags
/// are not named.
fn maps_out_of_memory(limit: Option<memory::HardLimit>) -> UserError {
    match limit {
        Some(limit) if verifier_charged() && limit.room < VERIFIER_BYTES => no_room_to_verify(limit),
        _ => UserError::MapsOutOfMemory,
    }
}

/// Whether the kernel charges its verifier's memory to the cgroup of the process loading a
/// program: since Linux 6.17 ("bpf: include verifier memory allocations in memcg statistics").
/// Before, only the maps and the programs themselves are charged; a kernel whose version cannot
/// be read is taken to charge it.
fn verifier_charged() -> bool {
    use aya::util::KernelVersion;
    KernelVersion::current().map_or(true, |version| version >= KernelVersion::new(6, 17, 0))
}

/// Loaded programs and maps; what is attached to each process is its `Attachment`.
pub struct Loaded {
    pub ebpf: Ebpf,
    /// How the programs attach: uprobe_multi links, or perf-event uprobes where the kernel lacks them.
    method: Method,
    /// The unwind tables of the traced processes' files.
    pub unwind: Registry,
    /// Processes that loaded or unloaded libraries, and walks left to finish.
    pub unwind_events: UnwindEvents,
    /// What userspace keeps of the ages of outstanding memory.
    pub ages: AgeBook,
    /// Execs and forks of the traced processes.
    pub process_events: ProcessEvents,
    /// The anonymous memory they map outside their allocator's blocks (with `--mappings`), and
    /// the pages they touch (`--growth`).
    mappings: Option<MappedRanges>,
    /// Whether processes are traced by their page faults instead of their allocator calls
    /// (`--growth`, see `trace_page_faults`).
    growth: bool,
    /// Processes moved to their pages since they were attached (`switch_to_pages`): they stay
    /// so through an exec.
    moved_to_pages: HashSet<u32>,
    /// The page-fault program is loaded, for `--growth` or a process switched to it.
    faults_loaded: bool,
    /// The links of the programs at every page fault and page allocation on the machine, while
    /// a process is traced by its pages (see `rest_page_faults`).
    machine_wide_faults: Option<faults::MachineWideLinks>,
    /// `--mappings`: the mapping calls' programs stay attached while memprof runs.
    mappings_asked: bool,
    /// Processes traced by their pages whose mapping calls the programs for every process read
    /// (none of their own probes do): those programs rest once none is left (see
    /// `rest_unneeded_mapping_programs`).
    read_machine_wide: HashSet<u32>,
    /// Which processes share links with every traced process that maps the same file, rather
    /// than get links of their own (see `shared`).
    shared: SharedLinks,
    /// Detaches the probes of processes that exited.
    detacher: Option<Detacher>,
    /// The processes traced through their allocator's `otel_memory` probes (`--usdt`).
    usdt: usdt::UsdtProbes,
    /// The thread each process's perf-event uprobes are opened on.
    probe_threads: ProbeThreads,
    /// Which processes did nothing since the last interval.
    stillness: Stillness,
    /// The entries of `LIVE` and `STACK_STATS` at the last walk of the maps, while no process
    /// has been purged since: a read of no process then needs no walk.
    walked_entries: Option<(u64, u64)>,
    /// The entries of `STACKS` and `FREE_STACKS` (see `stack_entries`) since the last walk.
    stack_entries: Option<(u64, u64)>,
    /// Processes let go whose entries are still in the maps (see `forget_exited_later`).
    unpurged: HashSet<u32>,
    /// When each process's allocator probes were last all put in place, or moved to another
    /// thread (CLOCK_MONOTONIC; see `double_free_seen_whole`).
    probed_since: HashMap<u32, u64>,
}

/// Checks what loading needs before trying, so the error can say what is missing.
pub fn check_support() -> Result<(), UserError> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(UserError::KernelSupport("BTF (/sys/kernel/btf/vmlinux)"));
    }
    if !Path::new("/sys/bus/event_source/devices/uprobe").exists() {
        return Err(UserError::KernelSupport("the uprobe perf event source"));
    }
    check_privileges()
}

/// The capabilities memprof needs, each with what it is for (docs: install.md#permissions), as numbered
/// in linux/capability.h. CAP_SYS_ADMIN is needed for uprobes on current kernels, and the kernel
/// lets it stand for CAP_BPF and CAP_PERFMON too (`bpf_capable`, `perfmon_capable`), so those
/// add nothing. Each one was checked to be needed: without it a step fails, or a file is skipped.
const NEEDED: [(u32, &str); 3] = [
    (21, "CAP_SYS_ADMIN (BPF programs, uprobes, /proc/PID/map_files)"),
    (19, "CAP_SYS_PTRACE (other users' processes' maps, memory and files in /proc)"),
    (2, "CAP_DAC_READ_SEARCH (a process's executable and libraries where only their owner may read them)"),
];

fn check_privileges() -> Result<(), UserError> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    let missing: Vec<&str> =
        NEEDED.iter().filter(|(bit, _)| effective & (1 << bit) == 0).map(|(_, name)| *name).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(UserError::Privileges { missing: missing.join(" and ") })
    }
}

/// Which processes are traced through their allocator's own sampler (`--usdt`): the weights of
/// their live samples take a table sized for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Samplers {
    /// Go programs only (without cgo, or with it beside its calls): a sixteenth of `LIVE`, as
    /// each sample stands for far more than a block (512 KiB at Go's default rate).
    Some,
    /// Every process (`--usdt`): as large as `LIVE`.
    Every,
}

impl Samplers {
    fn weights_capacity(self, max_live: u32) -> u32 {
        match self {
            Samplers::Some => (max_live / 16).max(1),
            Samplers::Every => max_live,
        }
    }
}

/// The addresses an inspection notes at most while it lists the process's blocks (see
/// `live_watch`): past that it reads the whole of `LIVE` again in the stop. The listing, and so
/// the changes, grow with `LIVE`; the set takes memory only while an inspection fills it.
fn live_changes_capacity(max_live: u32) -> u32 {
    (max_live / 64).clamp(1024, 65_536)
}

/// The way from a task to its cgroup's id, `task->cgroups->dfl_cgrp->kn->id`, as offsets (see
/// `TASK_CGROUP_ID_WAY`); zeros where the kernel's BTF does not tell it: forks are then reported
/// whatever their cgroup.
fn task_cgroup_id_way(btf: &btf::KernelBtf) -> [u32; 4] {
    let steps = [("task_struct", "cgroups"), ("css_set", "dfl_cgrp"), ("cgroup", "kn"), ("kernfs_node", "id")];
    let mut way = [0; 4];
    for (offset, (structure, member)) in way.iter_mut().zip(steps) {
        match btf.member_offsets(structure, &[member]) {
            Ok(found) => *offset = found[0],
            Err(_) => return [0; 4],
        }
    }
    way
}

/// Loads the programs; ages are kept in generations of a quarter of `interval_s` (see `ages`).
/// `links_wanted` false: perf-event uprobes, not uprobe_multi links (see `probes::load`).
pub fn load(sizes: LoadSettings, interval_s: f64, samplers: Samplers, links_wanted: bool) -> anyhow::Result<Loaded> {
    // Under a limit that leaves memprof too little to reach its maps, the kernel would OOM-kill it
    // before they could be refused.
    let room_at_start = memory::hard_limit();
    if let Some(limit) = room_at_start.clone().filter(|limit| limit.room < START_BYTES) {
        return Err(maps_out_of_memory(Some(limit)).into());
    }
    let clock = Clock::for_interval(crate::kernel::aggregate::monotonic_now_ns(), interval_s);
    let btf = btf::KernelBtf::read().context("reading the kernel's BTF")?;
    let task = btf
        .member_offsets("task_struct", &["pid", "tgid", "mm", "utask", "signal"])
        .context("finding task_struct in BTF")?;
    // Whether a thread exits with its whole process (see `probe_threads`).
    let signal = btf.member_offsets("signal_struct", &["flags"]).context("finding signal_struct in BTF")?;
    let exec_task = btf.member_offsets("signal_struct", &["group_exec_task"]).map_or(0, |offsets| offsets[0]);
    // The return addresses uretprobes took: task->utask->return_instances, a list.
    let utask = btf.member_offsets("uprobe_task", &["return_instances"]).context("finding uprobe_task in BTF")?;
    let taken = btf
        .member_offsets("return_instance", &["orig_ret_vaddr", "chained", "next", "stack"])
        .context("finding return_instance in BTF")?;
    // The way to a process's uretprobe trampoline: task->mm->uprobes_state.xol_area->vaddr.
    let mm = btf.member_offsets("mm_struct", &["uprobes_state"]).context("finding mm_struct in BTF")?;
    let uprobes = btf.member_offsets("uprobes_state", &["xol_area"]).context("finding uprobes_state in BTF")?;
    let xol = btf.member_offsets("xol_area", &["vaddr"]).context("finding xol_area in BTF")?;
    // The path an exec ran (see `ProcessEvent::path`); without it, an exec'd program is named
    // from `/proc` only.
    let bprm = btf.member_offsets("linux_binprm", &["filename"]).map_or(0, |offsets| offsets[0]);
    let cgroup_id_way = task_cgroup_id_way(&btf);
    // Where growth mode finds a large folio's mapping (see `mapped_at`); without it, a folio
    // whose fault's code was lost counts one page.
    let folio = btf.member_offsets("folio", &["mapping", "index"]).unwrap_or_else(|_| vec![0, 0]);
    // Not held while the kernel verifies the programs, memprof's largest moment.
    drop(btf);
    let ebpf = EbpfLoader::new()
        .map_max_entries("LIVE", sizes.max_live)
        .map_max_entries("USDT_WEIGHTS", samplers.weights_capacity(sizes.max_live))
        .map_max_entries("LIVE_CHANGES", live_changes_capacity(sizes.max_live))
        .map_max_entries("STACKS", sizes.max_stacks)
        .map_max_entries("FREE_STACKS", FREE_STACKS)
        .map_max_entries("STACK_STATS", stack_stats_capacity(sizes))
        .map_max_entries("UNWIND_SHARDS", sizes.max_unwind_rows.div_ceil(profiler_common::UNWIND_SHARD_ROWS))
        .override_global("FRAME_LIMIT", &sizes.max_frames, true)
        .override_global("FULL_FREE_STACKS", &u32::from(sizes.full_free_stacks), true)
        .override_global("CLOCK_BASE_NS", &clock.base_ns, true)
        .override_global("GENERATION_NS", &clock.length_ns, true)
        .override_global("TASK_PID_OFFSET", &task[0], true)
        .override_global("TASK_TGID_OFFSET", &task[1], true)
        .override_global("BPRM_FILENAME_OFFSET", &bprm, true)
        .override_global("TASK_CGROUP_ID_WAY", &cgroup_id_way, true)
        .override_global("FOLIO_MAPPING_OFFSET", &folio[0], true)
        .override_global("FOLIO_INDEX_OFFSET", &folio[1], true)
        .override_global("TASK_SIGNAL_OFFSET", &task[4], true)
        .override_global("SIGNAL_FLAGS_OFFSET", &signal[0], true)
        .override_global("SIGNAL_EXEC_TASK_OFFSET", &exec_task, true)
        .override_global("TASK_MM_OFFSET", &task[2], true)
        .override_global("MM_XOL_AREA_OFFSET", &(mm[0] + uprobes[0]), true)
        .override_global("XOL_AREA_VADDR_OFFSET", &xol[0], true)
        .override_global("TASK_UTASK_OFFSET", &task[3], true)
        .override_global("UTASK_RETURNS_OFFSET", &utask[0], true)
        .override_global("RETURN_ADDRESS_OFFSET", &taken[0], true)
        .override_global("RETURN_CHAINED_OFFSET", &taken[1], true)
        .override_global("RETURN_NEXT_OFFSET", &taken[2], true)
        .override_global("RETURN_STACK_OFFSET", &taken[3], true)
        .load(OBJECT)
        .map_err(|err| {
            let err = anyhow::Error::new(err).context("loading the eBPF programs");
            if out_of_memory(&err) {
                err.context(maps_out_of_memory(room_at_start))
            } else {
                err
            }
        })?;
    let mut ebpf = ebpf;
    // The maps are made and charged: what the verifier takes comes on top, program by program.
    room_to_verify()?;
    let unwind = Registry::new(&mut ebpf, sizes.unwind, sizes.max_unwind_rows, sizes.max_frames)?;
    let unwind_events = UnwindEvents::new(&mut ebpf)?;
    let method = probes::load(&mut ebpf, links_wanted)?;
    let process_events = events::attach(&mut ebpf)?;
    // Only when asked for: the programs run at every mapping call on the host.
    let mappings = if sizes.mappings {
        let mut mappings = MappedRanges::load(&mut ebpf)?;
        mappings.wake(&mut ebpf)?;
        Some(mappings)
    } else {
        None
    };
    say_room_for_maps(&unwind);
    Ok(Loaded {
        ebpf,
        method,
        unwind,
        unwind_events,
        ages: AgeBook::new(clock),
        process_events,
        mappings,
        growth: false,
        moved_to_pages: HashSet::new(),
        faults_loaded: false,
        machine_wide_faults: None,
        mappings_asked: sizes.mappings,
        read_machine_wide: HashSet::new(),
        shared: SharedLinks::new(ProbeLinks::PerProcess),
        detacher: Some(Detacher::spawn().context("starting the detacher thread")?),
        usdt: usdt::UsdtProbes::default(),
        probe_threads: ProbeThreads::default(),
        stillness: Stillness::default(),
        walked_entries: None,
        stack_entries: None,
        unpurged: HashSet::new(),
        probed_since: HashMap::new(),
    })
}

/// Capacity of `TRACED`, the processes whose execs and forks are reported (the eBPF default).
pub const TRACED_CAPACITY: u32 = 4_096;

/// Capacity of `FREE_STACKS`, where free sites' stacks are kept for double-free reports.
pub const FREE_STACKS: u32 = 16_384;

/// One totals row per (process, stack): as many as stacks, with room for stacks shared by processes.
pub fn stack_stats_capacity(sizes: LoadSettings) -> u32 {
    sizes.max_stacks.saturating_mul(2)
}

/// Whether the kernel refused memory somewhere in `err`'s chain (ENOMEM): a memory cgroup's
/// limit, most likely, as the maps are charged to the cgroup of the process that makes them.
fn out_of_memory(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|cause| cause.downcast_ref::<std::io::Error>().is_some_and(|io| io.raw_os_error() == Some(libc::ENOMEM)))
}
