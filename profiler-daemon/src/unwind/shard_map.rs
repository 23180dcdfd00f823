//! The `bpf` calls for shards that aya 0.14 lacks: an array created with BTF of its own, and
//! putting it into and out of the outer array.
//!
//! Before 6.2 the kernel takes an inner map only if its timer field offset equals the template's,
//! and that offset is "no BTF" for a map created without BTF but "no timer" for one with it: the
//! template `UNWIND_SHARDS` was created with (from the program's BTF) has BTF, so each shard needs
//! BTF too, with a struct value like the template's. Later kernels compare only the fields found.

use std::os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};

use profiler_common::UnwindRow;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// `u32` keys and a struct of `size_of::<UnwindRow>()` bytes, as BTF (`bpf_btf_load`'s format).
fn btf() -> Vec<u8> {
    const KIND_INT: u32 = 1;
    const KIND_ARRAY: u32 = 3;
    const KIND_STRUCT: u32 = 4;
    // String offsets: "\0u32\0u8\0bytes\0".
    let strings = b"\0u32\0u8\0bytes\0";
    let (u32_name, u8_name, bytes_name) = (1, 5, 8);
    let types: [u32; 20] = [
        // [1] u32: name, kind, size, then bits.
        u32_name,
        KIND_INT << 24,
        4,
        32,
        // [2] u8.
        u8_name,
        KIND_INT << 24,
        1,
        8,
        // [3] u8[size]: element type, index type, count.
        0,
        KIND_ARRAY << 24,
        0,
        2,
        1,
        size_of::<UnwindRow>() as u32,
        // [4] struct { u8 bytes[size]; }: one member at bit 0.
        0,
        KIND_STRUCT << 24 | 1,
        size_of::<UnwindRow>() as u32,
        bytes_name,
        3,
        0,
    ];
    let type_bytes = (types.len() * 4) as u32;
    let mut blob = Vec::new();
    blob.extend_from_slice(&0xeb9f_u16.to_ne_bytes());
    blob.extend_from_slice(&[1, 0]); // version, flags
    for word in [24, 0, type_bytes, type_bytes, strings.len() as u32] {
        blob.extend_from_slice(&u32::to_ne_bytes(word)); // header length, types, strings
    }
    blob.extend(types.iter().flat_map(|word| word.to_ne_bytes()));
    blob.extend_from_slice(strings);
    blob
}
/// The BTF type ids of `btf`'s key and value.
const KEY_TYPE: u32 = 1;
const VALUE_TYPE: u32 = 4;

/// Loads the shards' BTF into the kernel.
pub fn load_btf() -> std::io::Result<OwnedFd> {
    #[repr(C)]
    struct Attr {
        btf: u64,
        log_buf: u64,
        size: u32,
        log_size: u32,
        log_level: u32,
        /// Output since 6.4; before, the struct's padding, which the kernel wants zero (6.1
        /// refused the load with EINVAL when it held stack garbage).
        log_true_size: u32,
    }
    let blob = btf();
    let attr = Attr {
        btf: blob.as_ptr() as u64,
        log_buf: 0,
        size: blob.len() as u32,
        log_size: 0,
        log_level: 0,
        log_true_size: 0,
    };
    // SAFETY: the kernel's layout for this command; `blob` outlives the call.
    let fd = unsafe { bpf(BPF_BTF_LOAD, &attr) }?;
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new `BPF_F_MMAPABLE` array of `rows` rows typed by `btf` (from `load_btf`).
pub fn create(btf: BorrowedFd<'_>, rows: u32) -> std::io::Result<OwnedFd> {
    #[repr(C)]
    struct Attr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        inner_map_fd: u32,
        numa_node: u32,
        map_name: [u8; 16],
        map_ifindex: u32,
        btf_fd: u32,
        btf_key_type_id: u32,
        btf_value_type_id: u32,
    }
    let mut map_name = [0; 16];
    map_name[..12].copy_from_slice(b"unwind_shard");
    let attr = Attr {
        map_type: BPF_MAP_TYPE_ARRAY,
        key_size: 4,
        value_size: size_of::<UnwindRow>() as u32,
        max_entries: rows,
        map_flags: BPF_F_MMAPABLE,
        inner_map_fd: 0,
        numa_node: 0,
        map_name,
        map_ifindex: 0,
        btf_fd: btf.as_raw_fd() as u32,
        btf_key_type_id: KEY_TYPE,
        btf_value_type_id: VALUE_TYPE,
    };
    // SAFETY: the kernel's layout for this command (up to the BTF ids); no pointers.
    let fd = unsafe { bpf(BPF_MAP_CREATE, &attr) }?;
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Element `index` of the array of maps `outer`: `inner`, or none.
pub fn set(outer: BorrowedFd<'_>, index: u32, inner: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
    #[repr(C)]
    struct Attr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    let value = inner.map(|fd| fd.as_raw_fd() as u32);
    let attr = Attr {
        map_fd: outer.as_raw_fd() as u32,
        _pad: 0,
        key: &index as *const u32 as u64,
        value: value.as_ref().map_or(0, |fd| fd as *const u32 as u64),
        flags: 0,
    };
    let command = if value.is_some() { BPF_MAP_UPDATE_ELEM } else { BPF_MAP_DELETE_ELEM };
    // SAFETY: the kernel's layout for both commands; `key` and `value` point at locals that
    // outlive the call.
    unsafe { bpf(command, &attr) }.map(drop)
}

/// The `bpf` syscall: returns the descriptor or number it returned.
///
/// # Safety
/// `attr` must have the kernel's layout for `command`, and its pointers point at memory that
/// outlives the call (the kernel zero-fills the rest of its own attribute).
unsafe fn bpf<A>(command: libc::c_long, attr: &A) -> std::io::Result<i32> {
    // SAFETY: as the caller promises.
    let result = unsafe { libc::syscall(libc::SYS_bpf, command, attr as *const A, size_of::<A>()) };
    if result < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(result as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_btf_is_a_header_four_types_and_their_names() {
        let blob = btf();
        // 24 header bytes, 4 types (16 + 16 + 24 + 24 bytes), 14 bytes of names.
        assert_eq!(blob.len(), 24 + 80 + 14);
        assert_eq!(&blob[..4], &[0x9f, 0xeb, 1, 0]);
    }
}
