//! The `slot` label: which of the traced processes of one command name a series belongs to.
//!
//! Series carry no pid by default: a restarted service would start new series each time, and a
//! fleet's Prometheus would fill with dead ones. A process's series are told apart from those of
//! the other processes of its name by a slot instead, the lowest one free when it was first seen.
//! A restarted service takes its old slot again, and with it its old series; nginx's workers are
//! `nginx` 0 to 3 after each reload.

use std::collections::{BTreeSet, HashMap};

#[derive(Debug, Default)]
pub struct Slots {
    /// Each process's command name and slot, as last assigned.
    held: HashMap<u32, (String, u32)>,
}

impl Slots {
    /// The slots of the processes now traced, by pid: a process keeps its slot while its name
    /// stays; a renamed one (an exec, `prctl`) takes the lowest free one of its new name.
    pub fn assign<'a>(&mut self, processes: impl IntoIterator<Item = (u32, &'a str)>) -> HashMap<u32, u32> {
        let processes: HashMap<u32, &str> = processes.into_iter().collect();
        self.held.retain(|pid, (comm, _)| processes.get(pid) == Some(&comm.as_str()));
        let mut taken: HashMap<&str, BTreeSet<u32>> = HashMap::new();
        for (comm, slot) in self.held.values() {
            taken.entry(comm).or_default().insert(*slot);
        }
        let mut newcomers: Vec<(u32, &str)> =
            processes.iter().filter(|(pid, _)| !self.held.contains_key(pid)).map(|(pid, comm)| (*pid, *comm)).collect();
        // The oldest pid first: the order in which processes start, except after pids wrap.
        newcomers.sort_unstable();
        let mut assigned = Vec::with_capacity(newcomers.len());
        for (pid, comm) in newcomers {
            let slots = taken.entry(comm).or_default();
            let slot = (0..).find(|slot| !slots.contains(slot)).expect("a free slot below u32::MAX");
            slots.insert(slot);
            assigned.push((pid, comm.to_string(), slot));
        }
        for (pid, comm, slot) in assigned {
            self.held.insert(pid, (comm, slot));
        }
        self.held.iter().map(|(pid, (_, slot))| (*pid, *slot)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_process_takes_its_old_slot_and_the_others_keep_theirs() {
        let mut slots = Slots::default();
        let first = slots.assign([(100, "nginx"), (101, "nginx"), (102, "nginx"), (200, "redis")]);
        assert_eq!((first[&100], first[&101], first[&102], first[&200]), (0, 1, 2, 0));
        // Worker 101 dies and a new one starts.
        let second = slots.assign([(100, "nginx"), (102, "nginx"), (200, "redis"), (300, "nginx")]);
        assert_eq!((second[&100], second[&102], second[&300], second[&200]), (0, 2, 1, 0));
        assert_eq!(second.len(), 4);
    }

    #[test]
    fn a_renamed_process_takes_a_slot_of_its_new_name() {
        let mut slots = Slots::default();
        slots.assign([(1, "sh"), (2, "app")]);
        let renamed = slots.assign([(1, "app"), (2, "app")]);
        assert_eq!((renamed[&2], renamed[&1]), (0, 1));
        let gone = slots.assign([(1, "app")]);
        assert_eq!(gone, HashMap::from([(1, 1)]));
    }
}
