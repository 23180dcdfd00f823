//! Where on an allocator function its probe goes: at the first instruction the kernel emulates
//! that every call reaches with the arguments memprof reads still in their registers.
//!
//! A uprobe on an instruction the kernel cannot emulate is single-stepped out of line, many times
//! dearer than an emulated one (docs: performance.md#measurements-behind-design-choices).
//! x86-64's kernel emulates `push %reg`, direct `jmp`/`jcc`/`call` and `nop`; allocators often
//! open with a `cmp`, `test` or `mov`, which it single-steps. Instructions that only compute into other registers can be
//! stepped over: the probe then fires a few instructions later, on every call all the same.
//!
//! What the probe reads decides what may be stepped over: the arguments of the function
//! (`AllocFn::arguments`), rsp (the return address a return probe replaces, the
//! stack walk's start, nesting), rbp (the stack walk), and the stack memory at rsp. An argument
//! may move: a function that passes its arguments on to the call it ends in (mimalloc's) copies
//! them to other registers, then writes theirs. A copy made by a 64-bit `mov` between registers
//! is followed, and the probe's cookie says where each argument is
//! (`profiler_common::MovedArguments`). The entry and return probes of an allocation function
//! share this site, so no push may come before it: the return probe takes over the return
//! address at `[rsp]` when the probe fires. Whatever is not understood keeps the probe on the
//! symbol.
//!
//! A free that opens with `test %rdi,%rdi; je` is probed at the `je`, not past it: the kernel
//! emulates a jump in registers, where it emulates a `push` by writing the stack, which costs
//! more per free than the trap of the few `free(NULL)` calls
//! (docs: performance.md#measurements-behind-design-choices).

use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind,
    Register,
};
use profiler_common::{completion::RegisterNumber, MovedArguments, MOVABLE_ARGUMENTS};

use crate::process::families::Role;

/// Functions longer than this are not decoded (their probe stays on the symbol): allocator
/// entry points keep their slow paths in other functions, and a whole function is decoded to
/// check its jumps.
pub(super) const MAX_FUNCTION_BYTES: usize = 64 * 1024;

/// Where a function's probe goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placement {
    /// How far past the function's first byte (0: on its symbol).
    pub distance: u64,
    /// Where the arguments its program reads are there, those not in their own registers.
    pub moved: MovedArguments,
}

/// Where the probe of the function whose bytes are `code` goes. `code` holds the whole function,
/// as its symbol's size bounds it: every direct jump in it is checked (a jump back to the site
/// would make one call fire the probe twice). `may_move`: whether the probe's cookie has room to
/// say where moved arguments are (a C library's free's has not).
pub fn probe_site(code: &[u8], role: Role, may_move: bool) -> Placement {
    if code.is_empty() || code.len() > MAX_FUNCTION_BYTES {
        return Placement::default();
    }
    let Some(function) = decode(code) else { return Placement::default() };
    let Some((site, moved)) = first_emulated(&function, code, &read_arguments(role), may_move) else {
        return Placement::default();
    };
    let distance = function[site].ip();
    if reentered(&function, distance) {
        Placement::default()
    } else {
        Placement { distance, moved }
    }
}

/// The offsets in the function whose bytes are `code` of the instruction after each of its
/// `syscall` instructions, where a probe reads the call's arguments (the kernel keeps them in
/// their registers) and its result (in rax): none when it makes no system call. `None` unless
/// each of them is system call `number`: the last write to eax before it is `mov $number` and
/// no direct jump lands between the two or on the site. Used for the mapping calls of a C
/// library's wrappers (`process::mapping_calls`).
pub fn syscall_returns(code: &[u8], number: u32) -> Option<Vec<u64>> {
    if code.len() > MAX_FUNCTION_BYTES {
        return None;
    }
    let function = decode(code)?;
    let targets: Vec<u64> = branch_targets(&function).collect();
    let mut info = InstructionInfoFactory::new();
    let mut number_set_at = None;
    let mut sites = Vec::new();
    for instruction in &function {
        if instruction.mnemonic() == Mnemonic::Syscall {
            let set_at = number_set_at?;
            let site = instruction.next_ip();
            if targets.iter().any(|&target| target > set_at && target <= site) {
                return None;
            }
            sites.push(site);
            number_set_at = None;
            continue;
        }
        let writes_eax = info
            .info(instruction)
            .used_registers()
            .iter()
            .any(|used| used.register().full_register() == Register::RAX && writes(used.access()));
        if writes_eax {
            // `mov $n,%eax` (C libraries) or `mov $n,%rax` (some of Go's runtime).
            let sets_number = matches!(
                instruction.code(),
                Code::Mov_r32_imm32 | Code::Mov_rm32_imm32 | Code::Mov_rm64_imm32 | Code::Mov_r64_imm64
            ) && instruction.op0_register().full_register() == Register::RAX
                && instruction.immediate(1) == u64::from(number);
            number_set_at = sets_number.then(|| instruction.ip());
        }
    }
    Some(sites)
}

/// The arguments memprof's entry programs read for a function of `role` (every free takes its
/// block first), by their number.
fn read_arguments(role: Role) -> Vec<usize> {
    match role {
        Role::Free => vec![0],
        Role::Alloc(func) => func.arguments().read().collect(),
    }
}

/// The registers that pass arguments 0 to 3, by their numbers in instruction encodings: rdi,
/// rsi, rdx, rcx.
const ARGUMENT_REGISTERS: [RegisterNumber; MOVABLE_ARGUMENTS] = [7, 6, 2, 1];

/// A 64-bit general register's number in instruction encodings (rax 0, ..., r15 15).
fn number(register: Register) -> Option<RegisterNumber> {
    let number = register.number();
    (register.is_gpr64() && number < 16).then_some(number as RegisterNumber)
}

/// The register a probe reads a value from, of those that hold it (`held`, as `follow_copies`
/// keeps them): `own` where it still holds it, else the lowest; `None` where none does.
pub(super) fn register_to_read(held: u16, own: RegisterNumber) -> Option<RegisterNumber> {
    match held {
        0 => None,
        _ if held & bit(own) != 0 => Some(own),
        _ => Some(held.trailing_zeros() as RegisterNumber),
    }
}

/// Registers as bits, by their numbers.
fn bit(register: RegisterNumber) -> u16 {
    1 << register
}

/// The function's instructions in order, their `ip` the distance from its first byte; `None`
/// if some bytes are no instruction (data, or a symbol size that is wrong).
pub(super) fn decode(code: &[u8]) -> Option<Vec<Instruction>> {
    let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut function = Vec::new();
    while decoder.can_decode() {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            return None;
        }
        function.push(instruction);
    }
    Some(function)
}

/// The index of the first instruction that the kernel emulates, if every one before it runs
/// straight on, leaves rsp, rbp and memory alone and keeps each of `arguments` in some register
/// (in its own unless `may_move`); with the registers that hold those that moved.
fn first_emulated(
    function: &[Instruction],
    code: &[u8],
    arguments: &[usize],
    may_move: bool,
) -> Option<(usize, MovedArguments)> {
    let mut info = InstructionInfoFactory::new();
    // For each argument, the registers that hold it.
    let mut held: [u16; MOVABLE_ARGUMENTS] = core::array::from_fn(|n| bit(ARGUMENT_REGISTERS[n]));
    let read = |n: &usize| ARGUMENT_REGISTERS.get(*n).is_some();
    if !arguments.iter().all(read) {
        return None;
    }
    for (index, instruction) in function.iter().enumerate() {
        if emulated(instruction, code) {
            let moved = core::array::from_fn(|n| {
                let own = ARGUMENT_REGISTERS[n];
                let read = register_to_read(held[n], own).filter(|_| arguments.contains(&n));
                read.filter(|&register| register != own)
            });
            return Some((index, moved));
        }
        if !harmless(&mut info, instruction) {
            return None;
        }
        follow_copies(&mut info, instruction, &mut held);
        let kept = |n: &usize| {
            let own = ARGUMENT_REGISTERS[*n];
            register_to_read(held[*n], own).is_some_and(|register| may_move || register == own)
        };
        if !arguments.iter().all(kept) {
            return None;
        }
    }
    None
}

/// What an instruction does to the registers that hold each argument (`held`): a 64-bit `mov`
/// between registers makes its target hold what its source held; any other write, nothing.
pub(super) fn follow_copies(info: &mut InstructionInfoFactory, instruction: &Instruction, held: &mut [u16]) {
    let source = match instruction.code() {
        Code::Mov_rm64_r64 | Code::Mov_r64_rm64 if instruction.op1_kind() == OpKind::Register => {
            number(instruction.op1_register())
        }
        _ => None,
    };
    for used in info.info(instruction).used_registers() {
        let Some(register) = number(used.register().full_register()) else { continue };
        if writes(used.access()) {
            for holders in held.iter_mut() {
                let copied = source.is_some_and(|source| *holders & bit(source) != 0);
                *holders = if copied { *holders | bit(register) } else { *holders & !bit(register) };
            }
        }
    }
}

/// Whether the kernel emulates the instruction instead of single-stepping it: `push %reg`
/// (`50+r`, `41 50+r`), a direct near `jmp`, `jcc` or `call`, `nop` (`90`, `0f 1f /0`); none with
/// a prefix the kernel refuses (it single-steps a branch with an operand-size prefix).
pub(super) fn emulated(instruction: &Instruction, code: &[u8]) -> bool {
    let bytes = &code[instruction.ip() as usize..][..instruction.len()];
    let prefixed = matches!(bytes[0], 0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 | 0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3);
    if prefixed {
        return false;
    }
    match instruction.code() {
        Code::Push_r64 => bytes.len() == 1 || bytes[0] == 0x41,
        Code::Nopd | Code::Nop_rm32 => bytes[0] == 0x90 || bytes[0] == 0x0f,
        _ => instruction.is_jcc_short_or_near() || instruction.is_jmp_short_or_near() || instruction.is_call_near(),
    }
}

/// Whether an instruction can be stepped over by the probe, its writes to argument registers
/// aside (`follow_copies`): it runs straight on and writes neither rsp, rbp, nor memory.
fn harmless(info: &mut InstructionInfoFactory, instruction: &Instruction) -> bool {
    if instruction.flow_control() != FlowControl::Next
        || instruction.is_stack_instruction()
        || matches!(instruction.mnemonic(), Mnemonic::Syscall | Mnemonic::Sysenter)
    {
        return false;
    }
    let info = info.info(instruction);
    if info.used_memory().iter().any(|memory| writes(memory.access())) {
        return false;
    }
    !info
        .used_registers()
        .iter()
        .any(|used| writes(used.access()) && matches!(used.register().full_register(), Register::RSP | Register::RBP))
}

/// Whether an operand's access writes it, always or on a condition.
pub(super) fn writes(access: OpAccess) -> bool {
    matches!(access, OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite)
}

/// Whether a direct jump or call of the function goes to `site` or before it: a call would then
/// pass the probe twice, or reach it by a way that skipped what the probe relies on.
fn reentered(function: &[Instruction], site: u64) -> bool {
    branch_targets(function).any(|target| target <= site)
}

/// Where the function's direct jumps and calls go.
fn branch_targets(function: &[Instruction]) -> impl Iterator<Item = u64> + '_ {
    function
        .iter()
        .filter(|instruction| instruction.op_count() > 0 && instruction.op0_kind() == OpKind::NearBranch64)
        .map(Instruction::near_branch_target)
}

#[cfg(test)]
mod tests {
    use profiler_common::AllocFn;

    use super::*;

    const FREE: Role = Role::Free;
    const MALLOC: Role = Role::Alloc(AllocFn::Malloc);

    /// Where the probe goes, arguments free to move.
    fn probe_distance(code: &[u8], role: Role) -> u64 {
        probe_site(code, role, true).distance
    }

    /// `code`, then a `ret` and padding up to a function's usual alignment.
    fn function(code: &[u8]) -> Vec<u8> {
        let mut bytes = code.to_vec();
        bytes.push(0xc3);
        bytes.resize(bytes.len().next_multiple_of(16), 0xcc);
        bytes
    }

    #[test]
    fn jemalloc_malloc_is_probed_at_its_size_check_jump() {
        // cmp $0x1000,%rdi; ja +0x93; lea 0x2c7f5c(%rip),%rdx; lea 0x7(%rdi),%rax
        let mut code = vec![0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00, 0x0f, 0x87, 0x93, 0, 0, 0];
        code.extend([0x48, 0x8d, 0x15, 0x5c, 0x7f, 0x2c, 0x00, 0x48, 0x8d, 0x47, 0x07]);
        let mut code = function(&code);
        code.resize(0xa0 + 16, 0xcc);
        assert_eq!(probe_distance(&code, MALLOC), 7);
        // The same bytes as posix_memalign's: the size is in rdx, the out-pointer in rdi, which
        // `cmp` only reads.
        assert_eq!(probe_distance(&code, Role::Alloc(AllocFn::PosixMemalign)), 7);
    }

    #[test]
    fn jemalloc_free_is_probed_past_its_straight_line_opening() {
        // mov %rdi,%rax; mov 0xa530e(%rip),%rdx; mov %rdi,%rcx; shr $0x1a,%rax;
        // and $0xffffffffc0000000,%rcx; and $0xf0,%eax; add %fs:0x0,%rax; add %rdx,%rax;
        // cmp 0x1b0(%rax),%rcx; jne +0x8a
        let code = function(&[
            0x48, 0x89, 0xf8, 0x48, 0x8b, 0x15, 0x0e, 0x53, 0x0a, 0x00, 0x48, 0x89, 0xf9, 0x48, 0xc1, 0xe8, 0x1a, 0x48,
            0x81, 0xe1, 0x00, 0x00, 0x00, 0xc0, 0x25, 0xf0, 0x00, 0x00, 0x00, 0x64, 0x48, 0x03, 0x04, 0x25, 0, 0, 0, 0,
            0x48, 0x01, 0xd0, 0x48, 0x3b, 0x88, 0xb0, 0x01, 0x00, 0x00, 0x0f, 0x85, 0x02, 0, 0, 0, 0x90, 0x90,
        ]);
        assert_eq!(probe_distance(&code, FREE), 48);
        // A malloc reading rdx or rcx could not step over the `mov`s into them.
        assert_eq!(probe_distance(&code, Role::Alloc(AllocFn::Reallocarray)), 0);
        assert_eq!(probe_distance(&code, Role::Alloc(AllocFn::RustRealloc)), 0);
    }

    #[test]
    fn glibc_free_is_probed_at_its_null_check() {
        // test %rdi,%rdi; je rel32; push %rbp; lea -0x10(%rdi),%rsi
        let code = function(&[0x48, 0x85, 0xff, 0x0f, 0x84, 0x08, 0, 0, 0, 0x55, 0x48, 0x8d, 0x77, 0xf0, 0x5d]);
        assert_eq!(probe_distance(&code, FREE), 3);
        // glibc's malloc opens with `push %r12`: the symbol is emulated already.
        assert_eq!(probe_distance(&function(&[0x41, 0x54, 0x55, 0x53, 0x5b, 0x5d, 0x41, 0x5c]), MALLOC), 0);
    }

    #[test]
    fn a_null_check_is_probed_at_its_jump() {
        // mimalloc's mi_free: mov %rdi,%rcx; test %rdi,%rdi; je +0x5d; lea -0x1(%rdi),%rdi
        let mut code = vec![0x48, 0x89, 0xf9, 0x48, 0x85, 0xff, 0x74, 0x05, 0x48, 0x8d, 0x7f, 0xff];
        code.extend([0x90, 0xc3]);
        assert_eq!(probe_distance(&function(&code), FREE), 6);
        // jemalloc's sized operator delete: test %rdi,%rdi; je +0x13; sub $0x8,%rsp; call ...
        let code = function(&[0x48, 0x85, 0xff, 0x74, 0x0a, 0x48, 0x83, 0xec, 0x08, 0xe8, 0, 0, 0, 0, 0xc3]);
        assert_eq!(probe_distance(&code, FREE), 3);
    }

    #[test]
    fn tcmalloc_and_libstdcxx_openings() {
        // tcmalloc's tc_malloc: mov 0xab59(%rip),%rax; test %rax,%rax; jne +0x75 (its hooks)
        let mut code = vec![0x48, 0x8b, 0x05, 0x59, 0xab, 0x00, 0x00, 0x48, 0x85, 0xc0, 0x75, 0x02, 0x90, 0x90];
        assert_eq!(probe_distance(&function(&code), MALLOC), 10);
        // tc_memalign: mov %rdi,%r8; cmp $0x2000,%rdi; ja; lea -0x1(%rdi,%rsi,1),%rdi
        code = vec![0x49, 0x89, 0xf8, 0x48, 0x81, 0xff, 0x00, 0x20, 0, 0, 0x77, 0x05, 0x48, 0x8d, 0x7c, 0x37, 0xff];
        assert_eq!(probe_distance(&function(&code), Role::Alloc(AllocFn::Memalign)), 10);
        // libstdc++'s operator new: endbr64; test %rdi,%rdi; mov $0x1,%eax; push %rbx
        code = vec![0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x85, 0xff, 0xb8, 0x01, 0, 0, 0, 0x53, 0x5b];
        assert_eq!(probe_distance(&function(&code), MALLOC), 12);
        // libstdc++'s operator delete: endbr64; jmp free@plt
        code = vec![0xf3, 0x0f, 0x1e, 0xfa, 0xe9, 0x87, 0x2f, 0xff, 0xff];
        assert_eq!(probe_distance(&function(&code), FREE), 4);
    }

    #[test]
    fn arguments_copied_to_other_registers_are_found_there() {
        let moved = |moved: &[(usize, RegisterNumber)]| {
            let mut arguments = [None; MOVABLE_ARGUMENTS];
            for &(argument, register) in moved {
                arguments[argument] = Some(register);
            }
            arguments
        };
        // mimalloc's mi_malloc: mov ...(%rip),%rax; mov %rdi,%rsi; mov %fs:(%rax),%rdi; ja
        let code =
            function(&[0x48, 0x8b, 0x05, 0x49, 0xb4, 0, 0, 0x48, 0x89, 0xfe, 0x64, 0x48, 0x8b, 0x38, 0x77, 0x01]);
        assert_eq!(probe_site(&code, MALLOC, true), Placement { distance: 14, moved: moved(&[(0, 6)]) });
        assert_eq!(probe_site(&code, MALLOC, false), Placement::default(), "rdi is overwritten before the jump");
        // mimalloc's realloc: mov ...(%rip),%rax; mov %rsi,%rdx; mov %rdi,%rsi; mov %fs:(%rax),%rax;
        // mov %rax,%rdi; jmp mi_heap_realloc
        let code = function(&[
            0x48, 0x8b, 0x05, 0x49, 0xa9, 0, 0, 0x48, 0x89, 0xf2, 0x48, 0x89, 0xfe, 0x64, 0x48, 0x8b, 0x00, 0x48, 0x89,
            0xc7, 0xe9, 0xf7, 0x4e, 0xff, 0xff,
        ]);
        let realloc = Role::Alloc(AllocFn::Realloc);
        assert_eq!(probe_site(&code, realloc, true), Placement { distance: 20, moved: moved(&[(0, 6), (1, 2)]) });
        // mimalloc's calloc: mov ...(%rip),%rdx; mov %rdi,%rax; mov %fs:(%rdx),%rdi; cmp $0x1,%rax; je
        let code = function(&[
            0x48, 0x8b, 0x15, 0xc9, 0xad, 0, 0, 0x48, 0x89, 0xf8, 0x64, 0x48, 0x8b, 0x3a, 0x48, 0x83, 0xf8, 0x01, 0x74,
            0x08,
        ]);
        let calloc = Role::Alloc(AllocFn::Calloc);
        assert_eq!(probe_site(&code, calloc, true), Placement { distance: 18, moved: moved(&[(0, 0)]) });
        // mov %edi,%esi; mov %fs:(%rax),%rdi; ja: a 32-bit copy is no copy of the size
        let code = function(&[0x89, 0xfe, 0x64, 0x48, 0x8b, 0x38, 0x77, 0x01]);
        assert_eq!(probe_site(&code, MALLOC, true), Placement::default());
    }

    #[test]
    fn what_the_probe_reads_stops_the_walk() {
        // mov %rax,0x8(%rsp); jmp: a store on the stack
        assert_eq!(probe_distance(&function(&[0x48, 0x89, 0x44, 0x24, 0x08, 0xeb, 0x00]), FREE), 0);
        // sub $0x8,%rsp; jmp: the return address moved
        assert_eq!(probe_distance(&function(&[0x48, 0x83, 0xec, 0x08, 0xeb, 0x00]), FREE), 0);
        // mov %rsp,%rbp; push %rbx: the frame pointer the stack walk starts from
        assert_eq!(probe_distance(&function(&[0x48, 0x89, 0xe5, 0x53, 0x5b]), FREE), 0);
        // cmp; ret: nothing emulated before the function leaves
        assert_eq!(probe_distance(&function(&[0x48, 0x83, 0xff, 0x01]), FREE), 0);
    }

    #[test]
    fn a_jump_back_to_the_site_keeps_the_symbol() {
        // cmp $0x1,%rdi; ja +2; xor %eax,%eax; jmp back to the ja
        let code = function(&[0x48, 0x83, 0xff, 0x01, 0x77, 0x02, 0x31, 0xc0, 0xeb, 0xfa]);
        assert_eq!(probe_distance(&code, MALLOC), 0);
        // ... or into the instructions stepped over
        let code = function(&[0x48, 0x83, 0xff, 0x01, 0x77, 0x02, 0x31, 0xc0, 0xeb, 0xf6]);
        assert_eq!(probe_distance(&code, MALLOC), 0);
        // A jump past the site is fine.
        let code = function(&[0x48, 0x83, 0xff, 0x01, 0x77, 0x02, 0x31, 0xc0, 0xeb, 0xfc]);
        assert_eq!(probe_distance(&code, MALLOC), 4);
    }

    #[test]
    fn a_system_call_wrapper_is_probed_after_its_syscall() {
        // glibc's mmap: mov %ecx,%r10d; test $0xfff,%r9d; jne (to the ret); mov $0x9,%eax; syscall;
        // cmp $-0x1000,%rax; ja +0x25
        let code = function(&[
            0x41, 0x89, 0xca, 0x41, 0xf7, 0xc1, 0xff, 0x0f, 0, 0, 0x75, 0x0f, 0xb8, 0x09, 0, 0, 0, 0x0f, 0x05, 0x48,
            0x3d, 0x00, 0xf0, 0xff, 0xff, 0x77, 0x00,
        ]);
        assert_eq!(syscall_returns(&code, 9), Some(vec![19]));
        assert_eq!(syscall_returns(&code, 11), None, "another call's number");
        // musl's brk: no system call at all
        assert_eq!(syscall_returns(&function(&[0x48, 0xc7, 0xc0, 0xf4, 0xff, 0xff, 0xff]), 12), Some(vec![]));
        // Go's runtime.sysMunmap: mov 0x8(%rsp),%rdi; mov 0x10(%rsp),%rsi; mov $0xb,%rax; syscall;
        // cmp $-0xfff,%rax
        let code = function(&[
            0x48, 0x8b, 0x7c, 0x24, 0x08, 0x48, 0x8b, 0x74, 0x24, 0x10, 0x48, 0xc7, 0xc0, 0x0b, 0, 0, 0, 0x0f, 0x05,
            0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff,
        ]);
        assert_eq!(syscall_returns(&code, 11), Some(vec![19]));
    }

    #[test]
    fn a_syscall_whose_number_is_not_known_is_not_probed() {
        // mov %edx,%eax; syscall: the number is an argument
        assert_eq!(syscall_returns(&function(&[0x89, 0xd0, 0x0f, 0x05]), 9), None);
        // mov $0x9,%eax; mov %esi,%eax; syscall: overwritten
        assert_eq!(syscall_returns(&function(&[0xb8, 0x09, 0, 0, 0, 0x89, 0xf0, 0x0f, 0x05]), 9), None);
        // mov $0x9,%eax; nop; syscall; jmp back to the nop: a way in that skips the number
        let code = function(&[0xb8, 0x09, 0, 0, 0, 0x90, 0x0f, 0x05, 0xeb, 0xfb]);
        assert_eq!(syscall_returns(&code, 9), None);
        // ... where a jump back before the number is fine (musl's mremap)
        let code = function(&[0x90, 0xb8, 0x09, 0, 0, 0, 0x0f, 0x05, 0xeb, 0xf6]);
        assert_eq!(syscall_returns(&code, 9), Some(vec![8]));
    }

    #[test]
    fn prefixed_branches_and_unknown_bytes_keep_the_symbol() {
        // cmp; jne with an operand-size prefix: the kernel single-steps it
        assert_eq!(probe_distance(&function(&[0x48, 0x83, 0xff, 0x01, 0x66, 0x75, 0x00]), MALLOC), 0);
        // Bytes that are no instruction
        assert_eq!(probe_distance(&[0x48, 0x83, 0xff, 0x01, 0x75, 0x00, 0x06], MALLOC), 0);
        assert_eq!(probe_distance(&[], MALLOC), 0, "no size: no decoding");
    }
}
