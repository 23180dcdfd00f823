//! Bytes and blocks per C++ type (`--inspect`; JSON `"types"`): a block is of type T when its
//! first word points into T's vtable (`process::vtables`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::{heap::reachability::Memory, kernel::live::LiveBlock};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeCount {
    /// Demangled, e.g. `ns::Widget`.
    #[serde(rename = "type")]
    pub name: String,
    pub bytes: u64,
    pub blocks: u64,
}

/// Each block's first word (0 for a block shorter than a word, or unreadable).
pub fn first_words(memory: &impl Memory, blocks: &[LiveBlock]) -> Vec<u64> {
    blocks
        .iter()
        .map(|block| {
            let mut word = [0u8; 8];
            if block.size < 8 || memory.read(block.addr, &mut word) < 8 {
                return 0;
            }
            u64::from_ne_bytes(word)
        })
        .collect()
}

/// The typed blocks' counts, per type: all blocks together, and per kernel stack id.
pub fn tally(
    blocks: &[LiveBlock],
    words: &[u64],
    names: &HashMap<u64, String>,
) -> (Vec<TypeCount>, HashMap<u64, Vec<TypeCount>>) {
    let mut all = Vec::new();
    let mut per_stack: HashMap<u64, Vec<TypeCount>> = HashMap::new();
    for (block, word) in blocks.iter().zip(words) {
        let Some(name) = names.get(word) else { continue };
        let one = TypeCount { name: name.clone(), bytes: block.size, blocks: 1 };
        add(&mut all, &one);
        add(per_stack.entry(block.stack_id).or_default(), &one);
    }
    sort(&mut all);
    per_stack.values_mut().for_each(|counts| sort(counts));
    (all, per_stack)
}

/// Adds `more` into `into`, kept most bytes first.
pub fn merge(into: &mut Vec<TypeCount>, more: &[TypeCount]) {
    more.iter().for_each(|count| add(into, count));
    sort(into);
}

fn add(into: &mut Vec<TypeCount>, count: &TypeCount) {
    match into.iter_mut().find(|c| c.name == count.name) {
        Some(known) => {
            known.bytes += count.bytes;
            known.blocks += count.blocks;
        }
        None => into.push(count.clone()),
    }
}

/// Most bytes first, then by name for a stable order.
fn sort(counts: &mut [TypeCount]) {
    counts.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_counted_per_type_and_stack() {
        let block = |addr, size, stack_id| LiveBlock { addr, size, stack_id, weighted_bytes: size };
        let blocks = [block(0x10, 16, 1), block(0x20, 40, 1), block(0x50, 16, 2), block(0x60, 24, 2)];
        let words = [0xc1, 0xa1, 0xc1, 0];
        let names = HashMap::from([(0xc1, "Circle".to_string()), (0xa1, "ns::Widget".to_string())]);
        let (all, per_stack) = tally(&blocks, &words, &names);
        let count = |name: &str, bytes, blocks| TypeCount { name: name.into(), bytes, blocks };
        assert_eq!(all, [count("ns::Widget", 40, 1), count("Circle", 32, 2)]);
        assert_eq!(per_stack[&1], [count("ns::Widget", 40, 1), count("Circle", 16, 1)]);
        assert_eq!(per_stack[&2], [count("Circle", 16, 1)]);
    }
}
