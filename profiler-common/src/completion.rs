//! An allocation probe at the last branch of an allocator's fast path (the daemon's
//! `process::fast_path`): where the branch goes one way, the call returns without another branch,
//! and the block it returns is already in a register. The probe's program then records the
//! whole call at once, and the call needs no return probe: one trap instead of two.
//!
//! Its cookie says which way completes the call and where the block is, above the `AllocFn`.
//! A fast path may move the size out of its argument's register (mimalloc's `malloc` moves it to
//! `rsi`): the cookie then names that register too (`probe_cookies::moved_argument`).

/// Set in the cookie of an allocation probe at a completion site.
const COMPLETION: u64 = 1 << 32;
const CONDITION_SHIFT: u32 = 33;
const RESULT_SHIFT: u32 = 37;

/// An x86 general register, by its number in instruction encodings (rax 0, rcx 1, ..., r15 15).
pub type RegisterNumber = u8;
pub const RAX: RegisterNumber = 0;
pub const RSI: RegisterNumber = 6;
pub const RDI: RegisterNumber = 7;

/// What a completion site's program needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The x86 condition (`jcc`'s low four bits: 4 `e`, 5 `ne`, ...) that, holding in the flags
    /// at the branch, sends the call to its return.
    pub condition: u8,
    /// The register whose value at the branch the call returns.
    pub result: RegisterNumber,
}

impl Completion {
    /// The cookie of the probe at this site of an allocation function whose `AllocFn` is `func`.
    pub fn cookie(self, func: u32) -> u64 {
        u64::from(func)
            | COMPLETION
            | u64::from(self.condition & 0xf) << CONDITION_SHIFT
            | u64::from(self.result & 0xf) << RESULT_SHIFT
    }

    /// The site an allocation probe's `cookie` (its shared bit cleared) names, if it names one.
    pub fn of(cookie: u64) -> Option<Completion> {
        (cookie & COMPLETION != 0).then_some(Completion {
            condition: ((cookie >> CONDITION_SHIFT) & 0xf) as u8,
            result: ((cookie >> RESULT_SHIFT) & 0xf) as u8,
        })
    }

    /// Whether the call completes, given the flags register at the branch (`eflags`).
    pub fn completes(self, flags: u64) -> bool {
        condition_holds(self.condition, flags)
    }
}

const CF: u64 = 1;
const PF: u64 = 1 << 2;
const ZF: u64 = 1 << 6;
const SF: u64 = 1 << 7;
const OF: u64 = 1 << 11;

/// Whether x86 condition `condition` (0 `o` to 15 `g`) holds in `flags`, as a `jcc` tests it.
pub fn condition_holds(condition: u8, flags: u64) -> bool {
    let set = |flag: u64| flags & flag != 0;
    let positive = match condition >> 1 {
        0 => set(OF),
        1 => set(CF),
        2 => set(ZF),
        3 => set(CF) || set(ZF),
        4 => set(SF),
        5 => set(PF),
        6 => set(SF) != set(OF),
        _ => set(ZF) || set(SF) != set(OF),
    };
    positive != (condition & 1 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_rides_above_its_function_in_the_cookie() {
        let site = Completion { condition: 5, result: 11 };
        let cookie = site.cookie(0);
        assert_eq!(Completion::of(cookie), Some(site));
        assert_eq!(cookie as u32, 0, "the function, below");
        assert_eq!(Completion::of(7), None, "an entry probe's cookie");
        assert_eq!(cookie & crate::SHARED_LINK, 0);
    }

    #[test]
    fn conditions_read_the_flags_as_jcc_does() {
        let (e, ne, ae, a, l, g) = (4, 5, 3, 7, 12, 15);
        assert!(condition_holds(e, ZF) && !condition_holds(ne, ZF));
        assert!(condition_holds(ne, 0) && !condition_holds(e, 0));
        assert!(condition_holds(ae, 0) && !condition_holds(ae, CF));
        assert!(condition_holds(a, 0) && !condition_holds(a, ZF) && !condition_holds(a, CF));
        assert!(condition_holds(l, SF) && !condition_holds(l, SF | OF));
        assert!(condition_holds(g, SF | OF) && !condition_holds(g, ZF));
    }
}
