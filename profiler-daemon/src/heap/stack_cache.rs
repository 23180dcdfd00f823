//! A process's symbolized stacks by kernel stack id, kept from one report to the next. The daemon
//! builds a report every interval; reading every stored stack from the kernel and symbolizing it
//! again each time took it 46% of a core at rest with 65,536 stacks. A stored stack's addresses
//! never change (its id is their hash, collisions refused), so its frames change only when the
//! process's mappings do: its owner clears the cache then, and drops it with the process.

use std::{cell::RefCell, collections::HashMap};

use crate::symbolize::Frame;

/// A symbolized stack.
#[derive(Debug, Clone)]
pub struct Symbolized {
    pub frames: Vec<Frame>,
    /// Stable across runs and processes: see `report::stack_hash`.
    pub id: String,
    pub truncated: bool,
    /// Its walk is over: not one the kernel deferred and memprof has not finished yet.
    pub settled: bool,
}

/// The stacks of the last report, by kernel stack id.
#[derive(Debug, Default)]
pub struct StackCache {
    stacks: RefCell<HashMap<u64, Symbolized>>,
}

impl StackCache {
    /// Takes the stacks out, for a report to pick those it lists.
    pub fn take(&self) -> HashMap<u64, Symbolized> {
        std::mem::take(&mut self.stacks.borrow_mut())
    }

    /// Keeps `stacks` for the next report: those of the report just built, so that the stacks no
    /// longer listed go.
    pub fn keep(&self, stacks: HashMap<u64, Symbolized>) {
        *self.stacks.borrow_mut() = stacks;
    }

    /// Forgets every stack: the process's mappings changed, or it is another program.
    pub fn clear(&self) {
        self.stacks.borrow_mut().clear();
    }
}
