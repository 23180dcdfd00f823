//! Go's runtime samples its own heap: about one allocation in every `runtime.MemProfileRate`
//! bytes (512 KiB by default) goes to `runtime.mProf_Malloc(ptr, size)`, and when the garbage
//! collector sweeps such a block it frees its heap-profile record at `runtime.freeSpecial(special,
//! ptr, size)`. `--usdt` probes those two functions as it probes `otel_memory` sites (see
//! `profiler_common::usdt::sampler::GO`): one trap per sample, whatever the allocation rate.
//!
//! Their arguments are in registers under Go's internal calling convention (RAX, RBX, RCX, ...)
//! and their layout changes between Go versions: memprof reads the versions whose runtime it
//! knows, and says so for the others.

use iced_x86::{Decoder, DecoderOptions, MemorySize, Mnemonic, OpKind, Register};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
use profiler_common::usdt::{self, kind, sampler, ArgSpec, ProbeSpec};

use super::{
    go_functions::{self, GoFunctions},
    usdt::{file_offset, loaded_section, Probe, Site},
};
use crate::error::UserError;

/// The Go releases whose runtime memprof reads: `mProf_Malloc`'s arguments, `freeSpecial(special,
/// ptr, size)`, and the `special` record's kind byte (`runtime/mprof.go`, `runtime/mheap.go`).
const KNOWN_MINORS: std::ops::RangeInclusive<u32> = 18..=27;

/// What the probes read where a release keeps it.
struct Layout {
    /// `mProf_Malloc`'s pointer and size arguments.
    pointer: &'static str,
    size: &'static str,
    /// Where a special record keeps its kind, from the record's address in RAX, and a heap
    /// profile's kind.
    kind: &'static str,
    profile_kind: &'static str,
}

fn layout(minor: u32) -> Layout {
    // Go 1.23: `mProf_Malloc(mp, ptr, size)`, and weak pointers' records took kind 2. Go 1.24:
    // a record's object offset grew to 8 bytes. Go 1.25: tiny blocks' records took kind 1.
    let (pointer, size) = if minor >= 23 { ("8@%rbx", "8@%rcx") } else { ("8@%rax", "8@%rbx") };
    let kind = if minor >= 24 { "1@16(%rax)" } else { "1@10(%rax)" };
    let profile_kind = match minor {
        ..=22 => "1@$2",
        23 | 24 => "1@$3",
        _ => "1@$4",
    };
    Layout { pointer, size, kind, profile_kind }
}

const BUILDINFO_MAGIC: &[u8] = b"\xff Go buildinf:";

/// The two sites in the Go program `elf` (read from `path`, named `display` in errors); none
/// when it is not a Go program.
pub fn sites(elf: &object::File<'_>, path: &std::path::Path, display: &str) -> Result<Vec<Site>, UserError> {
    let Some(version) = version(elf) else { return Ok(Vec::new()) };
    let refuse = |detail: String| UserError::GoSampler { file: display.to_string(), detail };
    let minor =
        minor(&version).ok_or_else(|| refuse(format!("its Go version `{version}` is not one memprof reads")))?;
    if !KNOWN_MINORS.contains(&minor) {
        return Err(refuse(format!(
            "it is built with {version}, and memprof reads Go's samples from go1.{} to go1.{} only",
            KNOWN_MINORS.start(),
            KNOWN_MINORS.end()
        )));
    }
    let runtime = Runtime::from_symbols(elf).or_else(|| Runtime::from_function_table(elf)).ok_or_else(|| {
        refuse(
            "memprof found neither its symbol table nor, in its function table (.gopclntab), the runtime's \
             runtime.mProf_Malloc, runtime.freeSpecial and runtime.MemProfileRate"
                .into(),
        )
    })?;
    let starts_off = runtime.disabled.and_then(|at| bytes_at(elf, at, 1)) == Some(&[1][..]);
    let offset = |address: u64| {
        file_offset(elf, address).ok_or_else(|| refuse(format!("its address {address:#x} is in no section")))
    };
    let spec = |texts: [&str; 3]| -> Result<ProbeSpec, UserError> {
        let mut spec = ProbeSpec { sampler: sampler::GO, ..ProbeSpec::default() };
        for (slot, text) in spec.args.iter_mut().zip(texts) {
            *slot = usdt::parse(text).map_err(|err| refuse(format!("memprof's argument `{text}`: {err:?}")))?;
        }
        Ok(spec)
    };
    let (malloc, free) = (past_stack_check(elf, runtime.malloc), past_stack_check(elf, runtime.free));
    let malloc = if minor >= 23 { past_unrecorded_samples(elf, malloc) } else { malloc };
    let layout = layout(minor);
    let mut alloc = spec([layout.pointer, layout.size, "8@%rip"])?;
    // MemProfileRate, read at each sample (a program sets it as it starts): at a fixed distance
    // from the probe, which is where the instruction pointer is when the probe fires.
    alloc.args[2] = ArgSpec { kind: kind::MEMORY, value: runtime.rate.wrapping_sub(malloc) as i64, ..alloc.args[2] };
    let site = |probe, address, spec| -> Result<Site, UserError> {
        Ok(Site { path: path.to_path_buf(), offset: offset(address)?, semaphore: None, probe, spec, starts_off })
    };
    Ok(vec![
        site(Probe::Alloc, malloc, alloc)?,
        site(Probe::Free, free, spec(["8@%rbx", layout.kind, layout.profile_kind])?)?,
    ])
}

/// Where Go's runtime keeps its sampler: the two functions probed, and the variables of its rate.
struct Runtime {
    /// `runtime.mProf_Malloc` and `runtime.freeSpecial`.
    malloc: u64,
    free: u64,
    /// `runtime.MemProfileRate`.
    rate: u64,
    /// `runtime.disableMemoryProfiling`, which the linker sets in a program that links no heap
    /// profile; not always found.
    disabled: Option<u64>,
}

impl Runtime {
    /// From the program's symbol table, in one pass.
    fn from_symbols(elf: &object::File<'_>) -> Option<Self> {
        let (mut malloc, mut free, mut rate, mut disabled) = (None, None, None, None);
        for symbol in elf.symbols() {
            let slot = match symbol.name() {
                Ok("runtime.mProf_Malloc") => &mut malloc,
                Ok("runtime.freeSpecial" | "runtime.freespecial") => &mut free,
                Ok("runtime.MemProfileRate") => &mut rate,
                Ok("runtime.disableMemoryProfiling") => &mut disabled,
                _ => continue,
            };
            *slot = Some(symbol.address());
        }
        Some(Self { malloc: malloc?, free: free?, rate: rate?, disabled })
    }

    /// From the function table a stripped program keeps (`go_functions`). It names functions
    /// only: the two variables are found where the runtime sets the rate (`rate_variables`).
    fn from_function_table(elf: &object::File<'_>) -> Option<Self> {
        let table = go_functions::section_data(elf)?;
        let wanted =
            ["runtime.mProf_Malloc", "runtime.freeSpecial", "runtime.freespecial", "runtime.init", "runtime.schedinit"];
        let found = GoFunctions::read(table, go_functions::text_start(elf))?.find(table, &wanted);
        let function = |names: &[&str]| {
            found.iter().find(|(name, _)| names.contains(&name.as_str())).map(|(_, range)| range.clone())
        };
        let (rate, disabled) = ["runtime.init", "runtime.schedinit"].iter().find_map(|name| {
            let range = function(&[name])?;
            let holds_default = |address| bytes_at(elf, address, 8) == Some(&DEFAULT_RATE.to_le_bytes()[..]);
            rate_variables(bytes_at(elf, range.start, range.end - range.start)?, range.start, holds_default)
        })?;
        Some(Self {
            malloc: function(&["runtime.mProf_Malloc"])?.start,
            free: function(&["runtime.freeSpecial", "runtime.freespecial"])?.start,
            rate,
            disabled: Some(disabled),
        })
    }
}

/// `runtime.MemProfileRate`'s default, 512 KiB.
const DEFAULT_RATE: u64 = 512 * 1024;

/// The addresses of `MemProfileRate` and `disableMemoryProfiling` in `code`, which starts at
/// `address`. The runtime sets the rate from the flag, as Go 1.18 and 1.19's `runtime.init`
/// (`MemProfileRate = defaultMemProfileRate(512 * 1024)`: the flag's byte read, 512 KiB in a
/// register, and an 8-byte store) or as later releases' `runtime.schedinit` do (`if
/// disableMemoryProfiling { MemProfileRate = 0 }`: the byte compared, then 0 stored into a
/// variable that `holds_default` in the file). Each within a few instructions.
fn rate_variables(code: &[u8], address: u64, holds_default: impl Fn(u64) -> bool) -> Option<(u64, u64)> {
    const WINDOW: usize = 8;
    let (mut flag, mut default) = (None, None);
    let decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    for (index, instruction) in decoder.into_iter().enumerate() {
        let recent = |seen: Option<usize>| seen.is_some_and(|at| index - at <= WINDOW);
        let in_memory = instruction.is_ip_rel_memory_operand();
        if in_memory
            && instruction.memory_size() == MemorySize::UInt8
            && matches!(instruction.mnemonic(), Mnemonic::Movzx | Mnemonic::Cmp)
        {
            flag = Some((index, instruction.ip_rel_memory_address()));
        } else if instruction.op_count() == 2
            && instruction.op1_kind() == OpKind::Immediate32
            && u64::from(instruction.immediate32()) == DEFAULT_RATE
        {
            default = Some(index);
        } else if in_memory
            && instruction.mnemonic() == Mnemonic::Mov
            && instruction.op0_kind() == OpKind::Memory
            && instruction.memory_size() == MemorySize::UInt64
        {
            let rate = instruction.ip_rel_memory_address();
            match flag {
                Some((at, flag)) if recent(Some(at)) && (recent(default) || holds_default(rate)) => {
                    return Some((rate, flag))
                }
                _ => {}
            }
        }
    }
    None
}

/// Where to probe the function at `address`: past the check that opens it, whether its goroutine's
/// stack has room (`cmp 0x10(%r14), %rsp` or `%r12`, then `jbe` to `runtime.morestack`). A call
/// that finds too little room grows the stack and starts the function again, so a probe on the
/// check would fire twice for it. The arguments are still in their registers past it. A function
/// without the check (`//go:nosplit`) is probed at its first byte.
fn past_stack_check(elf: &object::File<'_>, address: u64) -> u64 {
    bytes_at(elf, address, 64).map_or(address, |code| address + stack_check_length(code))
}

/// Where to probe `mProf_Malloc` from Go 1.23 on, `address` being past its stack check: past its
/// check that the thread can record a sample (`if mp.profStack == nil { return }`: a sample taken
/// while a thread starts is dropped, and never freed), where its pointer and size are still in
/// RBX and RCX. `address` itself where the code is not as expected.
fn past_unrecorded_samples(elf: &object::File<'_>, address: u64) -> u64 {
    bytes_at(elf, address, 64).map_or(address, |code| address + profile_stack_check_length(code))
}

/// The bytes up to the end of `mov disp(%rax), reg; test reg, reg; je` at the start of `code`,
/// none of which writes RBX or RCX; 0 without it.
fn profile_stack_check_length(code: &[u8]) -> u64 {
    let mut decoder = Decoder::new(64, code, DecoderOptions::NONE);
    let mut loaded = None;
    for instruction in decoder.iter().take(8) {
        let written = instruction.op0_kind() == OpKind::Register
            && [Register::RBX, Register::RCX].contains(&instruction.op0_register().full_register());
        if written && instruction.mnemonic() != Mnemonic::Test {
            return 0;
        }
        match instruction.mnemonic() {
            Mnemonic::Mov if instruction.op1_kind() == OpKind::Memory && instruction.memory_base() == Register::RAX => {
                loaded = Some(instruction.op0_register());
            }
            Mnemonic::Test
                if loaded.is_some_and(|reg| instruction.op0_register() == reg && instruction.op1_register() == reg) => {
            }
            Mnemonic::Je if loaded.is_some() => return instruction.next_ip(),
            _ => {}
        }
    }
    0
}

/// The bytes the stack check takes at the start of `code`; 0 without one.
fn stack_check_length(code: &[u8]) -> u64 {
    let mut decoder = Decoder::new(64, code, DecoderOptions::NONE);
    let mut checked = false;
    for instruction in decoder.iter().take(4) {
        if instruction.mnemonic() == Mnemonic::Cmp && instruction.memory_base() == Register::R14 {
            checked = true;
        } else if checked && instruction.mnemonic() == Mnemonic::Jbe {
            return instruction.next_ip();
        }
    }
    0
}

/// Up to `length` bytes of the file at virtual address `address`, from the loaded section that
/// holds it: none in one that takes no room in the file (`.bss`, whose bytes are zeros only in
/// memory).
fn bytes_at<'a>(elf: &'a object::File<'_>, address: u64, length: u64) -> Option<&'a [u8]> {
    let section = loaded_section(elf, address)?;
    let at = address - section.address();
    section.data().ok()?.get(at as usize..(at + length).min(section.size()) as usize)
}

/// The Go version the program was built with (`go1.19.8`), from its build information.
fn version(elf: &object::File<'_>) -> Option<String> {
    let data = elf.section_by_name(".go.buildinfo")?.data().ok()?;
    // Go 1.18 and later write the version inline after a 32-byte header (flag bit 2), as a
    // length (one varint byte for any version string) and the string.
    let inline = data.starts_with(BUILDINFO_MAGIC) && data.get(15).is_some_and(|flags| flags & 2 != 0);
    let length = *data.get(32).filter(|&&length| inline && length < 0x80)? as usize;
    std::str::from_utf8(data.get(33..33 + length)?).ok().map(str::to_string)
}

/// 19 for `go1.19.8`.
fn minor(version: &str) -> Option<u32> {
    let rest = version.strip_prefix("go1.")?;
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_go_past_the_stack_check() {
        // Go 1.19's runtime.mProf_Malloc: lea -0xf0(%rsp),%r12; cmp 0x10(%r14),%r12; jbe; sub.
        let large_frame = hex("4c8da42410ffffff4d3b66100f86aa0100004881ec70010000");
        assert_eq!(stack_check_length(&large_frame), 0x12);
        // runtime.freeSpecial: cmp 0x10(%r14),%rsp; jbe; sub $0x30,%rsp.
        let small_frame = hex("493b66100f860a0100004883ec30");
        assert_eq!(stack_check_length(&small_frame), 10);
        // A function without the check (//go:nosplit): sub $0x18,%rsp; mov %rbp,0x10(%rsp).
        assert_eq!(stack_check_length(&hex("4883ec1848896c2410")), 0);
    }

    #[test]
    fn the_rate_is_found_where_the_runtime_sets_it() {
        // Go 1.19's runtime.init at 0x456165: movzbl flag(%rip),%eax; test; mov $0x80000,%eax;
        // mov $0,%ecx; cmovne; mov %rax,rate(%rip).
        let init = hex("0fb60598aa0c004885c0b800000800b900000000480f45c14889050cab0c00");
        assert_eq!(rate_variables(&init, 0x456165, |_| false), Some((0x520c90, 0x520c04)));
        // Go 1.22's runtime.schedinit at 0x43517b: cmpb $0,flag(%rip); je; movq $0,rate(%rip).
        let schedinit = hex("803d4f2e120000740b48c70511e00b0000000000");
        assert_eq!(rate_variables(&schedinit, 0x43517b, |rate| rate == 0x4f31a0), Some((0x4f31a0, 0x557fd1)));
        // The same store into a variable that does not hold 512 KiB is another variable's.
        assert_eq!(rate_variables(&schedinit, 0x43517b, |_| false), None);
    }

    #[test]
    fn go_1_24_samples_are_probed_once_the_thread_can_record_them() {
        // Past the stack check: push %rbp; mov %rsp,%rbp; sub $0x70,%rsp; mov 0x2b0(%rax),%rsi;
        // nopl; test %rsi,%rsi; je.
        let code = hex("554889e54883ec70488bb0b00200000f1f80000000004885f60f8460010000");
        assert_eq!(profile_stack_check_length(&code), 0x1f);
        // The pointer's register written before the check: not there.
        let moved = hex("554889c3488bb0b00200004885f60f8460010000");
        assert_eq!(profile_stack_check_length(&moved), 0);
    }

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn versions_are_read_to_their_minor() {
        assert_eq!(minor("go1.19.8"), Some(19));
        assert_eq!(minor("go1.22rc1"), Some(22));
        assert_eq!(minor("devel go1.23-abc"), None);
    }
}
