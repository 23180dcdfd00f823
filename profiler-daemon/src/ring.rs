//! A BPF ring buffer (`BPF_MAP_TYPE_RINGBUF`) read through a mapping of only the pages that hold
//! unread records, made for each read and unmapped after it.
//!
//! aya's `RingBuf` maps the whole ring for as long as it lives, its data pages twice (the
//! kernel's double mapping, which makes a record that crosses the ring's end contiguous), and the
//! kernel inserts every page at `mmap`: each counts in memprof's resident memory although the
//! kernel holds it anyway. The deferred-walk ring alone made twice its size of the daemon's
//! resident memory (docs: performance.md#the-daemons-own-cost). memprof's rings are nearly always empty (what
//! they carry is rare by construction), so a read maps the few pages between the consumer's and
//! the producer's positions, through the same double mapping; only the two positions' pages stay
//! mapped.

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    ptr::NonNull,
    sync::atomic::{fence, AtomicU32, AtomicU64, Ordering},
};

/// Bytes of records every ring skipped because its positions or a record's length made no sense
/// (see `RingError::Inconsistent`): reports and metrics say them (`SKIPPED_REASON`).
static SKIPPED_BYTES: AtomicU64 = AtomicU64::new(0);

/// The name reports and metrics give `skipped_bytes`, beside the probes' drop reasons.
pub const SKIPPED_REASON: &str = "ring_bytes_skipped";

/// Bytes of records skipped so far by every ring of this process.
pub fn skipped_bytes() -> u64 {
    SKIPPED_BYTES.load(Ordering::Relaxed)
}

use aya::maps::{Map, MapData};

/// The record header's flags (linux/bpf.h): reserved and not yet committed, or thrown away.
const BUSY_BIT: u32 = 1 << 31;
const DISCARD_BIT: u32 = 1 << 30;
/// A record's header: its length and flags, then the kernel's page offset of the record.
const HEADER_BYTES: u64 = 8;
/// Page offsets in the map's `mmap` space: the consumer's position (the one page user space may
/// write), the producer's, then the data pages twice over.
const CONSUMER_PAGE: u64 = 0;
const PRODUCER_PAGE: u64 = 1;
const DATA_PAGE: u64 = 2;

#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("map {0} is not a ring buffer")]
    NotARing(&'static str),
    #[error("reading map {0}'s size: {1}")]
    Info(&'static str, aya::maps::MapError),
    #[error("mapping ring {0}: {1}")]
    Map(&'static str, io::Error),
    /// Positions or a record length the kernel does not write: reading on would loop or read
    /// outside the ring.
    #[error("ring {0} is inconsistent: unread records past its end")]
    Inconsistent(&'static str),
}

pub struct Ring {
    name: &'static str,
    map: MapData,
    consumer: Mapping,
    producer: Mapping,
    /// The data's size: a power of two, a multiple of the page size.
    data_bytes: u64,
    page_bytes: u64,
    /// The consumer's position, as last written to its page.
    position: u64,
}

impl Ring {
    /// The ring `name` of a loaded object (`Ebpf::take_map`).
    pub fn new(name: &'static str, map: Map) -> Result<Self, RingError> {
        let Map::RingBuf(map) = map else {
            return Err(RingError::NotARing(name));
        };
        let data_bytes = u64::from(map.info().map_err(|err| RingError::Info(name, err))?.max_entries());
        // SAFETY: sysconf has no preconditions.
        let page_bytes = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        let fd = map.fd().as_fd();
        let consumer = Mapping::new(fd, CONSUMER_PAGE * page_bytes, page_bytes, libc::PROT_READ | libc::PROT_WRITE)
            .map_err(|err| RingError::Map(name, err))?;
        let producer = Mapping::new(fd, PRODUCER_PAGE * page_bytes, page_bytes, libc::PROT_READ)
            .map_err(|err| RingError::Map(name, err))?;
        let position = consumer.position().load(Ordering::Acquire);
        Ok(Self { name, map, consumer, producer, data_bytes, page_bytes, position })
    }

    /// Calls `visit` with each record committed since the last read, in order, and gives their
    /// space back to the kernel. A record still being written ends the read: the kernel wakes a
    /// poller when it is committed, and the next read starts with it. On an error (the kernel
    /// refused the mapping) the unread records stay for the next read, and it is logged. An
    /// inconsistent ring would fail every later read at the same place: its unread records are
    /// skipped and counted instead (`skipped_bytes`), and reading goes on from the producer.
    pub fn read(&mut self, mut visit: impl FnMut(&[u8])) {
        self.read_while(|record| {
            visit(record);
            true
        });
    }

    /// `read`, ending after the first record for which `visit` returns false.
    pub fn read_while(&mut self, visit: impl FnMut(&[u8]) -> bool) {
        match self.try_read(visit) {
            Ok(()) => {}
            Err(err @ RingError::Inconsistent(_)) => {
                let producer = self.producer.position().load(Ordering::Acquire);
                let skipped = self.skip_to(producer);
                tracing::warn!("{err}: {skipped} bytes of records skipped");
            }
            Err(err) => tracing::warn!("{err}"),
        }
    }

    /// Gives every record before `producer` back to the kernel unread; the bytes skipped.
    fn skip_to(&mut self, producer: u64) -> u64 {
        let skipped = producer.wrapping_sub(self.position).min(self.data_bytes);
        self.position = producer;
        self.consumer.position().store(self.position, Ordering::Release);
        SKIPPED_BYTES.fetch_add(skipped, Ordering::Relaxed);
        skipped
    }

    /// `read` for a ring whose records are each one `T`, written whole by its programs.
    pub fn read_each<T: aya::Pod>(&mut self, mut visit: impl FnMut(T)) {
        self.read(|record| {
            if record.len() >= size_of::<T>() {
                // SAFETY: a Pod is plain data, valid for any bytes; read_unaligned copes with the
                // ring's 8-byte alignment.
                visit(unsafe { std::ptr::read_unaligned(record.as_ptr().cast::<T>()) });
            }
        });
    }

    fn try_read(&mut self, mut visit: impl FnMut(&[u8]) -> bool) -> Result<(), RingError> {
        loop {
            let producer = self.producer.position().load(Ordering::Acquire);
            if producer == self.position {
                return Ok(());
            }
            let finished = self.read_up_to(producer, &mut visit)?;
            // The consumer's position written, then the producer's read again: either this read
            // sees a record committed meanwhile, or its producer sees the new position and wakes
            // a poller (the kernel wakes only when a record lands at the consumer's position).
            fence(Ordering::SeqCst);
            if !finished {
                return Ok(());
            }
        }
    }

    /// Reads the records from the consumer's position to `producer`, through a mapping of their
    /// pages only; false when one was still being written, or `visit` wanted no more.
    fn read_up_to(&mut self, producer: u64, visit: &mut impl FnMut(&[u8]) -> bool) -> Result<bool, RingError> {
        let unread = producer.wrapping_sub(self.position);
        if unread > self.data_bytes {
            return Err(RingError::Inconsistent(self.name));
        }
        let start = self.position & (self.data_bytes - 1);
        let first_page = start / self.page_bytes;
        // The double mapping makes unread records contiguous from `start` on: at most the data's
        // size, which ends within the second copy.
        let end = (start + unread).div_ceil(self.page_bytes) * self.page_bytes;
        let length = end - first_page * self.page_bytes;
        let window =
            Mapping::new(self.map.fd().as_fd(), (DATA_PAGE + first_page) * self.page_bytes, length, libc::PROT_READ)
                .map_err(|err| RingError::Map(self.name, err))?;
        let mut at = start - first_page * self.page_bytes;
        while self.position != producer {
            let header = window.header(at);
            if header & BUSY_BIT != 0 {
                return Ok(false);
            }
            let length = u64::from(header & !(BUSY_BIT | DISCARD_BIT));
            let record = window.bytes(at + HEADER_BYTES, length);
            if record.len() as u64 != length {
                return Err(RingError::Inconsistent(self.name));
            }
            let more = header & DISCARD_BIT != 0 || visit(record);
            let advance = (HEADER_BYTES + length).next_multiple_of(8);
            at += advance;
            self.position = self.position.wrapping_add(advance);
            // Published after the record is read: the kernel may reuse its space from then on.
            self.consumer.position().store(self.position, Ordering::Release);
            if !more {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// For waiting on records with poll or an async reactor: the map's descriptor is readable when
/// the ring holds any.
impl AsFd for Ring {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.map.fd().as_fd()
    }
}

/// A shared mapping of part of a map's `mmap` space, unmapped when dropped.
struct Mapping {
    address: NonNull<u8>,
    length: usize,
}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, offset: u64, length: u64, protection: i32) -> io::Result<Self> {
        let length = usize::try_from(length).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let offset = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a new mapping chosen by the kernel, of a descriptor that lives through the call;
        // nothing else refers to it.
        let address =
            unsafe { libc::mmap(std::ptr::null_mut(), length, protection, libc::MAP_SHARED, fd.as_raw_fd(), offset) };
        if address == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let address = NonNull::new(address.cast()).ok_or_else(|| io::Error::from(io::ErrorKind::AddrNotAvailable))?;
        Ok(Self { address, length })
    }

    /// The position at the start of a positions' page, which the kernel reads and writes at once.
    fn position(&self) -> &AtomicU64 {
        // SAFETY: the mapping is at least a page, page-aligned, and lives as long as `self`.
        unsafe { self.address.cast::<AtomicU64>().as_ref() }
    }

    /// The record header at `at`, which its producer writes when it commits the record.
    fn header(&self, at: u64) -> u32 {
        match usize::try_from(at).ok().filter(|at| at + size_of::<u32>() <= self.length) {
            // SAFETY: in the mapping and 8-aligned (records start at multiples of 8 in the data).
            Some(at) => unsafe { (*self.address.as_ptr().add(at).cast::<AtomicU32>()).load(Ordering::Acquire) },
            // Past the mapping: as a record not committed yet, which ends the read.
            None => BUSY_BIT,
        }
    }

    /// `length` bytes at `at`, or fewer where the mapping ends.
    fn bytes(&self, at: u64, length: u64) -> &[u8] {
        let at = usize::try_from(at).unwrap_or(usize::MAX).min(self.length);
        let length = usize::try_from(length).unwrap_or(usize::MAX).min(self.length - at);
        // SAFETY: within the mapping, which lives as long as the borrow of `self`; the kernel
        // does not write a committed record until the consumer's position passes it.
        unsafe { std::slice::from_raw_parts(self.address.as_ptr().add(at), length) }
    }
}

// SAFETY: the mapping is plain memory, owned by this value alone; the positions and headers in it
// are read and written through atomics.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, which nothing refers to any more.
        unsafe { libc::munmap(self.address.as_ptr().cast(), self.length) };
    }
}

#[cfg(test)]
mod tests {
    use aya::maps::Map;

    use super::*;
    use crate::test_maps::{new_map, BPF_MAP_TYPE_RINGBUF};

    /// A ring buffer of `bytes`.
    fn ring_map(bytes: u32) -> Map {
        Map::RingBuf(new_map(BPF_MAP_TYPE_RINGBUF, 0, 0, bytes))
    }

    #[test]
    fn an_inconsistent_ring_is_skipped_and_counted_and_read_again() {
        let mut ring = Ring::new("TEST_RING", ring_map(16 * 4096)).expect("a ring");
        // A consumer position further behind than the ring holds: as if positions were corrupt.
        let behind = ring.data_bytes + 8;
        ring.position = 0u64.wrapping_sub(behind);
        ring.consumer.position().store(ring.position, Ordering::Release);
        let before = skipped_bytes();
        let mut records = 0;
        ring.read(|_| records += 1);
        assert_eq!(records, 0);
        assert_eq!(skipped_bytes() - before, ring.data_bytes, "skipped bytes counted");
        assert_eq!(ring.position, 0, "reading resumes at the producer");
        assert_eq!(ring.consumer.position().load(Ordering::Acquire), 0);
        // The next read finds the ring consistent again.
        assert!(ring
            .try_read(|_| {
                records += 1;
                true
            })
            .is_ok());
    }
}
