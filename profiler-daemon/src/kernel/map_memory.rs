//! The kernel memory memprof's BPF maps take, and what they can grow to. Its hash maps take an
//! element's memory as each entry is inserted, so a daemon that starts well under its memory
//! cgroup's limit can be OOM-killed hours later, when traced processes fill them: said at start.

use std::path::Path;

/// `struct htab_elem`'s size on 64-bit kernels: the hash node, the LRU node and the hash, before
/// the key.
const HTAB_ELEM_BYTES: u64 = 48;
/// The list node the kernel's BPF allocator adds to each element it hands out.
const LLIST_NODE_BYTES: u64 = 8;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_PERCPU_HASH: u32 = 5;
const BPF_F_NO_PREALLOC: u32 = 1;

/// One map's description in `/proc/PID/fdinfo`.
#[derive(Debug, Default, PartialEq, Eq)]
struct MapFdInfo {
    map_type: u32,
    key_size: u64,
    value_size: u64,
    max_entries: u64,
    map_flags: u32,
    /// The kernel's own estimate of what the map takes now.
    memlock: u64,
}

impl MapFdInfo {
    fn parse(text: &str) -> Option<Self> {
        let field = |name: &str| {
            text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':')?.trim().parse::<u64>().ok())
        };
        let flags = text.lines().find_map(|line| line.strip_prefix("map_flags:"))?.trim();
        Some(Self {
            map_type: field("map_type")? as u32,
            key_size: field("key_size")?,
            value_size: field("value_size")?,
            max_entries: field("max_entries")?,
            map_flags: u32::from_str_radix(flags.trim_start_matches("0x"), 16).ok()?,
            memlock: field("memlock")?,
        })
    }

    /// What a full map takes beyond what it takes now, counting the entries it holds now as none
    /// (read at start, they are a handful). Preallocated maps are whole from the start.
    fn growth(&self, cpus: u64) -> u64 {
        let round = |bytes: u64| bytes.next_multiple_of(8);
        let grows = self.map_flags & BPF_F_NO_PREALLOC != 0;
        // As the kernel's `htab_map_mem_usage` counts a non-preallocated element.
        let element = match self.map_type {
            BPF_MAP_TYPE_HASH if grows => {
                HTAB_ELEM_BYTES + round(self.key_size) + round(self.value_size) + LLIST_NODE_BYTES
            }
            BPF_MAP_TYPE_PERCPU_HASH if grows => {
                // The element with a pointer to its values, the values' own list node and pointer.
                HTAB_ELEM_BYTES
                    + round(self.key_size)
                    + 8
                    + LLIST_NODE_BYTES
                    + LLIST_NODE_BYTES
                    + 8
                    + round(self.value_size) * cpus
            }
            _ => 0,
        };
        element * self.max_entries
    }
}

/// The BPF maps of this process: what they take now, and can grow to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapMemory {
    pub now_bytes: u64,
    pub growth_bytes: u64,
}

/// The maps this process holds a descriptor of, from `/proc/self/fdinfo`.
pub fn own_maps() -> MapMemory {
    let cpus = aya::util::nr_cpus().map_or(1, |n| n as u64);
    let Ok(entries) = std::fs::read_dir("/proc/self/fdinfo") else { return MapMemory::default() };
    let maps = entries.flatten().filter_map(|entry| map_at(&entry.path()));
    maps.fold(MapMemory::default(), |sum, map| MapMemory {
        now_bytes: sum.now_bytes + map.memlock,
        growth_bytes: sum.growth_bytes + map.growth(cpus),
    })
}

fn map_at(path: &Path) -> Option<MapFdInfo> {
    MapFdInfo::parse(&std::fs::read_to_string(path).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LIVE's fdinfo at its default size, on 6.18.
    const LIVE: &str = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t2085\nmap_type:\t1\nkey_size:\t16\n\
        value_size:\t32\nmax_entries:\t1048576\nmap_flags:\t0x1\nmap_extra:\t0x0\nmemlock:\t16778176\n\
        map_id:\t50\nfrozen:\t0\n";

    #[test]
    fn a_growing_hash_map_takes_an_element_per_entry_as_the_kernel_counts_it() {
        let live = MapFdInfo::parse(LIVE).unwrap();
        assert_eq!(live.memlock, 16_778_176);
        assert_eq!(live.growth(2), (48 + 16 + 32 + 8) * 1_048_576);
    }

    #[test]
    fn a_per_cpu_hash_map_grows_by_a_value_per_cpu_and_a_preallocated_one_not_at_all() {
        let per_cpu = LIVE.replace("map_type:\t1", "map_type:\t5");
        assert_eq!(MapFdInfo::parse(&per_cpu).unwrap().growth(4), (48 + 16 + 8 + 8 + 8 + 8 + 32 * 4) * 1_048_576);
        let preallocated = LIVE.replace("map_flags:\t0x1", "map_flags:\t0x0");
        assert_eq!(MapFdInfo::parse(&preallocated).unwrap().growth(2), 0);
        let array = LIVE.replace("map_type:\t1", "map_type:\t2");
        assert_eq!(MapFdInfo::parse(&array).unwrap().growth(2), 0);
    }

    #[test]
    fn a_file_that_is_not_a_map_is_none() {
        assert_eq!(MapFdInfo::parse("pos:\t0\nflags:\t02\nmnt_id:\t16\nino:\t7\n"), None);
    }
}
