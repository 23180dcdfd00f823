//! Stack unwinding without frame pointers: per-file CFI tables for the kernel's stack walk, the
//! events that say a process mapped new code, and the walks the kernel left for memprof to finish.

mod copy;
mod deferred;
mod idle;
mod pacing;
mod reader;
mod registry;
pub(crate) use registry::load_segments;
mod shard_map;
mod shards;
mod share;
mod space;
pub mod table;

use aya::Ebpf;
use std::{
    collections::{HashMap, HashSet},
    os::fd::BorrowedFd,
    time::Duration,
};

pub use copy::DeferredCopy;
pub use deferred::Completion;
use profiler_common::LinkMapEvent;
pub use registry::{Registry, TableUse, UnwindMode, BPF_NOEXIST, KEEP_IDLE, MAX_KEEP_IDLE_SECONDS};

use crate::ring::Ring;
use pacing::Pacing;
pub use pacing::Reads;
use reader::{Reader, Record};

/// What the kernel tells of unwinding (`UNWIND_EVENTS`): processes whose dynamic linker reported
/// a change to their libraries (`mappings_changed`), and walks left to finish (`DeferredUnwind`).
pub struct UnwindEvents {
    reader: Reader,
    /// The dynamic linker's last list of objects of each process that sent one: load bias and
    /// path (see `process::link_map`). Kept across drains, until the process is forgotten: a
    /// process gone before memprof read its mappings is rebuilt from the last list it sent,
    /// whenever that came.
    objects: HashMap<u32, SentObjects>,
    /// When each process last exec'd (`bpf_ktime_get_ns`): a list or a walk its old program sent
    /// before, read after the exec, is not its new program's.
    execs: HashMap<u32, u64>,
    /// Read from the ring by `collect`, used by `drain`: in between, the exec events that came
    /// before them are handled (see `collect`). Walks handed out and not finished come back here
    /// too (`keep_for_next_drain`).
    pending: Vec<Pending>,
    /// When each process's mappings may be read again: its events wait in `pending` till then.
    pacing: Pacing,
}

/// An event read and not used yet.
enum Pending {
    LinkMap(Box<LinkMapEvent>),
    Deferred(DeferredCopy),
    /// Any other event: its process's mappings changed.
    Changed(u32),
}

impl Pending {
    fn tgid(&self) -> u32 {
        match self {
            Pending::LinkMap(event) => event.tgid,
            Pending::Deferred(copy) => copy.tgid(),
            Pending::Changed(tgid) => *tgid,
        }
    }
}

/// `held`, in order, less what a later event of its process makes useless while it waits: a
/// process loading libraries without pause would otherwise pile up lists. Its walks are kept;
/// of its lists only the last, which is the one `drain` would keep; a bare change only when
/// nothing else of its process is held.
fn compacted(held: Vec<Pending>) -> Vec<Pending> {
    let mut last_list = HashMap::new();
    let mut others = HashSet::new();
    for (at, event) in held.iter().enumerate() {
        match event {
            Pending::LinkMap(event) => {
                last_list.insert(event.tgid, at);
                others.insert(event.tgid);
            }
            Pending::Deferred(copy) => {
                others.insert(copy.tgid());
            }
            Pending::Changed(_) => {}
        }
    }
    let mut changed_kept = HashSet::new();
    let mut keep = |at: usize, event: &Pending| match event {
        Pending::LinkMap(event) => last_list.get(&event.tgid) == Some(&at),
        Pending::Deferred(_) => true,
        Pending::Changed(tgid) => !others.contains(tgid) && changed_kept.insert(*tgid),
    };
    held.into_iter().enumerate().filter(|(at, event)| keep(*at, event)).map(|(_, event)| event).collect()
}

/// Whether an event `tgid` sent at `time_ns` comes from the program it runs now (`execs`: see
/// `UnwindEvents::execs`).
fn sent_by_current_program(execs: &HashMap<u32, u64>, tgid: u32, time_ns: u64) -> bool {
    execs.get(&tgid).is_none_or(|&exec_ns| time_ns >= exec_ns)
}

/// A list of objects a process's dynamic linker sent, and when.
struct SentObjects {
    time_ns: u64,
    objects: Vec<(u64, String)>,
}

/// The events read at once.
#[derive(Default)]
pub struct Drained {
    /// Processes to read the mappings of, each once: those whose libraries changed and those
    /// with a deferred walk.
    pub pids: Vec<u32>,
    pub deferred: Vec<DeferredCopy>,
}

impl UnwindEvents {
    pub fn new(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let map = ebpf.take_map("UNWIND_EVENTS").ok_or_else(|| anyhow::anyhow!("map UNWIND_EVENTS missing"))?;
        let reader = Reader::start(Ring::new("UNWIND_EVENTS", map)?)?;
        Ok(Self {
            reader,
            objects: HashMap::new(),
            execs: HashMap::new(),
            pending: Vec::new(),
            pacing: Pacing::default(),
        })
    }

    /// Takes the events read so far (see `reader::Reader`), to be used by the next `drain`.
    /// Called before the exec events are handled: an exec's event is in its ring before its new
    /// program can send any of these, so every exec that came before one taken here is known when
    /// `drain` uses it. Taken after them, a new program's list could meet its process before its
    /// exec, and be named after the old program.
    pub fn collect(&mut self) {
        for record in self.reader.take() {
            let event = match record {
                Record::Deferred(copy) => Pending::Deferred(copy),
                Record::Other(item) if item.len() == size_of::<LinkMapEvent>() => {
                    // SAFETY: the program writes whole records; read_unaligned copes with any
                    // alignment.
                    Pending::LinkMap(Box::new(unsafe {
                        std::ptr::read_unaligned(item.as_ptr().cast::<LinkMapEvent>())
                    }))
                }
                other => match other.tgid() {
                    Some(tgid) => Pending::Changed(tgid),
                    None => continue,
                },
            };
            self.pending.push(event);
        }
    }

    /// The events `collect` read, less those an exec since made the old program's: those of
    /// processes whose mappings may be read at `now_ns` (see `pacing`), or every one.
    pub fn drain(&mut self, now_ns: u64, reads: Reads) -> Drained {
        let mut drained = Drained::default();
        let (due, held): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|event| reads == Reads::Every || self.pacing.due(event.tgid(), now_ns));
        self.pending = compacted(held);
        for event in due {
            let tgid = match event {
                Pending::LinkMap(event) => {
                    if sent_by_current_program(&self.execs, event.tgid, event.time_ns) {
                        let objects = event.objects.iter().take(event.count as usize).map(|object| {
                            let name = object.name.split(|&b| b == 0).next().unwrap_or_default();
                            (object.base, String::from_utf8_lossy(name).into_owned())
                        });
                        let sent = SentObjects { time_ns: event.time_ns, objects: objects.collect() };
                        self.objects.insert(event.tgid, sent);
                    }
                    event.tgid
                }
                Pending::Deferred(copy) => {
                    if !sent_by_current_program(&self.execs, copy.tgid(), copy.time_ns()) {
                        // The old program's stacks went at the exec: its walk is not finished,
                        // nor counted in the new program's drops.
                        continue;
                    }
                    let tgid = copy.tgid();
                    drained.deferred.push(copy);
                    tgid
                }
                Pending::Changed(tgid) => tgid,
            };
            if !drained.pids.contains(&tgid) {
                drained.pids.push(tgid);
            }
        }
        drained
    }

    /// The walks of `tgid` that `collect` read and `drain` has not given out, taken out: to be
    /// finished when its mappings are synced otherwise than after a `drain`. Those its old
    /// program sent before an exec are dropped, as `drain` drops them.
    pub fn take_deferred(&mut self, tgid: u32) -> Vec<DeferredCopy> {
        let (taken, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|event| matches!(event, Pending::Deferred(copy) if copy.tgid() == tgid));
        self.pending = kept;
        let execs = &self.execs;
        taken
            .into_iter()
            .filter_map(|event| match event {
                Pending::Deferred(copy) if sent_by_current_program(execs, tgid, copy.time_ns()) => Some(copy),
                _ => None,
            })
            .collect()
    }

    /// The walks of `tgid` still in the ring, or read from it and not collected, taken out: to be
    /// finished on the mapping list about to be given to the kernel (see
    /// `kernel::early_stacks`). Those its old program sent before an exec memprof knows of are
    /// dropped, as `drain` drops them (an exec is known from its event on: see
    /// `kernel::Loaded::exec_seen`). Those the list cannot finish go back (`return_to_reader`).
    pub fn take_uncollected_walks(&mut self, tgid: u32) -> Vec<DeferredCopy> {
        let mut walks = self.reader.take_walks_of(tgid);
        walks.retain(|copy| sent_by_current_program(&self.execs, tgid, copy.time_ns()));
        walks
    }

    /// Walks taken by `take_uncollected_walks` and not finished, back in the reader: collected
    /// with the records read before them (see `reader::Reader::put_back`).
    pub fn return_to_reader(&mut self, walks: Vec<DeferredCopy>) {
        self.reader.put_back(walks);
    }

    /// Walks `drain` or `take_deferred` gave out and not finished, for the next `drain`.
    pub fn keep_for_next_drain(&mut self, walks: Vec<DeferredCopy>) {
        self.pending.extend(walks.into_iter().map(Pending::Deferred));
    }

    /// `tgid`'s mappings were read from `started_ns` for `took`: its next events wait their gap.
    pub fn mappings_read(&mut self, tgid: u32, started_ns: u64, took: Duration) {
        self.pacing.read(tgid, started_ns, took);
    }

    /// When the first event held back for its process's gap may be drained.
    pub fn next_due_ns(&self) -> Option<u64> {
        self.pacing.next_due_ns(self.pending.iter().map(Pending::tgid))
    }

    /// The last list of objects `tgid`'s dynamic linker sent.
    pub fn objects(&self, tgid: u32) -> Option<&[(u64, String)]> {
        self.objects.get(&tgid).map(|sent| sent.objects.as_slice())
    }

    /// Drops the list of a process forgotten.
    pub fn forget(&mut self, tgid: u32) {
        self.objects.remove(&tgid);
        self.execs.remove(&tgid);
        self.pacing.forget(tgid);
    }

    /// Drops the events not used yet, read or not, of processes let go (exited, or no longer
    /// traced): no report of theirs is left to finish their walks for. Finished after they are
    /// forgotten, on no list, each would be counted unfinished, and kept, for nothing.
    pub fn drop_events_of(&mut self, gone: &HashSet<u32>) {
        self.pending.retain(|event| !gone.contains(&event.tgid()));
        self.reader.drop_records_of(gone);
    }

    /// The events of `pids` may be drained now, whenever their mappings were last read.
    pub fn make_due(&mut self, pids: &[u32]) {
        for &pid in pids {
            self.pacing.forget(pid);
        }
    }

    /// Process `tgid` exec'd at `time_ns`: the list its old program sent is not its new one's,
    /// nor are the lists and walks its old program sent and still unread.
    pub fn exec_happened(&mut self, tgid: u32, time_ns: u64) {
        if self.objects.get(&tgid).is_some_and(|sent| sent.time_ns < time_ns) {
            self.objects.remove(&tgid);
        }
        self.execs.insert(tgid, time_ns);
    }

    /// Readable while events wait to be collected: for waiting with poll or an async reactor.
    pub fn bell(&self) -> BorrowedFd<'_> {
        self.reader.bell()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(tgid: u32, time_ns: u64) -> Pending {
        // SAFETY: a plain-data record, all zeros a valid empty list.
        let mut event: LinkMapEvent = unsafe { std::mem::zeroed() };
        (event.tgid, event.time_ns) = (tgid, time_ns);
        Pending::LinkMap(Box::new(event))
    }

    #[test]
    fn a_held_process_keeps_its_last_list_and_a_bare_change_only_alone() {
        let held = vec![list(1, 10), Pending::Changed(1), Pending::Changed(2), list(1, 20), Pending::Changed(2)];
        let kept: Vec<(u32, Option<u64>)> = compacted(held)
            .iter()
            .map(|event| match event {
                Pending::LinkMap(event) => (event.tgid, Some(event.time_ns)),
                other => (other.tgid(), None),
            })
            .collect();
        assert_eq!(kept, [(2, None), (1, Some(20))]);
    }
}
