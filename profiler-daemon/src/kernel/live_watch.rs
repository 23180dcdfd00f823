//! The changes to one process's `LIVE` entries while it is inspected (see
//! `profiler_common::LiveWatch`): an inspection lists the process's blocks before the stop, and in
//! the stop reads again only those that changed meanwhile. The whole table holds every traced
//! process's blocks, and reading it all held a busy process still for seconds beside millions of
//! other processes' blocks.
//!
//! Why nothing is missed: a program makes a change under its hash bucket's lock, then notes it.
//! The listing, read after the watch starts, takes each bucket's lock in turn: a change it does
//! not see was made after it left the bucket, so after the watch started, and is noted.

use std::os::fd::AsFd as _;

use anyhow::Context as _;
use aya::{
    maps::{Array, Map, MapData},
    Ebpf,
};
use profiler_common::LiveWatch;

use crate::kernel::{aggregate, batch};

/// Notes `tgid`'s changes while it lives; a process is watched by one inspection at a time.
pub struct Watch {
    watch: Map,
    changes: Map,
}

impl Watch {
    /// Starts noting `tgid`'s changes, emptied of what an earlier watch may have left.
    pub fn start(ebpf: &Ebpf, tgid: u32) -> anyhow::Result<Watch> {
        let mut watch = Watch { watch: owned(ebpf, "LIVE_WATCH")?, changes: owned(ebpf, "LIVE_CHANGES")? };
        watch.forget_changes()?;
        watch.set(LiveWatch { tgid, overflowed: 0 })?;
        Ok(watch)
    }

    /// The addresses of the blocks that changed since the start, taken out of the kernel's set
    /// (the process is held still: none is added meanwhile); `None` when some could not be noted.
    pub fn changed(&mut self) -> anyhow::Result<Option<Vec<u64>>> {
        let state = Array::<_, LiveWatch>::try_from(&self.watch)?.get(&0, 0)?;
        let mut addresses = Vec::new();
        batch::drain(&self.changes, |address: &u64, _: &u8| addresses.push(*address))?;
        Ok((state.overflowed == 0).then_some(addresses))
    }

    fn set(&mut self, state: LiveWatch) -> anyhow::Result<()> {
        Array::<_, LiveWatch>::try_from(&mut self.watch)?.set(0, state, 0)?;
        Ok(())
    }

    fn forget_changes(&self) -> anyhow::Result<()> {
        batch::drain(&self.changes, |_: &u64, _: &u8| {})
    }
}

impl Drop for Watch {
    /// Stops noting, then empties the set. A program that read the watch just before may still
    /// add an address: the next watch empties it first.
    fn drop(&mut self) {
        let stopped = self.set(LiveWatch::default()).and_then(|()| self.forget_changes());
        if let Err(err) = stopped {
            tracing::warn!("could not stop watching the live blocks' changes: {err:#}");
        }
    }
}

/// A handle of its own on the map `name`: the watch outlives borrows of `ebpf` meanwhile.
fn owned(ebpf: &Ebpf, name: &str) -> anyhow::Result<Map> {
    let map = aggregate::map(ebpf, name)?;
    let (Map::Array(data) | Map::HashMap(data)) = map else {
        anyhow::bail!("map {name} is neither an array nor a hash map");
    };
    let fd = data.fd().as_fd().try_clone_to_owned().with_context(|| format!("duplicating map {name}"))?;
    let data = MapData::from_fd(fd).with_context(|| format!("opening map {name}"))?;
    Ok(match map {
        Map::Array(_) => Map::Array(data),
        _ => Map::HashMap(data),
    })
}
