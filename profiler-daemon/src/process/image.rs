//! A copy of mappings of a process's memory (`--inspect`), read with `process_vm_readv`: up to
//! 1024 ranges a call straight into the copy, where `/proc/PID/mem` takes a call per range. Only
//! pages that hold data are read (`pagemap`): most of a thread's stack, or of a heap reserved
//! ahead, was never touched. The process need be held still only while it is copied; the copy
//! is marked after it runs on.

use std::io;

use crate::process::{
    pagemap::{self, Pagemap, PAGE},
    procfs::{self, Region},
};

/// Ranges given to one `process_vm_readv` call (the kernel's `UIO_MAXIOV`).
const IOVECS_PER_CALL: usize = 1024;

/// The copy of one range.
#[derive(Debug)]
pub struct Segment {
    pub start: u64,
    pub bytes: Vec<u8>,
    /// The runs (offset, length) of `bytes` that may hold other than zeros: those read from the
    /// process. The rest was never written there (or given back), so holds no pointer.
    pub data: Runs,
}

/// Copies of ranges, sorted by address and apart.
#[derive(Debug, Default)]
pub struct Image {
    pub segments: Vec<Segment>,
    /// Bytes that could not be read (device memory, pages unmapped meanwhile): zeros in the copy.
    pub unreadable: u64,
    /// Bytes read from the process by the copy that made it last.
    pub bytes_read: u64,
}

impl Image {
    /// Copies `regions` (sorted, apart) of `pid`'s memory: of a private mapping, the pages in
    /// memory or swapped out (the others hold zeros, or the file's bytes, never a pointer the
    /// process wrote); of a shared one, every page, since others may have written them.
    pub fn copy(pid: u32, regions: &[Region]) -> io::Result<Self> {
        let pagemap = Pagemap::open(pid)?;
        let mut segments = Vec::with_capacity(regions.len());
        for region in regions {
            let data = data_runs(&pagemap, region)?;
            let bytes = zeroed((region.end - region.start) as usize, &data)?;
            segments.push(Segment { start: region.start, bytes, data });
        }
        let runs: Vec<Runs> = segments.iter().map(|s| s.data.clone()).collect();
        let (bytes_read, unreadable) = read_runs(pid, &mut segments, &runs);
        Ok(Self { segments, unreadable, bytes_read })
    }

    /// The copy from `addr` to the end of its segment; empty when `addr` was not copied.
    pub fn from(&self, addr: u64) -> &[u8] {
        let Some(segment) = self.segment_of(addr) else { return &[] };
        segment.bytes.get((addr - segment.start) as usize..).unwrap_or_default()
    }

    /// Of the copy from `addr`, `len` bytes at most, the parts that may hold other than zeros
    /// (`Segment::data`), each with its address.
    pub fn data_from(&self, addr: u64, len: usize) -> Vec<(u64, &[u8])> {
        let Some(segment) = self.segment_of(addr) else { return Vec::new() };
        let from = (addr - segment.start) as usize;
        let len = len.min(segment.bytes.len().saturating_sub(from));
        pagemap::overlap(&segment.data, &[(from, len)])
            .into_iter()
            .map(|(offset, len)| (segment.start + offset as u64, &segment.bytes[offset..offset + len]))
            .collect()
    }

    /// The first address from `addr` on that the copy holds; None past its last segment.
    pub fn copied_from(&self, addr: u64) -> Option<u64> {
        let at = self.segments.partition_point(|s| s.start.saturating_add(s.bytes.len() as u64) <= addr);
        self.segments.get(at).map(|segment| segment.start.max(addr))
    }

    fn segment_of(&self, addr: u64) -> Option<&Segment> {
        let at = self.segments.partition_point(|s| s.start <= addr).checked_sub(1)?;
        self.segments.get(at)
    }
}

/// Runs of a segment: (offset, length), sorted and apart.
pub type Runs = Vec<(usize, usize)>;

/// The runs of `region` a copy reads (see `Image::copy`).
fn data_runs(pagemap: &Pagemap, region: &Region) -> io::Result<Runs> {
    let (start, end) = (region.start, region.end);
    if region.shared {
        return Ok(vec![(0, (end - start) as usize)]);
    }
    let [data] = pagemap.runs_where(start, end, [&|_, entry| pagemap::holds_data(entry)])?;
    Ok(data)
}

/// The bytes a copy of `regions` of `pid` would read now, and hold: a mapping reserved ahead
/// (a JVM's heap, jemalloc's arenas) is mostly pages never touched.
pub fn bytes_to_copy(pid: u32, regions: &[Region]) -> io::Result<u64> {
    let pagemap = Pagemap::open(pid)?;
    let mut total = 0;
    for region in regions {
        total += data_runs(&pagemap, region)?.iter().map(|(_, len)| *len as u64).sum::<u64>();
    }
    Ok(total)
}

/// Transparent huge pages are asked for a copy of at least this size whose pages mostly hold data.
const HUGE: usize = 2 << 20;

/// `len` zero bytes, whose pages are taken from the system only when written (calloc), and in
/// huge pages when at least half of them will be (the runs of `data`): one page fault per 2 MiB
/// instead of per 4 KiB. Page faults took most of a copy's time on a VM
/// (docs: performance.md#measurements-behind-design-choices).
pub fn zeroed(len: usize, data: &[(usize, usize)]) -> io::Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(io::Error::other)?;
    // SAFETY: `layout` is of `len` bytes, not 0. A mapping of terabytes reserved ahead may find
    // no room even for pages never touched: an error, where `vec!` would abort.
    let start = unsafe { std::alloc::alloc_zeroed(layout) };
    if start.is_null() {
        return Err(io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("no room for a copy of a mapping of {} MiB", len >> 20),
        ));
    }
    // SAFETY: `len` zeroed bytes from the global allocator with `layout`, which the Vec frees.
    let bytes = unsafe { Vec::from_raw_parts(start, len, len) };
    let written: usize = data.iter().map(|(_, len)| len).sum();
    if len >= HUGE && written >= len / 2 {
        let start = (bytes.as_ptr() as usize).next_multiple_of(PAGE as usize);
        let end = (bytes.as_ptr() as usize + len) / PAGE as usize * PAGE as usize;
        // SAFETY: advice on whole pages of a buffer we own; it changes none of its bytes.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    Ok(bytes)
}

/// Reads, for each segment, its runs (offset, length) of `pid`'s memory into it; returns the
/// bytes asked for, and how many of them could not be read, left as zeros.
pub fn read_runs(pid: u32, segments: &mut [Segment], runs: &[Runs]) -> (u64, u64) {
    let asked = runs.iter().flatten().map(|(_, len)| *len as u64).sum();
    let mut targets: Vec<(u64, &mut [u8])> = Vec::new();
    for (segment, runs) in segments.iter_mut().zip(runs) {
        let start = segment.start;
        let mut rest: &mut [u8] = &mut segment.bytes;
        let mut consumed = 0;
        for &(offset, len) in runs {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(offset - consumed);
            let (run, tail) = tail.split_at_mut(len);
            targets.push((start + offset as u64, run));
            rest = tail;
            consumed = offset + len;
        }
    }
    (asked, read_into(procfs::memory_task(pid), &mut targets))
}

/// Above this many bytes a copy is shared among threads: its time is the kernel's work per page
/// (pinning, mapping, copying), which scales with the cores, and the process is stopped.
const PARALLEL_ABOVE: usize = 8 << 20;

/// Threads a copy is shared among, at most.
const MAX_THREADS: usize = 8;

/// Reads each buffer's length of the memory of `task` (see `procfs::memory_task`) at its address
/// into it; returns how many bytes could not be read, left as zeros.
fn read_into(task: u32, targets: &mut [(u64, &mut [u8])]) -> u64 {
    let total: usize = targets.iter().map(|(_, buf)| buf.len()).sum();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS);
    if threads < 2 || total < PARALLEL_ABOVE {
        return read_serially(task, targets);
    }
    // Shares of about equal bytes, a target cut where a share ends.
    let share = total.div_ceil(threads);
    let mut shares: Vec<Vec<(u64, &mut [u8])>> = vec![Vec::new()];
    let mut filled = 0;
    for (addr, buf) in targets.iter_mut() {
        let (mut addr, mut rest): (u64, &mut [u8]) = (*addr, buf);
        while !rest.is_empty() {
            let room = share - filled;
            if rest.len() <= room {
                filled += rest.len();
                shares.last_mut().expect("one share at least").push((addr, rest));
                break;
            }
            let (head, tail) = rest.split_at_mut(room);
            shares.last_mut().expect("one share at least").push((addr, head));
            (addr, rest) = (addr + room as u64, tail);
            shares.push(Vec::new());
            filled = 0;
        }
    }
    std::thread::scope(|scope| {
        let copies: Vec<_> =
            shares.into_iter().map(|mut share| scope.spawn(move || read_serially(task, &mut share))).collect();
        copies.into_iter().map(|copy| copy.join().expect("a copying thread does not panic")).sum()
    })
}

fn read_serially(task: u32, targets: &mut [(u64, &mut [u8])]) -> u64 {
    let mut unreadable = 0;
    // The next target and how far into it.
    let (mut at, mut done) = (0, 0);
    loop {
        while at < targets.len() && done == targets[at].1.len() {
            (at, done) = (at + 1, 0);
        }
        if at == targets.len() {
            return unreadable;
        }
        let mut local = Vec::with_capacity(IOVECS_PER_CALL);
        let mut remote = Vec::with_capacity(IOVECS_PER_CALL);
        for (i, (addr, buf)) in targets[at..].iter_mut().take(IOVECS_PER_CALL).enumerate() {
            let skip = if i == 0 { done } else { 0 };
            let rest = &mut buf[skip..];
            local.push(libc::iovec { iov_base: rest.as_mut_ptr().cast(), iov_len: rest.len() });
            remote.push(libc::iovec { iov_base: (*addr + skip as u64) as *mut libc::c_void, iov_len: rest.len() });
        }
        let asked: usize = local.iter().map(|v| v.iov_len).sum();
        // SAFETY: each local iovec describes a live, writable part of a target buffer; the
        // remote ones are only addresses in the other process, which the kernel checks.
        let read = unsafe {
            libc::process_vm_readv(
                task as libc::pid_t,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if read < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
            // The process is gone: nothing more can be read.
            for (i, (_, buf)) in targets[at..].iter_mut().enumerate() {
                let skip = if i == 0 { done } else { 0 };
                buf[skip..].fill(0);
                unreadable += (buf.len() - skip) as u64;
            }
            return unreadable;
        }
        let mut left = usize::try_from(read).unwrap_or(0);
        let short = left < asked;
        // Walk past what was read.
        while left > 0 {
            let step = (targets[at].1.len() - done).min(left);
            (done, left) = (done + step, left - step);
            if done == targets[at].1.len() {
                (at, done) = (at + 1, 0);
            }
        }
        if short && at < targets.len() {
            // The read stopped at a page it could not read: skip that page (a copy made before
            // becomes zeros there) and go on.
            let (addr, buf) = &mut targets[at];
            let here = *addr + done as u64;
            let skip = ((PAGE - here % PAGE) as usize).min(buf.len() - done);
            buf[done..done + skip].fill(0);
            unreadable += skip as u64;
            done += skip;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh anonymous mapping of ours, `pages` long.
    fn mapping(pages: usize) -> u64 {
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        base as u64
    }

    #[test]
    fn reads_many_runs_and_zeroes_what_cannot_be_read() {
        let base = mapping(3);
        // SAFETY: the mapping above is ours and 3 pages long; its middle page is then unmapped.
        unsafe {
            std::slice::from_raw_parts_mut(base as *mut u8, 3 * PAGE as usize).fill(7);
            libc::munmap((base + PAGE) as *mut libc::c_void, PAGE as usize);
        }
        let mut segments = vec![
            Segment { start: base, bytes: vec![0xaa; 8], data: Vec::new() },
            Segment { start: base + PAGE - 16, bytes: vec![0xaa; 2 * PAGE as usize + 16], data: Vec::new() },
        ];
        let runs = [vec![(0, 8)], vec![(0, 2 * PAGE as usize + 16)]];
        let (bytes_read, unreadable) = read_runs(std::process::id(), &mut segments, &runs);
        let image = Image { segments, unreadable, bytes_read };
        assert_eq!(image.unreadable, PAGE);
        assert_eq!(image.from(base), [7; 8]);
        let tail = image.from(base + PAGE - 16);
        assert_eq!(tail.len(), 2 * PAGE as usize + 16);
        assert!(tail[..16].iter().all(|&b| b == 7));
        assert!(tail[16..16 + PAGE as usize].iter().all(|&b| b == 0));
        assert!(tail[16 + PAGE as usize..].iter().all(|&b| b == 7));
        assert!(image.from(base + 8).is_empty());
        // SAFETY: the mapping's first and last pages, still mapped and ours.
        unsafe {
            libc::munmap(base as *mut libc::c_void, PAGE as usize);
            libc::munmap((base + 2 * PAGE) as *mut libc::c_void, PAGE as usize);
        }
    }

    #[test]
    fn a_large_copy_shared_among_threads_is_whole() {
        // More than PARALLEL_ABOVE, in three buffers of odd sizes, so that shares cut them.
        let source: Vec<u64> = (0..(12 << 20) / 8).collect();
        let bytes: &[u8] = as_bytes(&source);
        let base = bytes.as_ptr() as u64;
        let cuts = [0, 5 << 20, (5 << 20) + 12_345, bytes.len()];
        let mut segments: Vec<Segment> = cuts
            .windows(2)
            .map(|w| Segment { start: base + w[0] as u64, bytes: vec![0; w[1] - w[0]], data: Vec::new() })
            .collect();
        let runs: Vec<Vec<(usize, usize)>> = segments.iter().map(|s| vec![(0, s.bytes.len())]).collect();
        let (read, unreadable) = read_runs(std::process::id(), &mut segments, &runs);
        assert_eq!((read, unreadable), (bytes.len() as u64, 0));
        let copy: Vec<u8> = segments.iter().flat_map(|s| s.bytes.iter().copied()).collect();
        assert!(copy == bytes);
    }

    /// The bytes of a slice of words.
    fn as_bytes(words: &[u64]) -> &[u8] {
        // SAFETY: any initialized u64 is 8 readable bytes; the slice borrows `words`.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), std::mem::size_of_val(words)) }
    }

    #[test]
    fn a_copy_reads_the_pages_written_and_leaves_the_untouched_ones_zero() {
        let base = mapping(4);
        // SAFETY: the second page of our mapping.
        unsafe { std::ptr::write_volatile((base + PAGE + 8) as *mut u64, 0x1234) };
        let region = Region { start: base, end: base + 4 * PAGE, writable: true, shared: false, path: String::new() };
        let image = Image::copy(std::process::id(), &[region]).unwrap();
        assert_eq!(image.unreadable, 0);
        assert_eq!(image.from(base).len(), 4 * PAGE as usize);
        assert_eq!(image.from(base + PAGE + 8)[..8], 0x1234u64.to_ne_bytes());
        // SAFETY: our mapping, 4 pages long.
        unsafe { libc::munmap(base as *mut libc::c_void, 4 * PAGE as usize) };
    }
}
