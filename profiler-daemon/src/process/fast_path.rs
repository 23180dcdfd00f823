//! One trap a call instead of two, for an allocation function whose fast path returns on its own
//! and leaves its slow path by a tail call (jemalloc's and mimalloc's `malloc`).
//!
//! An allocation's entry probe reads the size and its return probe the block: two traps a call.
//! Where the function's last branch before a `ret` leaves the size in its register and the block
//! in another, one probe on that branch sees both. Its program tells from the flags register
//! which way the branch goes (the kernel emulates the branch after the programs ran, from the
//! same flags): the way to the `ret` completes the call, which it records at once
//! (`profiler_common::completion`); the other leads to a later branch or to the slow path. The
//! slow path, a direct `jmp` out of the function taken with the stack and the size as at the
//! entry, gets the usual entry and return probes.
//!
//! Every way through the function from its entry is followed. The function qualifies only if
//! each way passes exactly one site that records it: the last branch of a way to a `ret` (taken
//! in that direction) or a `jmp` to the slow path, and if no way calls, loops, touches rsp or
//! rbp (the stack walk starts from them and the return address at `[rsp]`), or loses the size
//! before its site. The size may move: a register it was copied to holds it too (mimalloc's
//! `malloc` copies it to `rsi`, then writes `rdi`), and each site's probe is told where it is.
//! Anything else keeps the usual probes.

use iced_x86::{Code, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, Register};
use profiler_common::completion::{Completion, RegisterNumber, RAX, RDI};

use crate::process::placement;

/// More ways than this through a function's opening is no fast path.
const MAX_WAYS: usize = 64;

/// Where an allocation function whose only argument read is its size, in rdi, is probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FastPath {
    /// The `jmp`s to its slow path, each probed at entry and return.
    pub slow_paths: Vec<Site>,
    /// The branches that complete a call, and how.
    pub completions: Vec<(Site, Completion)>,
}

/// A probe site: its offset in the function, and the register that holds the size there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub offset: u64,
    pub size_register: RegisterNumber,
}

/// The fast path of the function whose bytes (its symbol's size of them) are `code`, if it has
/// one that qualifies (see the module's documentation).
pub fn of(code: &[u8]) -> Option<FastPath> {
    if code.is_empty() || code.len() > placement::MAX_FUNCTION_BYTES {
        return None;
    }
    let function = placement::decode(code)?;
    let ways = ways(&function, code)?;
    let mut fast_path = FastPath { slow_paths: Vec::new(), completions: Vec::new() };
    for way in &ways {
        match way.end {
            End::SlowPath(site) => add_once(&mut fast_path.slow_paths, site, |site| site.offset)?,
            End::Return(completion) => {
                let branch = *way.branches.last()?;
                // rsp and rbp are never the block (the program does not read them).
                let result = completion.filter(|&register| !frame_register(register))?;
                let completion = Completion { condition: branch.condition, result };
                add_once(&mut fast_path.completions, (branch.site, completion), |(site, _)| site.offset)?;
            }
        }
    }
    // Each way is recorded once: by its last branch if it returns, by its jump if it leaves.
    let recording = |branch: &Branch| {
        fast_path
            .completions
            .iter()
            .any(|(known, completion)| known.offset == branch.site.offset && completion.condition == branch.condition)
    };
    for way in &ways {
        let recorded = way.branches.iter().filter(|branch| recording(branch)).count();
        let expected = match way.end {
            End::Return(_) => way.branches.last().is_some_and(recording).then_some(1),
            End::SlowPath(_) => Some(0),
        };
        if expected != Some(recorded) {
            return None;
        }
    }
    (!fast_path.completions.is_empty()).then_some(fast_path)
}

/// Adds `item` to `known` where it is not there yet; `None` where another item has its offset (two
/// ways reach one site and disagree on what it does).
fn add_once<T: PartialEq>(known: &mut Vec<T>, item: T, offset: impl Fn(&T) -> u64) -> Option<()> {
    match known.iter().find(|other| offset(other) == offset(&item)) {
        Some(other) if *other != item => None,
        Some(_) => Some(()),
        None => {
            known.push(item);
            Some(())
        }
    }
}

/// How a way through the function ends.
#[derive(Debug, Clone, Copy)]
enum End {
    /// At a `ret`: the register whose value at the way's last branch it returns, if one does.
    Return(Option<RegisterNumber>),
    /// At a `jmp` out of the function.
    SlowPath(Site),
}

/// A conditional branch a way passes: where, and the condition that sends it this way.
#[derive(Debug, Clone, Copy)]
struct Branch {
    site: Site,
    condition: u8,
}

/// A way through the function: its branches, in order, and its end.
#[derive(Debug, Clone)]
struct Way {
    branches: Vec<Branch>,
    end: End,
}

/// A way being followed.
#[derive(Clone)]
struct Walk {
    next: usize,
    steps: usize,
    branches: Vec<Branch>,
    /// The registers that hold the size, one bit each (rdi's at the entry).
    size_in: u16,
    /// For each register, the registers that hold the value it had at the last branch.
    values: [u16; 16],
}

impl Walk {
    /// Where the walk is, if the size is still in a register: rdi where it is one of them.
    fn site(&self, offset: u64) -> Option<Site> {
        let register = placement::register_to_read(self.size_in, RDI)?;
        Some(Site { offset, size_register: register })
    }
}

/// Every way through the function from its entry; `None` where one does what a fast path may not.
fn ways(function: &[Instruction], code: &[u8]) -> Option<Vec<Way>> {
    let index_of = |offset: u64| function.binary_search_by_key(&offset, Instruction::ip).ok();
    let mut info = InstructionInfoFactory::new();
    let mut walks = vec![Walk { next: 0, steps: 0, branches: Vec::new(), size_in: 1 << RDI, values: identity() }];
    let mut ways = Vec::new();
    while let Some(mut walk) = walks.pop() {
        loop {
            // A way longer than the function runs in a loop.
            walk.steps += 1;
            let instruction = function.get(walk.next).filter(|_| walk.steps <= function.len())?;
            // `ret` is the one instruction that may move rsp: the way ends there.
            let returns = instruction.code() == Code::Retnq;
            if !returns && (instruction.is_stack_instruction() || touches_frame(&mut info, instruction)) {
                return None;
            }
            match instruction.flow_control() {
                FlowControl::Next if !matches!(instruction.mnemonic(), Mnemonic::Syscall | Mnemonic::Sysenter) => {
                    follow(&mut info, instruction, &mut walk);
                    walk.next += 1;
                }
                FlowControl::Return if returns => {
                    ways.push(Way { branches: walk.branches, end: End::Return(returned(&walk.values)) });
                    break;
                }
                FlowControl::UnconditionalBranch if placement::emulated(instruction, code) => {
                    let target = instruction.near_branch_target();
                    match index_of(target) {
                        Some(target) => walk.next = target,
                        // Out of the function: a jump into the middle of one of its instructions
                        // is no tail call.
                        None if target >= code.len() as u64 => {
                            let site = walk.site(instruction.ip())?;
                            ways.push(Way { branches: walk.branches, end: End::SlowPath(site) });
                            break;
                        }
                        None => return None,
                    }
                }
                FlowControl::ConditionalBranch
                    if placement::emulated(instruction, code) && instruction.is_jcc_short_or_near() =>
                {
                    let target = index_of(instruction.near_branch_target())?;
                    let site = walk.site(instruction.ip())?;
                    let condition = instruction.condition_code() as u8 - 1;
                    let mut taken = walk.clone();
                    taken.branches.push(Branch { site, condition });
                    (taken.next, taken.values) = (target, identity());
                    walks.push(taken);
                    walk.branches.push(Branch { site, condition: condition ^ 1 });
                    (walk.next, walk.values) = (walk.next + 1, identity());
                }
                _ => return None,
            }
        }
        if ways.len() + walks.len() > MAX_WAYS {
            return None;
        }
    }
    Some(ways)
}

/// Each register holding its own value.
fn identity() -> [u16; 16] {
    core::array::from_fn(|n| 1 << n)
}

/// The register whose value at the last branch rax holds, if one's does.
fn returned(values: &[u16; 16]) -> Option<RegisterNumber> {
    (0..16).find(|&n| values[usize::from(n)] & 1 << RAX != 0)
}

/// Whether `register` is rsp or rbp, which the walk and its stack walk start from.
fn frame_register(register: RegisterNumber) -> bool {
    matches!(register, 4 | 5)
}

/// Whether the instruction writes rsp or rbp.
fn touches_frame(info: &mut InstructionInfoFactory, instruction: &Instruction) -> bool {
    info.info(instruction).used_registers().iter().any(|used| {
        matches!(used.register().full_register(), Register::RSP | Register::RBP) && placement::writes(used.access())
    })
}

/// What a straight-on instruction does to the values and the size the walk follows (see
/// `placement::follow_copies`).
fn follow(info: &mut InstructionInfoFactory, instruction: &Instruction, walk: &mut Walk) {
    placement::follow_copies(info, instruction, &mut walk.values);
    placement::follow_copies(info, instruction, core::slice::from_mut(&mut walk.size_in));
}

#[cfg(test)]
mod tests {
    use profiler_common::completion::RSI;

    use super::*;

    /// jemalloc 5.3's `malloc`, as Debian's libjemalloc2 has it (0x23910 to 0x239e6), the
    /// RIP-relative displacements and the tail call's as they are.
    const JEMALLOC_MALLOC: [u8; 0xd6] = [
        0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00, 0x0f, 0x87, 0x93, 0x00, 0x00, 0x00, 0x48, 0x8d, 0x15, 0x5c, 0x7f,
        0x2c, 0x00, 0x48, 0x8d, 0x47, 0x07, 0x48, 0x8b, 0x0d, 0x49, 0x96, 0x0a, 0x00, 0x48, 0xc1, 0xe8, 0x03, 0x4c,
        0x8d, 0x05, 0x86, 0x81, 0x2c, 0x00, 0x0f, 0xb6, 0x34, 0x02, 0x64, 0x48, 0x8b, 0x91, 0x38, 0x03, 0x00, 0x00,
        0x49, 0x03, 0x14, 0xf0, 0x64, 0x48, 0x3b, 0x91, 0x40, 0x03, 0x00, 0x00, 0x73, 0x5c, 0x64, 0x4c, 0x8b, 0x0c,
        0x25, 0x00, 0x00, 0x00, 0x00, 0x4c, 0x8d, 0x14, 0x76, 0x4b, 0x8d, 0x04, 0xd1, 0x48, 0x01, 0xc8, 0x4c, 0x8b,
        0x80, 0x60, 0x03, 0x00, 0x00, 0x4d, 0x8b, 0x18, 0x4d, 0x8d, 0x50, 0x08, 0x66, 0x44, 0x3b, 0x80, 0x70, 0x03,
        0x00, 0x00, 0x74, 0x38, 0x4c, 0x89, 0x90, 0x60, 0x03, 0x00, 0x00, 0x64, 0x48, 0x89, 0x91, 0x38, 0x03, 0x00,
        0x00, 0x48, 0x8b, 0xb8, 0x68, 0x03, 0x00, 0x00, 0x48, 0x83, 0xc7, 0x01, 0x48, 0x8d, 0x34, 0x76, 0x4c, 0x89,
        0xd8, 0x49, 0x8d, 0x14, 0xf1, 0x48, 0x89, 0xbc, 0x0a, 0x68, 0x03, 0x00, 0x00, 0xc3, 0x66, 0x90, 0xe9, 0xcb,
        0xe4, 0xff, 0xff, 0x0f, 0x1f, 0x00, 0x66, 0x44, 0x3b, 0x80, 0x74, 0x03, 0x00, 0x00, 0x74, 0xee, 0x4c, 0x89,
        0x90, 0x60, 0x03, 0x00, 0x00, 0x66, 0x44, 0x89, 0x90, 0x70, 0x03, 0x00, 0x00, 0x64, 0x48, 0x89, 0x91, 0x38,
        0x03, 0x00, 0x00, 0x48, 0x8b, 0xb8, 0x68, 0x03, 0x00, 0x00, 0x48, 0x83, 0xc7, 0x01, 0xeb, 0xb4,
    ];

    /// `JEMALLOC_MALLOC` with `bytes` at `offset`.
    fn patched(offset: usize, bytes: &[u8]) -> Vec<u8> {
        let mut code = JEMALLOC_MALLOC.to_vec();
        code[offset..offset + bytes.len()].copy_from_slice(bytes);
        code
    }

    /// mimalloc 2.0's `malloc`, as Debian's libmimalloc2.0 has it (0x10b70 to 0x10bc7).
    const MIMALLOC_MALLOC: [u8; 87] = [
        0x48, 0x8b, 0x05, 0x49, 0xb4, 0x00, 0x00, 0x48, 0x89, 0xfe, 0x64, 0x48, 0x8b, 0x38, 0x48, 0x81, 0xfe, 0x00,
        0x04, 0x00, 0x00, 0x77, 0x29, 0x48, 0x8d, 0x46, 0x07, 0x48, 0xc1, 0xe8, 0x03, 0x48, 0x8b, 0x44, 0xc7, 0x08,
        0x48, 0x8b, 0x50, 0x10, 0x48, 0x85, 0xd2, 0x74, 0x23, 0x48, 0x8b, 0x0a, 0x83, 0x40, 0x18, 0x01, 0x48, 0x89,
        0x48, 0x10, 0x48, 0x89, 0xd0, 0xc3, 0x0f, 0x1f, 0x40, 0x00, 0x31, 0xc9, 0x31, 0xd2, 0xe9, 0x97, 0xf9, 0xff,
        0xff, 0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00, 0x31, 0xc9, 0xe9, 0x89, 0xf9, 0xff, 0xff,
    ];

    fn site(offset: u64, size_register: RegisterNumber) -> Site {
        Site { offset, size_register }
    }

    #[test]
    fn jemalloc_malloc_completes_at_its_two_last_branches_and_leaves_by_one_jump() {
        // je +0x38 (not taken: the block in r11 is returned); the slow path's jmp; the second
        // chance's je back to it.
        let ne_r11 = Completion { condition: 5, result: 11 };
        let expected = FastPath {
            slow_paths: vec![site(0xa0, RDI)],
            completions: vec![(site(0x6e, RDI), ne_r11), (site(0xb0, RDI), ne_r11)],
        };
        let mut found = of(&JEMALLOC_MALLOC).expect("a fast path");
        found.completions.sort_by_key(|(site, _)| site.offset);
        assert_eq!(found, expected);
        // mov %r11,%rax in its other encoding.
        assert!(of(&patched(0x8e, &[0x49, 0x8b, 0xc3])).is_some());
    }

    #[test]
    fn mimalloc_malloc_completes_with_its_size_moved_to_rsi() {
        // mov %rdi,%rsi, then rdi is the heap; je +0x23 (not taken: the block in rdx is
        // returned); two tail calls to the generic allocation, the size in rsi.
        let ne_rdx = Completion { condition: 5, result: 2 };
        let expected = FastPath {
            slow_paths: vec![site(0x44, RSI), site(0x52, RSI)],
            completions: vec![(site(0x2b, RSI), ne_rdx)],
        };
        let mut found = of(&MIMALLOC_MALLOC).expect("a fast path");
        found.slow_paths.sort_by_key(|site| site.offset);
        assert_eq!(found, expected);
        // mov %esi,%esi before the first branch: the size's upper half is lost.
        let mut truncated = MIMALLOC_MALLOC.to_vec();
        truncated.splice(0xe..0xe, [0x89, 0xf6]);
        assert_eq!(of(&truncated), None);
    }

    #[test]
    fn a_fast_path_that_does_what_the_probe_cannot_follow_is_none() {
        // add %r11,%rax: the block is no register's value at the branch.
        assert_eq!(of(&patched(0x8e, &[0x4c, 0x01, 0xd8])), None);
        // lea 0x7(%rdi),%rdi: the size is lost before the branches.
        assert_eq!(of(&patched(0x14, &[0x48, 0x8d, 0x7f, 0x07])), None);
        // call instead of the slow path's jmp.
        assert_eq!(of(&patched(0xa0, &[0xe8])), None);
        // push %rbx where the fast path stores its bin's new head.
        assert_eq!(of(&patched(0x70, &[0x53, 0x90, 0x90, 0x90, 0x90, 0x90, 0x90])), None);
        assert_eq!(of(&[]), None);
    }
}
