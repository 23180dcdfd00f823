//! Reading whole BPF hash maps (and arrays) in batches (`BPF_MAP_LOOKUP_BATCH`), and writing or
//! deleting many of their keys at once (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`).
//!
//! Walking a hash map key by key, as aya's iterators do, restarts from the first key whenever the
//! current key was deleted meanwhile, which happens all the time in a busy process's `LIVE` map:
//! entries get counted twice and the walk may not end. The batch call walks bucket by bucket, is
//! not thrown back by deletions, and takes one syscall per few thousand entries instead of two
//! per entry.

use std::{
    io,
    mem::size_of,
    os::fd::{AsFd, AsRawFd, RawFd},
};

use anyhow::bail;
use aya::{
    maps::{Map, MapData},
    Pod,
};

/// `enum bpf_cmd` in linux/bpf.h.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_LOOKUP_AND_DELETE_BATCH: libc::c_long = 25;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
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

impl BatchAttr {
    /// `count` entries of map `fd`, their keys at `keys` and values at `values` (0: none), from
    /// the map's first bucket.
    fn new(fd: RawFd, keys: u64, values: u64, count: u32) -> Self {
        Self { in_batch: 0, out_batch: 0, keys, values, count, map_fd: fd as u32, elem_flags: 0, flags: 0 }
    }
}

/// `data`'s descriptor, once its keys (and values, with `values`) are as large as `K` (and `V`):
/// the kernel copies entries of the map's own sizes into and out of buffers sized for those types.
fn checked_fd<K, V>(data: &MapData, values: bool) -> anyhow::Result<RawFd> {
    let info = data.info()?;
    let (key, value) = (info.key_size() as usize, info.value_size() as usize);
    if key != size_of::<K>() || (values && value != size_of::<V>()) {
        bail!(
            "a batch call with {}-byte keys and {}-byte values on a map of {key}-byte keys and {value}-byte values",
            size_of::<K>(),
            size_of::<V>()
        );
    }
    Ok(data.fd().as_fd().as_raw_fd())
}

/// Makes batch `command`; the kernel leaves in `attr.count` how many entries it went through.
///
/// # Safety
/// `attr`'s addresses must hold `attr.count` keys and values of the map's sizes (`values` may be
/// 0 where `command` takes none), and the batch positions, alive through the call and writable
/// where `command` writes.
unsafe fn call(command: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: the caller's promise; the kernel reads `size_of::<BatchAttr>()` bytes of `attr`.
    let result = unsafe { libc::syscall(libc::SYS_bpf, command, attr as *mut BatchAttr, size_of::<BatchAttr>()) };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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

/// Deletes `keys` from a hash map in few calls, not one each (the purge of a process gone deletes
/// about a thousand entries: docs: performance.md#measurements-behind-design-choices), and gives
/// back those deleted here: a program may have deleted one since it was read.
pub fn delete<K: Pod>(map: &Map, mut keys: Vec<K>) -> anyhow::Result<Vec<K>> {
    let (Map::HashMap(data) | Map::LruHashMap(data)) = map else {
        bail!("batch deletions are for hash maps");
    };
    let fd = checked_fd::<K, ()>(data, false)?;
    // Keys deleted so far are moved to the front, before `kept`; `next` is the first not tried.
    let (mut kept, mut next) = (0, 0);
    while next < keys.len() {
        let count = u32::try_from(keys.len() - next).unwrap_or(u32::MAX);
        let mut attr = BatchAttr::new(fd, keys[next..].as_ptr() as u64, 0, count);
        // SAFETY: attr points at `count` keys that live through the call; the kernel only reads them.
        let error = unsafe { call(BPF_MAP_DELETE_BATCH, &mut attr) }.err();
        match error.as_ref().and_then(io::Error::raw_os_error) {
            // The kernel stopped at a key it could not delete: gone already, or its bucket busy
            // (the entry stays, as a failed single deletion left it). It says how many it
            // deleted before.
            None | Some(libc::ENOENT | libc::EBUSY | libc::EDEADLK | libc::ETIMEDOUT) => {}
            // Refused as a whole (before any key: each call is checked the same way).
            Some(_) => return Err(error.expect("an error").into()),
        }
        let deleted = (attr.count as usize).min(keys.len() - next);
        keys.copy_within(next..next + deleted, kept);
        kept += deleted;
        next += deleted;
        if error.is_some() {
            // Not deleted here.
            next += 1;
        }
    }
    keys.truncate(kept);
    Ok(keys)
}

/// Sets `keys[i]` to `values[i]` in a hash map or array, in one call.
pub fn update<K: Pod, V: Pod>(map: &Map, keys: &[K], values: &[V]) -> anyhow::Result<()> {
    let (Map::HashMap(data) | Map::LruHashMap(data) | Map::Array(data)) = map else {
        bail!("batch updates are for hash maps and arrays");
    };
    assert_eq!(keys.len(), values.len(), "a value for each key");
    if keys.is_empty() {
        return Ok(());
    }
    let fd = checked_fd::<K, V>(data, true)?;
    let mut attr = BatchAttr::new(fd, keys.as_ptr() as u64, values.as_ptr() as u64, u32::try_from(keys.len())?);
    // SAFETY: attr points at `count` keys and values that live through the call; the kernel only
    // reads them.
    unsafe { call(BPF_MAP_UPDATE_BATCH, &mut attr) }?;
    Ok(())
}

/// Both walks: `command` is a batch lookup, with or without deletion.
fn walk<K: Pod, V: Pod>(map: &Map, command: libc::c_long, mut visit: impl FnMut(&K, &V)) -> anyhow::Result<()> {
    let (Map::HashMap(data) | Map::LruHashMap(data) | Map::Array(data)) = map else {
        bail!("batch lookups are for hash maps and arrays");
    };
    let fd = checked_fd::<K, V>(data, true)?;
    let mut chunk = first_chunk(size_of::<K>() + size_of::<V>());
    // SAFETY: Pod types are plain data, valid for any bit pattern, zeros included.
    let (mut keys, mut values): (Vec<K>, Vec<V>) =
        unsafe { (vec![std::mem::zeroed(); chunk], vec![std::mem::zeroed(); chunk]) };
    // The kernel's batch token is a bucket index for hash maps, an index for arrays.
    let (mut position, mut next): (u32, u32) = (0, 0);
    let mut started = false;
    loop {
        let mut attr = BatchAttr::new(fd, keys.as_mut_ptr() as u64, values.as_mut_ptr() as u64, chunk as u32);
        if started {
            attr.in_batch = &position as *const u32 as u64;
        }
        attr.out_batch = &mut next as *mut u32 as u64;
        // SAFETY: attr points at buffers of `count` keys and values, and at the positions, that
        // live through the call.
        let error = unsafe { call(command, &mut attr) }.err();
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
    use aya::maps::HashMap as BpfHashMap;

    use super::*;
    use crate::test_maps::{new_map, BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_HASH};
    use profiler_common::Stack;

    fn entries(map: &Map) -> Vec<(u32, u64)> {
        let mut entries = Vec::new();
        for_each(map, |&key: &u32, &value: &u64| entries.push((key, value))).expect("a walk");
        entries.sort_unstable();
        entries
    }

    #[test]
    fn a_batch_deletion_skips_keys_gone_and_says_which_it_deleted() {
        let mut map = Map::HashMap(new_map(BPF_MAP_TYPE_HASH, 4, 8, 16));
        {
            let mut entries: BpfHashMap<_, u32, u64> = BpfHashMap::try_from(&mut map).expect("a hash map");
            for key in 0..10 {
                entries.insert(key, u64::from(key) * 10, 0).expect("an insert");
            }
        }
        // 99 was never there, 3 is asked twice: the kernel stops at each, the rest go.
        let deleted = delete(&map, vec![1u32, 2, 99, 3, 3, 8]).expect("a batch deletion");
        assert_eq!(deleted, [1, 2, 3, 8]);
        assert_eq!(entries(&map), [(0, 0), (4, 40), (5, 50), (6, 60), (7, 70), (9, 90)]);
        assert_eq!(delete(&map, Vec::<u32>::new()).expect("nothing to delete"), Vec::<u32>::new());
        assert_eq!(delete(&map, vec![99u32]).expect("a key gone"), Vec::<u32>::new());
    }

    #[test]
    fn a_batch_call_with_entries_of_another_size_is_refused() {
        let map = Map::Array(new_map(BPF_MAP_TYPE_ARRAY, 4, 8, 4));
        let refused = update(&map, &[1u32], &[10u32]).expect_err("4-byte values on a map of 8-byte ones");
        assert_eq!(
            refused.to_string(),
            "a batch call with 4-byte keys and 4-byte values on a map of 4-byte keys and 8-byte values"
        );
        assert!(for_each(&map, |_: &u64, _: &u64| {}).is_err());
    }

    #[test]
    fn a_batch_update_writes_every_slot_it_names_and_no_other() {
        let map = Map::Array(new_map(BPF_MAP_TYPE_ARRAY, 4, 8, 4));
        update(&map, &[1u32, 3], &[10u64, 30]).expect("a batch update");
        assert_eq!(entries(&map), [(0, 0), (1, 10), (2, 0), (3, 30)]);
        update(&map, &[3u32], &[0u64]).expect("a slot emptied");
        assert_eq!(entries(&map), [(0, 0), (1, 10), (2, 0), (3, 0)]);
    }

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
