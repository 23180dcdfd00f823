//! The symbolized stacks of one traced process, kept from one interval to the next: a stack the
//! kernel stored keeps its frames while the process's libraries stay, so an interval reads and
//! symbolizes only the stacks that are new to it (a daemon holding 65,536 stacks spent most of
//! its time at rest reading and symbolizing them all again). Bounded by the stacks in use: each
//! interval keeps those its report asked for, no others. The code mappings that hold their
//! frames are kept as well. `run` and `attach` keep one for a report only, which then names its
//! stacks a few hundred at a time.

use std::{
    cell::RefCell,
    collections::{BTreeSet, HashMap},
    mem,
};

use crate::symbolize::{Frames, Module};

/// A symbolized stack.
#[derive(Debug, Clone)]
pub struct Symbolized {
    pub frames: Frames,
    /// The allocation wrappers folded away from `frames` (see `report::Stacks::symbolize`); none
    /// in a stack as kept.
    pub via: Vec<String>,
    /// Stable across runs and processes: see `report::stack_hash`.
    pub id: String,
    pub truncated: bool,
}

/// A process's stacks by kernel stack id: those asked for this interval, and the last's.
#[derive(Debug, Default)]
pub struct KnownStacks {
    current: RefCell<HashMap<u64, Symbolized>>,
    previous: RefCell<HashMap<u64, Symbolized>>,
    /// The code mappings last asked for, and the files they were asked for: the same files
    /// give the same mappings until the libraries change.
    modules: RefCell<Option<(BTreeSet<String>, Vec<Module>)>>,
}

impl KnownStacks {
    /// `stack_id`'s stack, symbolized by `symbolize` unless known.
    pub fn get_or(&self, stack_id: u64, symbolize: impl FnOnce() -> Symbolized) -> Symbolized {
        self.fill([stack_id], |_| vec![symbolize()]);
        self.current.borrow()[&stack_id].clone()
    }

    /// Makes each of `stack_ids` known, those not known yet symbolized together by `symbolize`
    /// (one stack for each id it is given, in order).
    pub fn fill(&self, stack_ids: impl IntoIterator<Item = u64>, symbolize: impl FnOnce(&[u64]) -> Vec<Symbolized>) {
        let mut missing = Vec::new();
        {
            let mut current = self.current.borrow_mut();
            let mut previous = self.previous.borrow_mut();
            for id in stack_ids {
                if current.contains_key(&id) {
                    continue;
                }
                match previous.remove(&id) {
                    Some(stack) => {
                        current.insert(id, stack);
                    }
                    None => missing.push(id),
                }
            }
        }
        missing.sort_unstable();
        missing.dedup();
        if !missing.is_empty() {
            let stacks = symbolize(&missing);
            self.current.borrow_mut().extend(missing.into_iter().zip(stacks));
        }
    }

    /// The code mappings that hold frames of `paths`, from `ask` unless these were the files
    /// asked for last.
    pub fn modules_or(
        &self,
        paths: BTreeSet<String>,
        ask: impl FnOnce(BTreeSet<String>) -> Vec<Module>,
    ) -> Vec<Module> {
        let mut kept = self.modules.borrow_mut();
        match &*kept {
            Some((asked, modules)) if *asked == paths => modules.clone(),
            _ => {
                let modules = ask(paths.clone());
                *kept = Some((paths, modules.clone()));
                modules
            }
        }
    }

    /// A new interval: the stacks the last did not ask for go at the end of this one.
    pub fn next_interval(&self) {
        *self.previous.borrow_mut() = mem::take(&mut *self.current.borrow_mut());
    }

    /// The process's libraries changed, or a walk it deferred was finished: every stack is
    /// symbolized again.
    pub fn forget(&self) {
        self.current.borrow_mut().clear();
        self.previous.borrow_mut().clear();
        self.modules.borrow_mut().take();
    }
}
