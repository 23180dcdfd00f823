//! BPF maps made for unit tests with the `bpf` system call (needs root, as memprof does).

use std::{
    io,
    os::fd::{FromRawFd, OwnedFd},
};

use aya::maps::MapData;

/// `enum bpf_map_type` in linux/bpf.h.
pub const BPF_MAP_TYPE_HASH: u32 = 1;
pub const BPF_MAP_TYPE_ARRAY: u32 = 2;
pub const BPF_MAP_TYPE_RINGBUF: u32 = 27;

/// A map of `map_type` with keys and values of those sizes and room for `entries` (a ring
/// buffer's bytes).
pub fn new_map(map_type: u32, key_size: u32, value_size: u32, entries: u32) -> MapData {
    const BPF_MAP_CREATE: libc::c_long = 0;
    // bpf_attr's map-creation part: type, key size, value size, entries; the rest zero.
    let mut attr = [0u32; 32];
    attr[..4].copy_from_slice(&[map_type, key_size, value_size, entries]);
    // SAFETY: the attribute buffer outlives the call and is as large as the kernel reads.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, attr.as_ptr(), size_of_val(&attr)) };
    assert!(fd >= 0, "creating a map of type {map_type}: {}", io::Error::last_os_error());
    // SAFETY: a descriptor the kernel just gave this process and nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    MapData::from_fd(fd).expect("the map")
}
