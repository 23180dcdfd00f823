//! A deferred walk as memprof holds it until its table is loaded: the kernel's record cut to the
//! pages of stack it copied. The record always has room for `DEFERRED_PAGES`, but a stack near its
//! top (a program's start, its libraries' constructors) fills one or two: held whole, a burst of
//! walks took four times the memory, and the reader's bound (see `reader`) lost those past it.

use std::mem::{offset_of, size_of};

use profiler_common::{DeferredUnwind, ShortDeferredUnwind, PAGE_BYTES};

/// The record's bytes up to the end of its copied pages.
#[derive(Clone)]
pub struct DeferredCopy(Box<[u8]>);

impl DeferredCopy {
    /// The copy in `record`, when it is a whole `DeferredUnwind` or `ShortDeferredUnwind`.
    pub fn of(record: &[u8]) -> Option<Self> {
        if record.len() != size_of::<DeferredUnwind>() && record.len() != size_of::<ShortDeferredUnwind>() {
            return None;
        }
        let pages = u32::from_ne_bytes(field(record, offset_of!(DeferredUnwind, pages)));
        let copied = (pages as usize).saturating_mul(PAGE_BYTES);
        let end = offset_of!(DeferredUnwind, window).saturating_add(copied).min(record.len());
        Some(Self(record[..end].into()))
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn tgid(&self) -> u32 {
        u32::from_ne_bytes(field(&self.0, offset_of!(DeferredUnwind, tgid)))
    }

    pub fn time_ns(&self) -> u64 {
        u64::from_ne_bytes(field(&self.0, offset_of!(DeferredUnwind, time_ns)))
    }

    /// Writes the copy over `event`: its fields, and its window up to the pages copied (the
    /// walk reads no further).
    pub fn write_into(&self, event: &mut DeferredUnwind) {
        // SAFETY: `self.0` is a prefix of a `DeferredUnwind`'s bytes (`of`), no longer than
        // `event`, a plain struct of integers that any bytes make valid.
        unsafe { std::ptr::copy_nonoverlapping(self.0.as_ptr(), (event as *mut DeferredUnwind).cast(), self.0.len()) };
    }

    /// A zeroed event for `write_into`, on the heap: a copy of a stack does not fit on a thread's.
    pub fn blank() -> Box<DeferredUnwind> {
        // SAFETY: all zeroes is a valid `DeferredUnwind`, a plain struct of integers.
        unsafe { Box::<DeferredUnwind>::new_zeroed().assume_init() }
    }
}

/// The `N` bytes of `bytes` at `offset`, which the record always holds (they precede its window).
fn field<const N: usize>(bytes: &[u8], offset: usize) -> [u8; N] {
    bytes[offset..offset + N].try_into().expect("a field before the window")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_keeps_its_fields_and_copied_pages_only() {
        let mut event = DeferredCopy::blank();
        event.tgid = 42;
        event.time_ns = 7;
        event.pages = 2;
        event.window[PAGE_BYTES * 2 - 1] = 9;
        event.window[PAGE_BYTES * 2] = 5;
        // SAFETY: the event's bytes, read as bytes.
        let record = unsafe {
            std::slice::from_raw_parts((&*event as *const DeferredUnwind).cast::<u8>(), size_of::<DeferredUnwind>())
        };
        let copy = DeferredCopy::of(record).expect("a whole record");
        assert_eq!(copy.0.len(), offset_of!(DeferredUnwind, window) + 2 * PAGE_BYTES);
        assert_eq!((copy.tgid(), copy.time_ns()), (42, 7));
        let mut back = DeferredCopy::blank();
        copy.write_into(&mut back);
        assert_eq!(
            (back.tgid, back.pages, back.window[PAGE_BYTES * 2 - 1], back.window[PAGE_BYTES * 2]),
            (42, 2, 9, 0)
        );
        assert!(DeferredCopy::of(&record[..100]).is_none());
        // A short record has the same fields at the same offsets.
        let short = &record[..size_of::<ShortDeferredUnwind>()];
        let copy = DeferredCopy::of(short).expect("a short record");
        assert_eq!(copy.0.len(), offset_of!(ShortDeferredUnwind, window) + 2 * PAGE_BYTES);
        assert_eq!(offset_of!(ShortDeferredUnwind, window), offset_of!(DeferredUnwind, window));
        assert_eq!((copy.tgid(), copy.time_ns()), (42, 7));
    }
}
