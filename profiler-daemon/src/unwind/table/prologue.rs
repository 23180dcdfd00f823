//! Unwind rows for functions no FDE covers, from their prologues, as debuggers do for code built
//! without unwind tables (musl, hand-written assembly).
//!
//! The decoder follows the prologue from the function's first byte: pushes, `sub $k,%rsp` and
//! `mov %rsp,%rbp` change the rule, and the other common instructions are stepped over by their
//! length. It stops at the first call: compilers finish the prologue before it, and the rule it
//! reached holds in the body, where return addresses are, up to the function's end (epilogues
//! hold none). Whatever it cannot follow gets a `cfa::UNSUPPORTED` row, which the walker counts.

use profiler_common::{cfa, rbp, UnwindRow};

/// How far a function is followed before giving up: prologues are a few instructions, and a
/// shrink-wrapped function's early exits a few more.
const MAX_INSTRUCTIONS: usize = 64;

const RSP: u8 = 4;
const RBP: u8 = 5;

/// One instruction, as far as the stack's layout is concerned.
#[derive(Debug, PartialEq, Eq)]
enum Insn {
    /// `push %reg`.
    Push(u8),
    /// `mov %rsp,%rbp`.
    FramePointer,
    /// `sub $k,%rsp`.
    SubRsp(i32),
    /// A direct or indirect call.
    Call,
    /// A conditional jump: the prologue may go on in the fall-through.
    Branch,
    /// `ret` or `jmp`: the code after it is reached only by jumps.
    Leave,
    /// A `pop`: the epilogue begins.
    Pop,
    /// Writes rbp (not as `mov %rsp,%rbp`).
    WritesRbp,
    /// Changes rsp in another way than the above (`and $-16,%rsp`, `add`, `lea`, ...).
    MovesRsp,
    /// Touches neither rsp nor rbp.
    Other,
}

/// The rule in force, as an [`UnwindRow`] without `pc`.
fn rule(cfa: u8, cfa_offset: i32, rbp: u8, rbp_offset: i16) -> UnwindRow {
    UnwindRow { pc: 0, cfa_offset, rbp_offset, cfa, rbp }
}

/// The rows of the function at `start` whose bytes are `code`, in address order. The last one
/// holds to the function's end.
pub fn rows(code: &[u8], start: u32) -> Vec<UnwindRow> {
    let mut current = rule(cfa::RSP, 8, rbp::SAME, 0);
    let mut rows = vec![UnwindRow { pc: start, ..current }];
    // Whether the stack was ever adjusted: until then every instruction runs with CFA = rsp + 8,
    // whichever path reaches it.
    let mut adjusted = false;
    let mut at = 0;
    for _ in 0..MAX_INSTRUCTIONS {
        let Some(rest) = code.get(at..).filter(|rest| !rest.is_empty()) else { return rows };
        let pc = start + at as u32;
        let Some((insn, len)) = decode(rest) else {
            unsupported(&mut rows, pc);
            return rows;
        };
        let next = match insn {
            Insn::Push(reg) => {
                let mut pushed = current;
                if pushed.cfa == cfa::RSP {
                    let Some(offset) = pushed.cfa_offset.checked_add(8) else {
                        unsupported(&mut rows, pc);
                        return rows;
                    };
                    pushed.cfa_offset = offset;
                }
                if reg == RBP && pushed.rbp == rbp::SAME && pushed.cfa == cfa::RSP {
                    // Saved at CFA - offset, too far for an rbp_offset in a frame of 32 KiB or more.
                    (pushed.rbp, pushed.rbp_offset) = match i16::try_from(-pushed.cfa_offset) {
                        Ok(offset) => (rbp::SAVED, offset),
                        Err(_) => (rbp::LOST, 0),
                    };
                }
                adjusted = true;
                pushed
            }
            Insn::FramePointer if current.rbp == rbp::SAVED && current.cfa == cfa::RSP => {
                rule(cfa::RBP, current.cfa_offset, current.rbp, current.rbp_offset)
            }
            Insn::SubRsp(k) if current.cfa == cfa::RSP => match current.cfa_offset.checked_add(k) {
                Some(offset) if k > 0 => {
                    adjusted = true;
                    UnwindRow { cfa_offset: offset, ..current }
                }
                _ => {
                    unsupported(&mut rows, pc);
                    return rows;
                }
            },
            // Once the CFA is rbp-based, the stack may move freely below it.
            Insn::SubRsp(_) | Insn::MovesRsp if current.cfa == cfa::RBP => current,
            // The caller's rbp is gone unless it was saved; a frame based on rbp loses its CFA.
            Insn::FramePointer | Insn::WritesRbp if current.rbp == rbp::SAME => UnwindRow { rbp: rbp::LOST, ..current },
            Insn::FramePointer | Insn::WritesRbp if current.cfa == cfa::RSP => current,
            Insn::Call => {
                // A call needs rsp 16-byte aligned, i.e. CFA - rsp a multiple of 16: otherwise
                // this is not the prologue it looked like.
                if current.cfa == cfa::RSP && current.cfa_offset % 16 != 0 {
                    unsupported(&mut rows, pc);
                }
                return rows;
            }
            Insn::Pop => return rows,
            // An early exit before any adjustment (shrink-wrapping, or a leaf): the code after it
            // is still at CFA = rsp + 8 and may hold the prologue.
            Insn::Leave if !adjusted => current,
            Insn::Leave => return rows,
            Insn::Branch | Insn::Other => current,
            Insn::FramePointer | Insn::WritesRbp | Insn::SubRsp(_) | Insn::MovesRsp => {
                unsupported(&mut rows, pc);
                return rows;
            }
        };
        at += len;
        if next != current {
            rows.push(UnwindRow { pc: start + at as u32, ..next });
        }
        current = next;
    }
    // Too long to follow: the rule past here is not known.
    unsupported(&mut rows, start + at as u32);
    rows
}

/// Ends `rows` with a `cfa::UNSUPPORTED` row at `pc`, in place of a row at the same pc.
fn unsupported(rows: &mut Vec<UnwindRow>, pc: u32) {
    if rows.last().is_some_and(|last| last.pc == pc) {
        rows.pop();
    }
    rows.push(UnwindRow { pc, cfa: cfa::UNSUPPORTED, ..UnwindRow::default() });
}

/// The instruction at the start of `code` and its length, for the instructions prologues and
/// the code around them use; `None` for any other.
fn decode(code: &[u8]) -> Option<(Insn, usize)> {
    // An fs or gs override (musl reads its thread pointer at %fs:0) changes the memory operand's
    // segment, not the instruction's form.
    match code.split_first() {
        Some((0x64 | 0x65, rest)) => decode_unprefixed(rest).map(|(insn, len)| (insn, len + 1)),
        _ => decode_unprefixed(code),
    }
}

fn decode_unprefixed(code: &[u8]) -> Option<(Insn, usize)> {
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
    if code.starts_with(&ENDBR64) {
        return Some((Insn::Other, 4));
    }
    let (rex, at) = match code.first()? {
        &rex @ 0x40..=0x4f => (rex, 1),
        _ => (0, 0),
    };
    let wide = rex & 8 != 0;
    let rex_b = (rex & 1) << 3;
    let op = *code.get(at)?;
    let after = at + 1;
    let modrm = |imm| operand(code, after, rex, imm);
    // An instruction writing register `dest` (None: memory or nothing).
    let writes = |dest: Option<u8>, len: usize| {
        let insn = match dest {
            Some(RSP) => Insn::MovesRsp,
            Some(RBP) => Insn::WritesRbp,
            _ => Insn::Other,
        };
        Some((insn, len))
    };
    match op {
        0x50..=0x57 => Some((Insn::Push((op - 0x50) | rex_b), after)),
        0x58..=0x5f => Some((Insn::Pop, after)),
        0xe8 => Some((Insn::Call, after + 4)).filter(|_| code.len() >= after + 4),
        0xe9 => Some((Insn::Leave, after + 4)).filter(|_| code.len() >= after + 4),
        0xeb => Some((Insn::Leave, after + 1)).filter(|_| code.len() > after),
        0xc3 => Some((Insn::Leave, after)),
        0x70..=0x7f => Some((Insn::Branch, after + 1)).filter(|_| code.len() > after),
        0x90 => Some((Insn::Other, after)),
        // mov $imm,%reg: imm64 with REX.W.
        0xb8..=0xbf => {
            let len = after + if wide { 8 } else { 4 };
            (len <= code.len()).then_some(())?;
            writes(Some((op - 0xb8) | rex_b), len)
        }
        // mov %rsp,%rbp, either encoding.
        0x89 | 0x8b if rex == 0x48 && code.get(after) == Some(&if op == 0x89 { 0xe5 } else { 0xec }) => {
            Some((Insn::FramePointer, after + 1))
        }
        // ALU and mov forms `op r/m, reg` (bit 1 clear: writes r/m) and `op reg, r/m`; cmp and
        // test write nothing.
        0x00..=0x3b if op & 7 <= 3 => {
            let (len, reg, rm) = modrm(0)?;
            match op {
                0x38..=0x3b => Some((Insn::Other, len)),
                _ if op & 2 != 0 => writes(Some(reg), len),
                _ => writes(rm, len),
            }
        }
        0x84 | 0x85 => Some((Insn::Other, modrm(0)?.0)),
        0x88 | 0x89 => {
            let (len, _, rm) = modrm(0)?;
            writes(rm, len)
        }
        0x8a | 0x8b | 0x8d | 0x63 => {
            let (len, reg, _) = modrm(0)?;
            writes(Some(reg), len)
        }
        // Group 1 with an immediate: /5 is sub, /7 cmp.
        0x80 | 0x81 | 0x83 => {
            let imm = if op == 0x81 { 4 } else { 1 };
            let (len, reg, rm) = modrm(imm)?;
            let bytes = &code[len - imm..len];
            let value = if imm == 4 { i32::from_le_bytes(bytes.try_into().ok()?) } else { i32::from(bytes[0] as i8) };
            match (reg & 7, rm) {
                (7, _) => Some((Insn::Other, len)),
                (5, Some(RSP)) if wide && op != 0x80 => Some((Insn::SubRsp(value), len)),
                _ => writes(rm, len),
            }
        }
        // Shifts by an immediate, mov $imm to r/m.
        0xc0 | 0xc1 | 0xc6 | 0xc7 => {
            let (len, _, rm) = modrm(if op == 0xc7 { 4 } else { 1 })?;
            writes(rm, len)
        }
        0xff => {
            let (len, reg, rm) = modrm(0)?;
            match reg & 7 {
                2 => Some((Insn::Call, len)),
                4 | 5 => Some((Insn::Leave, len)),
                6 => Some((Insn::MovesRsp, len)),
                _ => writes(rm, len),
            }
        }
        0x0f => {
            let second = *code.get(after)?;
            let after = after + 1;
            match second {
                // syscall: rsp and rbp are kept.
                0x05 => Some((Insn::Other, after)),
                0x80..=0x8f => Some((Insn::Branch, after + 4)).filter(|_| code.len() >= after + 4),
                // nopl, movzx, movsx, cmov: ModRM after the two opcode bytes.
                0x1f | 0x40..=0x4f | 0xb6 | 0xb7 | 0xbe | 0xbf => {
                    let (len, reg, _) = operand(code, after, rex, 0)?;
                    writes((second != 0x1f).then_some(reg), len)
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// The length of an instruction whose ModRM byte is at `at`, followed by `imm` immediate bytes,
/// and the registers ModRM names: `reg`, and `rm` when it is a register rather than memory.
fn operand(code: &[u8], at: usize, rex: u8, imm: usize) -> Option<(usize, u8, Option<u8>)> {
    let byte = *code.get(at)?;
    let (mode, reg, rm) = (byte >> 6, ((byte >> 3) & 7) | ((rex & 4) << 1), byte & 7);
    // rm 4 in memory forms means a SIB byte follows, whose base 5 (with mode 0) means disp32.
    let sib = mode != 3 && rm == 4;
    let base = if sib { code.get(at + 1)? & 7 } else { rm };
    let disp = match mode {
        0 if base == 5 => 4,
        1 => 1,
        2 => 4,
        _ => 0,
    };
    let len = at + 1 + usize::from(sib) + disp + imm;
    (len <= code.len()).then_some((len, reg, (mode == 3).then_some(rm | ((rex & 1) << 3))))
}
