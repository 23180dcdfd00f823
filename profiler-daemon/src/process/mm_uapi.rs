//! The kernel's userfaultfd and `PAGEMAP_SCAN` interfaces, which the `libc` crate lacks: values
//! and layouts as in the kernel's UAPI headers (include/uapi/linux/userfaultfd.h and
//! include/uapi/linux/fs.h, Linux 6.7+), ioctl numbers spelled out as `_IOWR` makes them.

/// `_IOWR(type, nr, size)` of include/uapi/asm-generic/ioctl.h: read and write, then the
/// argument's size, type and number.
const fn iowr(kind: u8, nr: u8, size: usize) -> u64 {
    (3 << 30) | ((size as u64) << 16) | ((kind as u64) << 8) | nr as u64
}

/// userfaultfd(2)'s flag: faults from the kernel (a read(2) into the memory) never go to the
/// file, so that an unprivileged process may open one (`vm.unprivileged_userfaultfd = 0`).
pub const UFFD_USER_MODE_ONLY: u64 = 1;

/// The API version `UFFDIO_API` takes.
pub const UFFD_API: u64 = 0xAA;
/// Write-protected pages with no page behind them yet are protected too (pte markers), so that
/// a first write to one is seen.
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// A write to a write-protected page is let through by the kernel, which only clears the
/// page's protection: no fault reaches the file, nobody need read it.
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
pub const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;

/// `struct uffdio_api`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioApi {
    pub api: u64,
    pub features: u64,
    pub ioctls: u64,
}

/// `struct uffdio_register`: `struct uffdio_range { start, len }`, then the mode, then the
/// ioctls the kernel answers.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioRegister {
    pub start: u64,
    pub len: u64,
    pub mode: u64,
    pub ioctls: u64,
}

pub const UFFDIO_API: u64 = iowr(0xAA, 0x3F, std::mem::size_of::<UffdioApi>());
pub const UFFDIO_REGISTER: u64 = iowr(0xAA, 0x00, std::mem::size_of::<UffdioRegister>());

/// `PAGEMAP_SCAN`'s flags: write-protect the pages matched, and fail rather than skip a mapping
/// that is not registered for asynchronous write protection.
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PmScanArg {
    pub size: u64,
    pub flags: u64,
    pub start: u64,
    pub end: u64,
    pub walk_end: u64,
    pub vec: u64,
    pub vec_len: u64,
    pub max_pages: u64,
    pub category_inverted: u64,
    pub category_mask: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}

/// `struct page_region`: a run of pages of the same categories.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}

/// `PAGEMAP_SCAN`'s page categories.
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;

pub const PAGEMAP_SCAN: u64 = iowr(b'f', 16, std::mem::size_of::<PmScanArg>());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        // As the kernel headers' macros expand (printed by a C program including them).
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(PAGEMAP_SCAN, 0xc060_6610);
    }
}
