//! Memory outside malloc (docs: guide/mappings.md#memory-outside-malloc-mappings): the anonymous private memory a process holds from
//! `mmap`, `mremap` and `brk`, by the stack that asked for it. A view of its own, never added to
//! the heap's figures: what a probed allocator maps for its blocks (glibc's large blocks, its
//! heap's growth by `brk`) is marked as the allocator's, as the heap's blocks count it already.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::{kernel::mappings::MappedStack, symbolize::Frames};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Mappings {
    /// Held from calls made outside any probed allocator call: memory the heap does not count.
    pub outstanding_bytes: u64,
    /// Held from calls made inside one (in sampled mode, inside those drawn only): the heap's
    /// blocks count these bytes already.
    pub allocator_bytes: u64,
    /// The stacks, most bytes first (at most 100, or the report's top).
    pub stacks: Vec<MappingStack>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MappingStack {
    pub stack_id: String,
    pub outstanding_bytes: u64,
    /// Ranges it holds: a mapping cut in two by a `munmap` counts twice.
    pub ranges: u64,
    /// Mapped inside a probed allocator call.
    pub in_allocator: bool,
    pub truncated: bool,
    pub frames: Frames,
}

/// A stack's report id, whether its walk was cut, and its frames.
pub type Symbolized = (String, bool, Frames);

/// The report of a process's `mapped` stacks (most bytes first), at most `limit` of them;
/// `symbolize` names a kernel stack id. Two kernel ids with the same frames (a walk the kernel
/// deferred and one it finished) are one stack. Stacks past the limit are only counted.
pub fn build(mapped: &[MappedStack], limit: usize, symbolize: impl Fn(u64) -> Symbolized) -> Mappings {
    let mut mappings = Mappings::default();
    let mut index: HashMap<(String, bool), usize> = HashMap::new();
    for stack in mapped {
        if stack.in_allocator {
            mappings.allocator_bytes += stack.bytes;
        } else {
            mappings.outstanding_bytes += stack.bytes;
        }
        if mappings.stacks.len() >= limit {
            continue;
        }
        let (stack_id, truncated, frames) = symbolize(stack.stack_id);
        let key = (stack_id.clone(), stack.in_allocator);
        match index.get(&key) {
            Some(&same) => {
                let listed: &mut MappingStack = &mut mappings.stacks[same];
                listed.outstanding_bytes += stack.bytes;
                listed.ranges += stack.ranges;
            }
            None => {
                index.insert(key, mappings.stacks.len());
                mappings.stacks.push(MappingStack {
                    stack_id,
                    outstanding_bytes: stack.bytes,
                    ranges: stack.ranges,
                    in_allocator: stack.in_allocator,
                    truncated,
                    frames,
                });
            }
        }
    }
    mappings.stacks.sort_by(|a, b| b.outstanding_bytes.cmp(&a.outstanding_bytes).then(a.stack_id.cmp(&b.stack_id)));
    mappings
}
