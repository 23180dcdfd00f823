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
/// deferred and one it finished) are one stack, merged before the limit is applied: a part that
/// ranks below it still adds to its stack. Stacks past the limit are only counted.
pub fn build(mapped: &[MappedStack], limit: usize, symbolize: impl Fn(u64) -> Symbolized) -> Mappings {
    let mut mappings = Mappings::default();
    let mut index: HashMap<(String, bool), usize> = HashMap::new();
    for stack in mapped {
        if stack.in_allocator {
            mappings.allocator_bytes += stack.bytes;
        } else {
            mappings.outstanding_bytes += stack.bytes;
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
    mappings.stacks.truncate(limit);
    mappings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples::frame;

    fn mapped(stack_id: u64, bytes: u64) -> MappedStack {
        MappedStack { stack_id, in_allocator: true, bytes, ranges: 1 }
    }

    /// Kernel ids 1 and 3 are one stack (a deferred walk and a finished one): the smaller part,
    /// past the limit on its own, still adds to the stack listed.
    #[test]
    fn parts_of_one_stack_are_merged_before_the_limit() {
        let symbolize = |id: u64| -> Symbolized {
            let name = if id == 3 { 1 } else { id };
            (name.to_string(), false, vec![frame(&format!("site_{name}"), None, None)].into())
        };
        let built = build(&[mapped(1, 900_000), mapped(2, 500_000), mapped(3, 100_000)], 1, symbolize);
        let listed: Vec<(&str, u64, u64)> =
            built.stacks.iter().map(|s| (s.stack_id.as_str(), s.outstanding_bytes, s.ranges)).collect();
        assert_eq!(listed, [("1", 1_000_000, 2)]);
        assert_eq!(built.allocator_bytes, 1_500_000);
    }
}
