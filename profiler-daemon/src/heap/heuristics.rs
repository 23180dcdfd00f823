//! memcheck's leak-check heuristics (`--leak-check-heuristics`, all on by default): shapes of
//! block in which C++ and some C libraries keep a pointer into a block's interior, not to its
//! start, for as long as the block is in use. memcheck takes a pointer that one of them accepts
//! as a pointer to the block's start (`heuristic_reachedness` in `mc_leakcheck.c`); so does
//! `reachability`, with the same rules:
//!
//! - `stdstring`: the old (copy-on-write) `std::string`, a block of length, capacity and
//!   reference count followed by the characters and their `\0`, held by a pointer to its
//!   characters (offset 24) when `24 + capacity + 1` is the block's size and the length is at
//!   most the capacity;
//! - `length64`: a block whose first 8 bytes hold the size of the rest (sqlite), held by a
//!   pointer past them;
//! - `newarray`: `new T[n]` of a class with a destructor, whose first 8 bytes hold `n` (a
//!   non-zero count that divides the rest), held by a pointer past them;
//! - `multipleinheritance`: an object held through a base class's sub-object, the pointer at a
//!   word that points into a vtable while the block's first word does too.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

use crate::kernel::live::LiveBlock;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Heuristic {
    StdString,
    Length64,
    NewArray,
    MultipleInheritance,
}

impl Heuristic {
    /// In memcheck's order, which is the order they are tried in.
    pub const ALL: [Heuristic; 4] =
        [Heuristic::StdString, Heuristic::Length64, Heuristic::NewArray, Heuristic::MultipleInheritance];

    /// memcheck's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Heuristic::StdString => "stdstring",
            Heuristic::Length64 => "length64",
            Heuristic::NewArray => "newarray",
            Heuristic::MultipleInheritance => "multipleinheritance",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The heuristics in use, written as memcheck's option takes them: `all`, `none` or a comma
/// list of names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heuristics(u8);

impl Heuristics {
    pub const ALL: Heuristics = Heuristics(0b1111);
    pub const NONE: Heuristics = Heuristics(0);

    pub fn contains(self, heuristic: Heuristic) -> bool {
        self.0 & heuristic.bit() != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl Default for Heuristics {
    fn default() -> Self {
        Heuristics::ALL
    }
}

impl FromStr for Heuristics {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "all" => return Ok(Heuristics::ALL),
            "none" => return Ok(Heuristics::NONE),
            _ => {}
        }
        let mut set = Heuristics::NONE;
        for name in text.split(',') {
            let Some(heuristic) = Heuristic::ALL.into_iter().find(|h| h.name() == name.trim()) else {
                return Err(format!(
                    "no heuristic is called '{name}': give all, none or a comma list of stdstring, length64, newarray, multipleinheritance"
                ));
            };
            set.0 |= heuristic.bit();
        }
        Ok(set)
    }
}

impl fmt::Display for Heuristics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Heuristics::ALL => f.write_str("all"),
            Heuristics::NONE => f.write_str("none"),
            set => {
                let names: Vec<&str> =
                    Heuristic::ALL.into_iter().filter(|h| set.contains(*h)).map(Heuristic::name).collect();
                f.write_str(&names.join(","))
            }
        }
    }
}

/// What the heuristics read of the target: its words, and whether an address is a vtable's.
pub trait Words {
    /// The aligned 8-byte word at `addr`, if it could be read.
    fn word(&self, addr: u64) -> Option<u64>;
    /// memcheck's test: `addr` is in a readable file mapping, and of the words from it (at most
    /// 21, not past the mapping's last word but one) the first two that are not zero point into
    /// executable file mappings, with none before them pointing elsewhere.
    fn is_vtable(&self, addr: u64) -> bool;
}

/// The first of `heuristics` that takes `ptr`, a pointer into the interior of `block`, for a
/// pointer to its start.
pub fn accepting(heuristics: Heuristics, block: &LiveBlock, ptr: u64, words: &impl Words) -> Option<Heuristic> {
    // A word of the block: none past its end (memcheck's words there are not addressable).
    let word = |offset: u64| (offset + 8 <= block.size).then(|| words.word(block.addr + offset)).flatten();
    // The size asked for the block: a block memprof did not see made has only its usable size,
    // what glibc rounds a request up to (less than 16 bytes more).
    let asked = |requested: u64| match block.stack_id {
        super::untracked::UNSEEN => requested <= block.size && block.size - requested < 16,
        _ => requested == block.size,
    };
    let offset = ptr - block.addr;
    Heuristic::ALL.into_iter().filter(|h| heuristics.contains(*h)).find(|heuristic| match heuristic {
        Heuristic::StdString => {
            offset == 24
                && word(8).is_some_and(|capacity| {
                    asked(capacity.wrapping_add(25)) && word(0).is_some_and(|length| length <= capacity)
                })
        }
        Heuristic::Length64 => offset == 8 && word(0).is_some_and(|size| size > 0 && asked(size.wrapping_add(8))),
        Heuristic::NewArray => {
            offset == 8 && word(0).is_some_and(|count| count > 0 && (block.size - 8).is_multiple_of(count))
        }
        Heuristic::MultipleInheritance => {
            let plausible = |addr: u64| addr.is_multiple_of(8) && addr >= 4096;
            ptr.is_multiple_of(8)
                && word(offset).is_some_and(|inner| {
                    plausible(inner)
                        && word(0)
                            .is_some_and(|first| plausible(first) && words.is_vtable(inner) && words.is_vtable(first))
                })
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    #[derive(Default)]
    struct Memory {
        words: BTreeMap<u64, u64>,
        vtables: BTreeSet<u64>,
    }

    impl Words for Memory {
        fn word(&self, addr: u64) -> Option<u64> {
            Some(self.words.get(&addr).copied().unwrap_or(0))
        }
        fn is_vtable(&self, addr: u64) -> bool {
            self.vtables.contains(&addr)
        }
    }

    fn check(block: LiveBlock, words: &[(u64, u64)], vtables: &[u64], ptr: u64) -> Option<Heuristic> {
        let memory = Memory { words: words.iter().copied().collect(), vtables: vtables.iter().copied().collect() };
        accepting(Heuristics::ALL, &block, ptr, &memory)
    }

    const A: u64 = 0x1000;

    fn block(size: u64) -> LiveBlock {
        LiveBlock { addr: A, size, stack_id: 0, weighted_bytes: size }
    }

    #[test]
    fn each_shape_is_taken_by_its_heuristic_and_no_other() {
        // A COW string of capacity 15 holding 5 characters: 24 + 15 + 1 bytes.
        assert_eq!(check(block(40), &[(A, 5), (A + 8, 15)], &[], A + 24), Some(Heuristic::StdString));
        assert_eq!(check(block(40), &[(A, 16), (A + 8, 15)], &[], A + 24), None);
        // 8 bytes of length then 56: length64 is tried before newarray, which takes it too.
        assert_eq!(check(block(64), &[(A, 56)], &[], A + 8), Some(Heuristic::Length64));
        // new T[3] of 16-byte T.
        assert_eq!(check(block(56), &[(A, 3)], &[], A + 8), Some(Heuristic::NewArray));
        assert_eq!(check(block(56), &[(A, 5)], &[], A + 8), None);
        assert_eq!(check(block(56), &[(A, 0)], &[], A + 8), None);
        // An object whose second base's vtable pointer is at 16.
        let words = [(A, 0x40_0010), (A + 16, 0x40_0080)];
        assert_eq!(check(block(32), &words, &[0x40_0010, 0x40_0080], A + 16), Some(Heuristic::MultipleInheritance));
        assert_eq!(check(block(32), &words, &[0x40_0080], A + 16), None);
        assert_eq!(check(block(32), &words, &[0x40_0010, 0x40_0080], A + 12), None);
    }

    /// A block memprof did not see made has its usable size, up to 15 bytes past what was asked:
    /// the string of capacity 15 (40 bytes asked) in a chunk of 48 usable.
    #[test]
    fn a_block_not_seen_made_is_taken_by_its_usable_size() {
        let unseen = |size| LiveBlock { stack_id: crate::heap::untracked::UNSEEN, ..block(size) };
        assert_eq!(check(unseen(40 + 8), &[(A, 5), (A + 8, 15)], &[], A + 24), Some(Heuristic::StdString));
        assert_eq!(check(block(40 + 8), &[(A, 5), (A + 8, 15)], &[], A + 24), None);
        assert_eq!(check(unseen(40 + 16), &[(A, 5), (A + 8, 15)], &[], A + 24), None);
        assert_eq!(check(unseen(72), &[(A, 60)], &[], A + 8), Some(Heuristic::Length64));
    }

    #[test]
    fn only_the_heuristics_asked_for_are_tried() {
        let memory = Memory { words: [(A, 3)].into(), ..Memory::default() };
        let only: Heuristics = "length64,stdstring".parse().unwrap();
        assert_eq!(accepting(only, &block(56), A + 8, &memory), None);
        assert_eq!(accepting("newarray".parse().unwrap(), &block(56), A + 8, &memory), Some(Heuristic::NewArray));
        assert_eq!(accepting(Heuristics::NONE, &block(56), A + 8, &memory), None);
    }

    #[test]
    fn the_option_reads_and_writes_as_memchecks() {
        assert_eq!("all".parse::<Heuristics>(), Ok(Heuristics::ALL));
        assert_eq!("none".parse::<Heuristics>(), Ok(Heuristics::NONE));
        let set: Heuristics = "newarray,stdstring".parse().unwrap();
        assert_eq!(set.to_string(), "stdstring,newarray");
        let err = "stdstring,cow".parse::<Heuristics>().unwrap_err();
        assert!(err.starts_with("no heuristic is called 'cow': give all, none"), "{err}");
    }
}
