//! A copy of a process's memory made while it runs, brought up to date in a short stop.
//!
//! Copying into memory of memprof's own that was never touched costs a page fault per page
//! (most of the copy's time on a VM); the pre-copy takes those faults, and warms the process's
//! pages too, before the stop. Where the kernel keeps soft-dirty bits, the stop reads again only
//! the pages written since: writing "4" to `/proc/PID/clear_refs` clears the bits (and
//! write-protects every page, so that the next write to each faults once and sets its bit
//! again); bit 55 of a page's `pagemap` entry is the bit, and a mapping made or grown since is
//! soft-dirty as a whole. Where it keeps none and the user asked for it, userfaultfd's write
//! protection tells the same of the process's anonymous memory (`write_watch`, by calls injected
//! into the process), and the stop reads the rest again whole. Elsewhere the stop reads every
//! page again, into the warm copy.

use std::{fs, io, sync::OnceLock};

use crate::process::{
    image::{self, Image, Runs, Segment},
    pagemap::{self, Pagemap, PAGE, SOFT_DIRTY},
    procfs::{self, Region},
    write_watch::{WriteWatch, WRITE_PROTECTED},
};

/// How the pages written since the pre-copy are told.
pub enum Tracking {
    /// They are not: every page is read again.
    None,
    /// By their soft-dirty bits, cleared before the copy.
    SoftDirty,
    /// By userfaultfd's write protection, in the ranges the watch covers.
    WriteProtect(WriteWatch),
}

/// The pre-copy of a running process.
pub struct PreCopy {
    pid: u32,
    image: Image,
    pub tracking: Tracking,
}

impl PreCopy {
    /// Starts telling which pages of `pid` are written, where it can, then copies `regions`
    /// (sorted, apart) while the process runs. Soft-dirty bits are cleared where the kernel keeps
    /// them (`CONFIG_MEM_SOFT_DIRTY`) and memprof may clear them (`clear_refs` is writable by the
    /// process's owner, or with `CAP_DAC_OVERRIDE`, which the three capabilities memprof asks for
    /// do not include); else, with `inject`, its anonymous memory is write-protected, where the
    /// kernel and the process allow (`write_watch`); else nothing is tracked.
    pub fn start(pid: u32, regions: &[Region], inject: bool) -> io::Result<Self> {
        let tracking = if supported()
            && clear(pid).map_err(|err| tracing::debug!(pid, %err, "cannot clear soft-dirty bits")).is_ok()
        {
            Tracking::SoftDirty
        } else if !inject {
            Tracking::None
        } else {
            match WriteWatch::begin(pid, regions) {
                Ok(watch) => Tracking::WriteProtect(watch),
                Err(err) => {
                    tracing::debug!(pid, %err, "no write protection: every page is read again in the stop");
                    Tracking::None
                }
            }
        };
        Ok(Self { pid, image: Image::copy(pid, regions)?, tracking })
    }

    /// With the process held still: the copy of `regions` as they are now. Read again: the
    /// pages written since the pre-copy (every page holding data when not tracked), mappings new
    /// or grown since, and shared mappings, which others may have written (`bytes_read`). The
    /// write protection ends when `self` is dropped: drop it once the process runs again.
    pub fn finish(&mut self, regions: &[Region]) -> io::Result<Image> {
        bring_up_to_date(self.pid, std::mem::take(&mut self.image), regions, &self.tracking)
    }
}

/// The copy `old` of `pid`'s memory brought up to date with `regions` as they are now.
fn bring_up_to_date(pid: u32, old: Image, regions: &[Region], tracking: &Tracking) -> io::Result<Image> {
    let pagemap = Pagemap::open(pid)?;
    let mut old = old.segments.into_iter().peekable();
    let mut segments = Vec::with_capacity(regions.len());
    let mut runs = Vec::with_capacity(regions.len());
    for region in regions {
        let (start, end) = (region.start, region.end);
        while old.next_if(|s| s.start < start).is_some() {}
        // A mapping that starts where it did keeps its copy, grown or cut to its length now.
        let (mut bytes, kept, data) = match old.next_if(|s| s.start == start) {
            Some(segment) if !region.shared => {
                let kept = segment.bytes.len().min((end - start) as usize);
                (segment.bytes, kept, pagemap::overlap(&segment.data, &[(0, kept)]))
            }
            _ => (Vec::new(), 0, Vec::new()),
        };
        let (reread, empty) = match &tracking {
            // A mapping watched whole that kept its length: the kernel says what changed.
            Tracking::WriteProtect(watch) if kept == (end - start) as usize && !region.shared => {
                match watch.changes(&pagemap, start, end) {
                    Some(changes) => (changes.written, changes.empty),
                    None => stale_runs(&pagemap, region, kept, tracking)?,
                }
            }
            _ => stale_runs(&pagemap, region, kept, tracking)?,
        };
        if kept == 0 {
            bytes = image::zeroed((end - start) as usize, &reread)?;
        } else {
            bytes.resize((end - start) as usize, 0);
        }
        // Only pages the copy read hold anything but zeros: writing zeros over the others
        // would take memory for every page of a mapping reserved ahead and never touched.
        for (offset, len) in pagemap::overlap(&empty, &data) {
            bytes[offset..offset + len].fill(0);
        }
        let data = pagemap::union(&data, &reread);
        segments.push(Segment { start, bytes, data });
        runs.push(reread);
    }
    let (bytes_read, unreadable) = image::read_runs(pid, &mut segments, &runs);
    Ok(Image { segments, unreadable, bytes_read })
}

/// Of `region` (whose first `kept` bytes the old copy holds), as its pagemap entries say: the
/// runs to read again (stale pages that hold data; every page of a shared mapping), and those of
/// the old copy to zero (stale pages that hold nothing: given back since, or never touched and
/// grown into).
fn stale_runs(pagemap: &Pagemap, region: &Region, kept: usize, tracking: &Tracking) -> io::Result<Stale> {
    let (start, end) = (region.start, region.end);
    let stale = |page: usize, entry: u64| {
        page * PAGE as usize >= kept
            || match tracking {
                Tracking::None => true,
                Tracking::SoftDirty => entry & SOFT_DIRTY != 0,
                Tracking::WriteProtect(watch) => {
                    !watch.covers(start + page as u64 * PAGE) || entry & WRITE_PROTECTED == 0
                }
            }
    };
    let reread = |page, entry| region.shared || (stale(page, entry) && pagemap::holds_data(entry));
    let empty = |page, entry| {
        !region.shared && page * (PAGE as usize) < kept && stale(page, entry) && !pagemap::holds_data(entry)
    };
    let [reread, empty] = pagemap.runs_where(start, end, [&reread, &empty])?;
    Ok((reread, empty))
}

/// Runs of pages to read again, and to zero.
type Stale = (Runs, Runs);

/// Clears every soft-dirty bit of `pid`.
fn clear(pid: u32) -> io::Result<()> {
    fs::write(format!("{}/clear_refs", procfs::dir(pid)), "4")
}

/// Whether this kernel tracks soft-dirty pages: without `CONFIG_MEM_SOFT_DIRTY`, clearing is
/// accepted and does nothing, and no page is ever soft-dirty, so it is tried on a page of our own.
pub fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let Ok(pagemap) = Pagemap::open(std::process::id()) else { return false };
        let mut page = vec![1u8; 2 * PAGE as usize];
        let addr = (page.as_ptr() as u64).next_multiple_of(PAGE);
        let offset = (addr - page.as_ptr() as u64) as usize;
        if clear(std::process::id()).is_err() {
            return false;
        }
        // SAFETY: a volatile write to a byte of our own buffer, so that it is not elided.
        unsafe { std::ptr::write_volatile(page.as_mut_ptr().add(offset), 2) };
        pagemap.entries(addr, addr + PAGE).is_ok_and(|e| e[0] & SOFT_DIRTY != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stop_brings_the_copy_up_to_date() {
        let mut memory = vec![1u8; 8 * PAGE as usize];
        let start = (memory.as_ptr() as u64).next_multiple_of(PAGE);
        let at = (start - memory.as_ptr() as u64) as usize;
        let regions = [Region { start, end: start + 4 * PAGE, writable: true, shared: false, path: String::new() }];
        // memprof cannot stop its own threads: the pages are not write-protected here.
        let PreCopy { pid, image, tracking } = PreCopy::start(std::process::id(), &regions, true).unwrap();
        let tracked = !matches!(tracking, Tracking::None);
        memory[at + PAGE as usize + 5] = 9;
        let image = bring_up_to_date(pid, image, &regions, &tracking).unwrap();
        assert_eq!(image.from(start + PAGE + 5)[0], 9);
        assert_eq!(image.from(start)[0], 1);
        // The page written at least (with transparent huge pages, its whole huge page); all
        // four without soft-dirty bits.
        assert!(image.bytes_read >= PAGE, "{}", image.bytes_read);
        if !tracked {
            assert_eq!(image.bytes_read, 4 * PAGE);
        }
    }
}
