//! Stack unwinding without frame pointers: per-file CFI tables for the kernel's stack walk, and
//! the events that say a process mapped new code.

mod registry;
mod shards;
mod space;
pub mod table;

use aya::{
    maps::{MapData, RingBuf},
    Ebpf,
};
pub use registry::{Registry, TableUse, UnwindMode};

/// Processes whose dynamic linker reported a change to their libraries (`mappings_changed`).
pub struct MappingEvents {
    ring: RingBuf<MapData>,
}

impl MappingEvents {
    pub fn new(ebpf: &mut Ebpf) -> anyhow::Result<Self> {
        let map = ebpf.take_map("MAPPINGS_CHANGED").ok_or_else(|| anyhow::anyhow!("map MAPPINGS_CHANGED missing"))?;
        Ok(Self { ring: RingBuf::try_from(map)? })
    }

    /// The processes reported since the last call, each once.
    pub fn drain(&mut self) -> Vec<u32> {
        let mut tgids = Vec::new();
        while let Some(item) = self.ring.next() {
            if let Some(bytes) = item.get(..4) {
                let tgid = u32::from_ne_bytes(bytes.try_into().expect("four bytes"));
                if !tgids.contains(&tgid) {
                    tgids.push(tgid);
                }
            }
        }
        tgids
    }

    /// For waiting on events with poll or an async reactor.
    pub fn ring(&self) -> &RingBuf<MapData> {
        &self.ring
    }
}
