//! `UNWIND_EVENTS` read on a thread of its own, into memory. While memprof's loop is busy (a
//! large library's table takes tens of milliseconds to build, a chain of execs more), a program
//! starting meanwhile defers a walk, a copy of up to 32 KiB of its stack, for each new stack. The
//! ring holds about 500 of them (1,000 of stacks that end within 4 pages); a walk that finds it
//! full is lost (`deferred_walk_lost`). Read as they come, they wait here instead, each cut to the
//! stack it copied (`DeferredCopy`), up to `HELD_BYTES`; only past that does the ring fill again.
//! Walks taken out early (`take_walks_of`) and not used come back (`put_back`), possibly past it.

use std::{
    collections::HashSet,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    thread::JoinHandle,
};

use super::DeferredCopy;
use crate::{bell::Bell, process::memory, ring::Ring};

/// At most this much read by the thread and not yet taken, or a quarter of the memory memprof may
/// still take when that is less: 4,000 deferred walks of 32 KiB, more of shallower stacks.
/// LLVM's constructors, dlopened, defer a walk for each of about 3,500 stacks; python's start-up
/// under pyenv's shims 490 to 3,788 (BENCHMARKS.md). `take` reads the rest of the ring besides.
const HELD_BYTES: u64 = 128 << 20;

/// A record of the ring, as held.
pub enum Record {
    Deferred(DeferredCopy),
    /// Any other, whole.
    Other(Box<[u8]>),
}

impl Record {
    /// The process that sent it: a walk names it in a field of its own, every other record
    /// starts with it.
    pub fn tgid(&self) -> Option<u32> {
        match self {
            Record::Deferred(copy) => Some(copy.tgid()),
            Record::Other(bytes) => Some(u32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?)),
        }
    }

    fn into_walk(self) -> Option<DeferredCopy> {
        match self {
            Record::Deferred(copy) => Some(copy),
            Record::Other(_) => None,
        }
    }

    fn len(&self) -> usize {
        match self {
            Record::Deferred(copy) => copy.len(),
            Record::Other(bytes) => bytes.len(),
        }
    }
}

/// The ring's records read so far, and their bytes.
#[derive(Default)]
struct Held {
    records: Vec<Record>,
    bytes: u64,
}

impl Held {
    /// Reads the ring's records into `self` until it holds `limit` bytes.
    fn read(&mut self, events: &mut Ring, limit: u64) {
        events.read_while(|record| {
            let held = DeferredCopy::of(record).map_or_else(|| Record::Other(record.into()), Record::Deferred);
            self.bytes += held.len() as u64;
            self.records.push(held);
            self.bytes < limit
        });
    }
}

/// The ring, and what was read from it: one lock, so that `take` finds every record committed
/// before it (the final report needs the walks deferred just before it, and those its syncs
/// put back).
struct Reading {
    events: Ring,
    held: Held,
}

struct Shared {
    reading: Mutex<Reading>,
    /// Notified when records are taken, or the thread must stop: a full thread waits on it.
    taken: Condvar,
    stop: AtomicBool,
    /// Readable while records wait: what the loop polls instead of the ring.
    bell: Bell,
    /// Rung once the thread must stop: it polls it beside the ring.
    stop_bell: Bell,
}

impl Shared {
    fn reading(&self) -> MutexGuard<'_, Reading> {
        self.reading.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The reading thread; stopped and joined when dropped.
pub struct Reader {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Reader {
    pub fn start(events: Ring) -> io::Result<Self> {
        let (bell, stop_bell) = (Bell::new()?, Bell::new()?);
        let ring_fd = events.as_fd().as_raw_fd();
        let shared = Arc::new(Shared {
            reading: Mutex::new(Reading { events, held: Held::default() }),
            taken: Condvar::new(),
            stop: AtomicBool::new(false),
            bell,
            stop_bell,
        });
        let limit = HELD_BYTES.min(memory::room().bytes / 4);
        let thread = std::thread::Builder::new().name("unwind-events".into()).spawn({
            let shared = Arc::clone(&shared);
            move || read_until_stopped(ring_fd, &shared, limit)
        })?;
        Ok(Self { shared, thread: Some(thread) })
    }

    /// Every record committed so far, in the ring's order: those the thread read, then the
    /// rest of the ring, whatever the limit.
    pub fn take(&self) -> Vec<Record> {
        // The bell first: records read after it ring it again.
        self.shared.bell.clear();
        let mut reading = self.shared.reading();
        let Reading { events, held } = &mut *reading;
        held.read(events, u64::MAX);
        let records = std::mem::take(held).records;
        self.shared.taken.notify_one();
        records
    }

    /// The walks process `tgid` deferred, committed so far, taken out; the other records stay, in
    /// order, for `take`.
    pub fn take_walks_of(&self, tgid: u32) -> Vec<DeferredCopy> {
        let picked = self.take_picked(|record| matches!(record, Record::Deferred(copy) if copy.tgid() == tgid));
        picked.into_iter().filter_map(Record::into_walk).collect()
    }

    /// The records committed so far of the processes in `gone`, dropped.
    pub fn drop_records_of(&self, gone: &HashSet<u32>) {
        self.take_picked(|record| record.tgid().is_some_and(|tgid| gone.contains(&tgid)));
    }

    /// The records committed so far that `pick` picks, taken out in order; the others stay, in
    /// order, for `take`.
    fn take_picked(&self, pick: impl Fn(&Record) -> bool) -> Vec<Record> {
        let mut reading = self.shared.reading();
        let Reading { events, held } = &mut *reading;
        held.read(events, u64::MAX);
        let (picked, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut held.records).into_iter().partition(pick);
        held.records = kept;
        held.bytes -= picked.iter().map(|record| record.len() as u64).sum::<u64>();
        // The ring was read to its end here: the thread may find nothing to ring for what is
        // left.
        if !held.records.is_empty() {
            self.shared.bell.ring();
        }
        self.shared.taken.notify_one();
        picked
    }

    /// Walks `take_walks_of` took and did not use, back after the records held: read with them
    /// at the next `take`, and so after any record of their process that came before them (its
    /// dynamic linker's list of objects, which a walk of a process gone needs).
    pub fn put_back(&self, walks: Vec<DeferredCopy>) {
        if walks.is_empty() {
            return;
        }
        let mut reading = self.shared.reading();
        reading.held.bytes += walks.iter().map(|copy| copy.len() as u64).sum::<u64>();
        reading.held.records.extend(walks.into_iter().map(Record::Deferred));
        self.shared.bell.ring();
    }

    /// Readable while records wait to be taken.
    pub fn bell(&self) -> BorrowedFd<'_> {
        self.shared.bell.as_fd()
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        {
            // Under the lock: a full thread tests `stop` under it before it waits.
            let _reading = self.shared.reading();
            self.shared.stop.store(true, Ordering::Relaxed);
            self.shared.taken.notify_one();
        }
        self.shared.stop_bell.ring();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Reads the ring (`ring_fd`, which `shared` holds open) as records come, until dropped.
fn read_until_stopped(ring_fd: RawFd, shared: &Shared, limit: u64) {
    while !shared.stop.load(Ordering::Relaxed) {
        {
            let reading = shared.reading();
            if reading.held.bytes >= limit {
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                // Full: the ring fills meanwhile, and the programs count what it cannot take.
                drop(shared.taken.wait(reading));
                continue;
            }
        }
        let mut ready = [ring_fd, shared.stop_bell.as_fd().as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: a live array of two pollfds.
        unsafe { libc::poll(ready.as_mut_ptr(), 2, -1) };
        let mut reading = shared.reading();
        let Reading { events, held } = &mut *reading;
        let before = held.records.len();
        held.read(events, limit);
        let read = held.records.len() > before;
        drop(reading);
        if read {
            shared.bell.ring();
        }
    }
}
