//! The `otel_memory` USDT contract: an allocator fires `otel_memory:alloc(ptr, size, weight)` for
//! the allocations its own sampler picks (`weight`: the bytes the sample stands for) and
//! `otel_memory:free(ptr)` when such a block is freed. Where each argument is at the probe is
//! written in the probe's `.note.stapsdt` note (`8@%rdi`, `-4@-20(%rbp)`, `8@$5`); user space
//! parses it into an `ArgSpec` (`parse`), and the programs read it from the registers and memory
//! (`extend` then keeps the argument's own bytes).

/// The most arguments a probe of the contract takes (`alloc`'s).
pub const ARGS: usize = 3;

/// Specs the programs can tell apart: a probe's cookie is its index in the specs map.
pub const MAX_SPECS: u32 = 256;

/// Where one argument is.
pub mod kind {
    /// A constant, `$5`: `ArgSpec::value`.
    pub const CONSTANT: u32 = 0;
    /// A register, `%rdi`.
    pub const REGISTER: u32 = 1;
    /// Memory at a register plus a displacement, `-20(%rbp)`.
    pub const MEMORY: u32 = 2;
}

/// One argument's location, as the programs read it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArgSpec {
    /// A `kind` constant.
    pub kind: u32,
    /// The register's byte offset in the kernel's `struct pt_regs`.
    pub register_offset: u32,
    /// The constant, or the displacement from the register.
    pub value: i64,
    /// `64 - 8 * size`: shifting the word read left then right by it keeps the argument's bytes.
    pub shift: u32,
    /// 1 for a signed argument (a negative size in the note): sign-extended.
    pub signed: u32,
}

/// Whose sampler a probe site reports.
pub mod sampler {
    /// The `otel_memory` contract: its arguments as the contract says.
    pub const OTEL: u32 = 0;
    /// Go's runtime, probed at `runtime.mProf_Malloc` and `runtime.freeSpecial` (see the daemon's
    /// `process::go_runtime`). At an allocation the third argument is `runtime.MemProfileRate`,
    /// the mean bytes between its samples, and the weight is `exponential_weight`'s. At a free
    /// the second argument is the kind of the special record being freed and the third the kind
    /// of a heap profile's: only a free where they are equal ends a sampled block (the others are
    /// finalizers and such, of blocks that may live on).
    pub const GO: u32 = 1;
}

/// The arguments of one probe site.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeSpec {
    pub args: [ArgSpec; ARGS],
    /// A `sampler` constant.
    pub sampler: u32,
    pub _pad: u32,
}

/// The size of x86-64's `struct pt_regs`: a register offset is below it.
pub const PT_REGS_SIZE: u32 = 168;

/// The argument from the word read at its location.
#[inline(always)]
pub fn extend(word: u64, arg: &ArgSpec) -> u64 {
    let shift = arg.shift & 63;
    if arg.signed != 0 {
        (((word << shift) as i64) >> shift) as u64
    } else {
        (word << shift) >> shift
    }
}

/// Why an argument's spec cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecError {
    /// Not `SIZE@OPERAND` with a size of 1, 2, 4 or 8.
    Size,
    /// A register memprof does not know (or a high byte register, `%ah`).
    Register,
    /// An operand form memprof does not read: an index register, or a symbol (`var(%rip)`).
    Operand,
}

/// Parses one x86-64 argument spec: `[-]SIZE@OPERAND`, the operand `%reg`, `$imm`, `disp(%reg)`
/// or `(%reg)`. A spec without a size (old notes) is an 8-byte one.
pub fn parse(spec: &str) -> Result<ArgSpec, SpecError> {
    let (size, operand) = match spec.split_once('@') {
        Some((size, operand)) => (size.parse::<i32>().map_err(|_| SpecError::Size)?, operand),
        None => (8, spec),
    };
    let bytes = size.unsigned_abs();
    if !matches!(bytes, 1 | 2 | 4 | 8) {
        return Err(SpecError::Size);
    }
    let mut arg = ArgSpec { shift: 64 - 8 * bytes, signed: u32::from(size < 0), ..ArgSpec::default() };
    if let Some(constant) = operand.strip_prefix('$') {
        arg.kind = kind::CONSTANT;
        arg.value = number(constant).ok_or(SpecError::Operand)?;
    } else if let Some(register) = operand.strip_prefix('%') {
        arg.kind = kind::REGISTER;
        arg.register_offset = register_offset(register).ok_or(SpecError::Register)?;
    } else if let Some((displacement, rest)) = operand.split_once('(') {
        let register = rest.strip_suffix(')').and_then(|r| r.strip_prefix('%')).ok_or(SpecError::Operand)?;
        if register.contains(',') || register == "rip" {
            return Err(SpecError::Operand);
        }
        arg.kind = kind::MEMORY;
        arg.register_offset = register_offset(register).ok_or(SpecError::Register)?;
        arg.value = if displacement.is_empty() { 0 } else { number(displacement).ok_or(SpecError::Operand)? };
    } else {
        return Err(SpecError::Operand);
    }
    Ok(arg)
}

/// A decimal or `0x` number, maybe negative.
fn number(text: &str) -> Option<i64> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(digits) => (true, digits),
        None => (false, text),
    };
    let value = match digits.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).ok()?,
        None => digits.parse::<i64>().ok()?,
    };
    Some(if negative { -value } else { value })
}

/// The byte offset in x86-64's `struct pt_regs` of the 64-bit register `name` names, or is part of.
fn register_offset(name: &str) -> Option<u32> {
    // (offset, the names of the register and of its low 32, 16 and 8 bits)
    const REGISTERS: [(u32, [&str; 4]); 17] = [
        (0, ["r15", "r15d", "r15w", "r15b"]),
        (8, ["r14", "r14d", "r14w", "r14b"]),
        (16, ["r13", "r13d", "r13w", "r13b"]),
        (24, ["r12", "r12d", "r12w", "r12b"]),
        (32, ["rbp", "ebp", "bp", "bpl"]),
        (40, ["rbx", "ebx", "bx", "bl"]),
        (48, ["r11", "r11d", "r11w", "r11b"]),
        (56, ["r10", "r10d", "r10w", "r10b"]),
        (64, ["r9", "r9d", "r9w", "r9b"]),
        (72, ["r8", "r8d", "r8w", "r8b"]),
        (80, ["rax", "eax", "ax", "al"]),
        (88, ["rcx", "ecx", "cx", "cl"]),
        (96, ["rdx", "edx", "dx", "dl"]),
        (104, ["rsi", "esi", "si", "sil"]),
        (112, ["rdi", "edi", "di", "dil"]),
        (128, ["rip", "eip", "ip", "ip"]),
        (152, ["rsp", "esp", "sp", "spl"]),
    ];
    REGISTERS.iter().find(|(_, names)| names.contains(&name)).map(|(offset, _)| *offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_memory_and_constants_are_parsed() {
        let rdi = parse("8@%rdi").unwrap();
        assert_eq!((rdi.kind, rdi.register_offset, rdi.shift, rdi.signed), (kind::REGISTER, 112, 0, 0));
        let local = parse("-4@-20(%rbp)").unwrap();
        assert_eq!((local.kind, local.register_offset, local.value), (kind::MEMORY, 32, -20));
        assert_eq!((local.shift, local.signed), (32, 1));
        assert_eq!(parse("8@$5").unwrap(), ArgSpec { kind: kind::CONSTANT, value: 5, ..ArgSpec::default() });
        assert_eq!(parse("8@$0x80000").unwrap().value, 0x80000);
        assert_eq!(parse("4@%r8d").unwrap().register_offset, 72);
        assert_eq!(parse("8@(%rsp)").unwrap().value, 0);
        assert_eq!(parse("%rsi").unwrap().register_offset, 104, "no size: 8 bytes");
    }

    #[test]
    fn forms_not_read_are_refused() {
        assert_eq!(parse("3@%rdi"), Err(SpecError::Size));
        assert_eq!(parse("8@%ah"), Err(SpecError::Register));
        assert_eq!(parse("8@counter(%rip)"), Err(SpecError::Operand));
        assert_eq!(parse("8@8(%rax,%rbx,8)"), Err(SpecError::Operand));
    }

    #[test]
    fn arguments_keep_their_own_bytes() {
        let signed = parse("-4@%eax").unwrap();
        assert_eq!(extend(0xdead_beef_ffff_fffe, &signed), (-2i64) as u64);
        let unsigned = parse("4@%eax").unwrap();
        assert_eq!(extend(0xdead_beef_ffff_fffe, &unsigned), 0xffff_fffe);
        assert_eq!(extend(u64::MAX, &parse("8@%rax").unwrap()), u64::MAX);
    }
}
