//! Stack unwinding without frame pointers: per-file CFI tables for the kernel's stack walk, the
//! events that say a process mapped new code, and the walks the kernel left for memprof to finish.

mod copy;
mod deferred;
mod reader;
mod registry;
pub(crate) use registry::load_segments;
mod shard_map;
mod shards;
mod share;
mod space;
pub mod table;

use aya::Ebpf;
use std::{collections::HashMap, os::fd::BorrowedFd};

pub use copy::DeferredCopy;
use profiler_common::LinkMapEvent;
pub use registry::{Registry, TableUse, UnwindMode};

use crate::ring::Ring;
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
    /// before them are handled (see `collect`).
    pending: Vec<Pending>,
}

/// An event read and not used yet.
enum Pending {
    LinkMap(Box<LinkMapEvent>),
    Deferred(DeferredCopy),
    /// Any other event: its process's mappings changed.
    Changed(u32),
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
        Ok(Self { reader, objects: HashMap::new(), execs: HashMap::new(), pending: Vec::new() })
    }

    /// Takes the events read so far (see `reader::Reader`), to be used by the next `drain`.
    /// Called before the exec events are handled: an exec's event is in its ring before its new
    /// program can send any of these, so every exec that came before one taken here is known when
    /// `drain` uses it. Taken after them, a new program's list could meet its process before its
    /// exec, and be named after the old program.
    pub fn collect(&mut self) {
        for record in self.reader.take() {
            let item = match record {
                Record::Deferred(copy) => {
                    self.pending.push(Pending::Deferred(copy));
                    continue;
                }
                Record::Other(item) => item,
            };
            let event = if item.len() == size_of::<LinkMapEvent>() {
                // SAFETY: the program writes whole records; read_unaligned copes with any
                // alignment.
                Pending::LinkMap(Box::new(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<LinkMapEvent>()) }))
            } else if let Some(bytes) = item.get(..4) {
                Pending::Changed(u32::from_ne_bytes(bytes.try_into().expect("four bytes")))
            } else {
                continue;
            };
            self.pending.push(event);
        }
    }

    /// The events `collect` read, less those an exec since made the old program's.
    pub fn drain(&mut self) -> Drained {
        let mut drained = Drained::default();
        for event in std::mem::take(&mut self.pending) {
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

    /// The last list of objects `tgid`'s dynamic linker sent.
    pub fn objects(&self, tgid: u32) -> Option<&[(u64, String)]> {
        self.objects.get(&tgid).map(|sent| sent.objects.as_slice())
    }

    /// Drops the list of a process that exited.
    pub fn forget(&mut self, tgid: u32) {
        self.objects.remove(&tgid);
        self.execs.remove(&tgid);
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
