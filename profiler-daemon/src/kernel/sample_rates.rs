//! The sampling rate of each process that samples, where the programs read it: the hash
//! `SAMPLING` (what user space reads back) and the array `SAMPLE_RATES`, which the programs try
//! first on every call (see `profiler_common::SampleRate`).

use anyhow::Context as _;
use aya::{
    maps::{Array, HashMap},
    Ebpf,
};
use profiler_common::{rate_slot, SampleRate};

/// Records `pid`'s allocations by sampling from now on, one in every `sample_bytes` bytes on
/// average (see `profiler_common::weight`). Never undone while it lives: a block's weight at free
/// must be the one it was allocated with.
pub fn set(ebpf: &mut Ebpf, pid: u32, sample_bytes: u64) -> anyhow::Result<()> {
    let mut rates: HashMap<_, u32, u64> = HashMap::try_from(map(ebpf, "SAMPLING")?)?;
    let known = rates.get(&pid, 0).is_ok();
    // The hash first: a call that finds the slot counting a process not in it yet is recorded
    // whole, which is only a few calls more recorded.
    rates.insert(pid, sample_bytes, 0)?;
    let mut slots: Array<_, SampleRate> = Array::try_from(map(ebpf, "SAMPLE_RATES")?)?;
    let index = rate_slot(pid);
    let mut slot = slots.get(&index, 0)?;
    slot.claim(pid, sample_bytes, known);
    slots.set(index, slot, 0)?;
    Ok(())
}

/// The rate of each process that samples.
pub fn of(ebpf: &Ebpf) -> anyhow::Result<std::collections::HashMap<u32, u64>> {
    let map = ebpf.map("SAMPLING").context("map SAMPLING missing from the eBPF object")?;
    let rates: HashMap<_, u32, u64> = HashMap::try_from(map)?;
    Ok(rates.iter().filter_map(Result::ok).collect())
}

/// Forgets the rates of the processes `gone` says have left.
pub fn forget(ebpf: &mut Ebpf, gone: impl Fn(u32) -> bool) -> anyhow::Result<()> {
    let rates: HashMap<_, u32, u64> = HashMap::try_from(map(ebpf, "SAMPLING")?)?;
    let leaving: Vec<u32> = rates.keys().filter_map(Result::ok).filter(|&pid| gone(pid)).collect();
    let mut slots: Array<_, SampleRate> = Array::try_from(map(ebpf, "SAMPLE_RATES")?)?;
    for &pid in &leaving {
        let index = rate_slot(pid);
        let mut slot = slots.get(&index, 0)?;
        slot.release(pid);
        slots.set(index, slot, 0)?;
    }
    let mut rates: HashMap<_, u32, u64> = HashMap::try_from(map(ebpf, "SAMPLING")?)?;
    for pid in leaving {
        let _ = rates.remove(&pid);
    }
    Ok(())
}

fn map<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut aya::maps::Map> {
    ebpf.map_mut(name).with_context(|| format!("map {name} missing from the eBPF object"))
}
