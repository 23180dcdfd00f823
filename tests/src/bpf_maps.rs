//! The BPF maps a memprof process holds, as bpftool sees them.

use std::process::Command;

use serde_json::Value;

/// What bpftool says of the BPF map `name` that process `pid` holds (its `id`, `max_entries`...),
/// found by its descriptors; None when it holds no map of that name.
pub fn map_info(pid: u32, name: &str) -> Option<Value> {
    let ids: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .ok()?
        .flatten()
        .filter_map(|fd| {
            let info = std::fs::read_to_string(fd.path()).ok()?;
            info.lines().find_map(|line| line.strip_prefix("map_id:")).map(|id| id.trim().to_string())
        })
        .collect();
    ids.iter().find_map(|id| {
        let shown = Command::new("bpftool").args(["map", "show", "id", id, "-j"]).output().ok()?;
        let map: Value = serde_json::from_slice(&shown.stdout).ok()?;
        (map["name"] == name).then_some(map)
    })
}

/// The capacity (`max_entries`) of the BPF map `name` that process `pid` holds.
pub fn map_capacity(pid: u32, name: &str) -> Option<u64> {
    map_info(pid, name)?["max_entries"].as_u64()
}

/// The sum of the slots of the mappable array of u64 `name` that process `pid` holds, read
/// through a mapping of it (bpftool would print each of its slots).
pub fn array_sum(pid: u32, name: &str) -> u64 {
    let map = map_info(pid, name).unwrap_or_else(|| panic!("pid {pid} holds no map {name}"));
    let (id, slots) = (map["id"].as_u64().unwrap() as u32, map["max_entries"].as_u64().unwrap() as usize);
    // BPF_MAP_GET_FD_BY_ID: union bpf_attr's map_id, next_id and open_flags.
    let attr = [id, 0, 0];
    // SAFETY: the attr lives across the call, and its size is given.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 14, attr.as_ptr(), size_of_val(&attr)) };
    assert!(fd >= 0, "opening map {name} ({id}): {}", std::io::Error::last_os_error());
    let fd = fd as i32;
    let bytes = slots * size_of::<u64>();
    // SAFETY: a read-only shared mapping of the map's memory, unmapped below.
    let address = unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
    assert_ne!(address, libc::MAP_FAILED, "mapping {name}: {}", std::io::Error::last_os_error());
    // SAFETY: `slots` u64s are mapped at `address`; `address` and `fd` are ours to release.
    unsafe {
        let sum = std::slice::from_raw_parts(address.cast::<u64>(), slots).iter().fold(0u64, |a, b| a.wrapping_add(*b));
        libc::munmap(address, bytes);
        libc::close(fd);
        sum
    }
}
