//! Reading whole BPF hash maps (and arrays) in batches (`BPF_MAP_LOOKUP_BATCH`).
//!
//! Walking a hash map key by key, as aya's iterators do, restarts from the first key whenever the
//! current key was deleted meanwhile, which happens all the time in a busy process's `LIVE` map:
//! entries get counted twice and the walk may not end. The batch call walks bucket by bucket, is
//! not thrown back by deletions, and takes one syscall per few thousand entries instead of two
//! per entry.

use std::{
    io,
    mem::size_of,
    os::fd::{AsFd, AsRawFd},
};

use anyhow::bail;
use aya::{maps::Map, Pod};

/// `enum bpf_cmd` in linux/bpf.h.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_LOOKUP_AND_DELETE_BATCH: libc::c_long = 25;
/// Entries asked for at once, at most: fewer when they would take more than `BUFFER_BYTES`; grown
/// when one hash bucket holds more.
const MOST_ENTRIES: usize = 4096;
/// The keys' and values' buffers together. `MOST_ENTRIES` entries of `STACKS` (1 KiB values) were
/// allocated and freed at each walk (several an interval), and the allocator kept them resident
/// (docs: performance.md#measurements-behind-design-choices).
const BUFFER_BYTES: usize = 256 * 1024;

/// The batch part of `union bpf_attr` (linux/bpf.h).
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Calls `visit` with every entry of a hash map or array. Entries added or removed during the walk may or
/// may not be seen; none is seen twice.
pub fn for_each<K: Pod, V: Pod>(map: &Map, visit: impl FnMut(&K, &V)) -> anyhow::Result<()> {
    walk(map, BPF_MAP_LOOKUP_BATCH, visit)
}

/// Calls `visit` with every entry of a hash map and deletes it. Entries added during the walk may
/// or may not be seen, and stay if not.
pub fn drain<K: Pod, V: Pod>(map: &Map, visit: impl FnMut(&K, &V)) -> anyhow::Result<()> {
    if !matches!(map, Map::HashMap(_)) {
        bail!("batch deletions are for hash maps");
    }
    walk(map, BPF_MAP_LOOKUP_AND_DELETE_BATCH, visit)
}

/// Both walks: `command` is a batch lookup, with or without deletion.
fn walk<K: Pod, V: Pod>(map: &Map, command: libc::c_long, mut visit: impl FnMut(&K, &V)) -> anyhow::Result<()> {
    let (Map::HashMap(data) | Map::LruHashMap(data) | Map::Array(data)) = map else {
        bail!("batch lookups are for hash maps and arrays");
    };
    let fd = data.fd().as_fd().as_raw_fd();
    let mut chunk = first_chunk(size_of::<K>() + size_of::<V>());
    // SAFETY: Pod types are plain data, valid for any bit pattern, zeros included.
    let (mut keys, mut values): (Vec<K>, Vec<V>) =
        unsafe { (vec![std::mem::zeroed(); chunk], vec![std::mem::zeroed(); chunk]) };
    // The kernel's batch token is a bucket index for hash maps, an index for arrays.
    let (mut position, mut next): (u32, u32) = (0, 0);
    let mut started = false;
    loop {
        let mut attr = BatchAttr {
            in_batch: if started { &position as *const u32 as u64 } else { 0 },
            out_batch: &mut next as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd as u32,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: attr points at buffers of `count` keys and values that live through the call.
        let result =
            unsafe { libc::syscall(libc::SYS_bpf, command, &mut attr as *mut BatchAttr, size_of::<BatchAttr>()) };
        let error = (result < 0).then(io::Error::last_os_error);
        match error.as_ref().and_then(io::Error::raw_os_error) {
            // A bucket holds more entries than the buffers: grow them and ask again.
            Some(libc::ENOSPC) => {
                chunk *= 2;
                // SAFETY: as above.
                unsafe {
                    keys.resize(chunk, std::mem::zeroed());
                    values.resize(chunk, std::mem::zeroed());
                }
                continue;
            }
            None | Some(libc::ENOENT) => {}
            Some(_) => return Err(error.expect("an error").into()),
        }
        for (key, value) in keys.iter().zip(&values).take(attr.count as usize) {
            visit(key, value);
        }
        // ENOENT: the walk is done.
        if error.is_some() {
            return Ok(());
        }
        position = next;
        started = true;
    }
}

/// Entries asked for in the first call, for entries (key and value) of `entry_bytes`.
fn first_chunk(entry_bytes: usize) -> usize {
    (BUFFER_BYTES / entry_bytes.max(1)).clamp(1, MOST_ENTRIES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::Stack;

    #[test]
    fn buffers_stay_within_their_bytes_whatever_the_entries_size() {
        // A stack table's entries: 1 KiB values, far fewer a call than `MOST_ENTRIES`.
        let stack_entry = size_of::<u64>() + size_of::<Stack>();
        assert_eq!(first_chunk(stack_entry), 252);
        assert!(first_chunk(stack_entry) * stack_entry <= BUFFER_BYTES);
        // Small entries keep the most per call; one too large for the buffer is read alone.
        assert_eq!(first_chunk(16), MOST_ENTRIES);
        assert_eq!(first_chunk(BUFFER_BYTES + 1), 1);
    }
}
