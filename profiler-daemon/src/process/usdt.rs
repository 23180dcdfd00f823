//! The `otel_memory` USDT probe sites of a process (`--usdt`): found in the `.note.stapsdt` notes
//! of every file it maps, with where each probe's arguments are (see `profiler_common::usdt`);
//! and, in a Go program, the two functions of its runtime's own sampler (`go_runtime`).

use std::path::{Path, PathBuf};

use object::{Object as _, ObjectSection as _};
use profiler_common::usdt::{self, ProbeSpec, SpecError};

use crate::{error::UserError, process::procfs};

/// The provider of the contract's probes.
const PROVIDER: &str = "otel_memory";
/// The ELF note type of a probe site (`NT_STAPSDT`).
const NT_STAPSDT: u32 = 3;

/// Which probe of the contract a site is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// `alloc(ptr, size, weight)`.
    Alloc,
    /// `free(ptr)`.
    Free,
}

/// One probe site.
#[derive(Debug, Clone, PartialEq)]
pub struct Site {
    /// The file to attach to (reachable from memprof).
    pub path: PathBuf,
    /// The probe's offset in the file.
    pub offset: u64,
    /// The file offset of the probe's semaphore (`.probes`), which the kernel increments while the
    /// probe is attached; `None` for a probe without one.
    pub semaphore: Option<u64>,
    pub probe: Probe,
    pub spec: ProbeSpec,
    /// A Go runtime's site whose sampling starts off: the program links no heap profile, and is
    /// seen only once it sets `runtime.MemProfileRate` itself.
    pub starts_off: bool,
}

/// The sites in every file `pid` maps code from; an error naming the fix when it has none.
pub fn in_process(pid: u32) -> Result<Vec<Site>, UserError> {
    let files = procfs::mapped_files(pid)?;
    let running = procfs::file_mappings(pid).map_err(|err| procfs::maps_error(pid, err))?;
    let mut sites = Vec::new();
    for file in files.iter().filter(|file| running.iter().any(|m| m.executable && m.path == file.path)) {
        if let Some(path) = file.reachable_paths(pid).into_iter().find(|path| Path::new(path).exists()) {
            sites.extend(in_file(Path::new(&path), &file.path)?);
        }
    }
    none_is_an_error(sites, format!("pid {pid}"))
}

/// The sites in the files a command maps when it starts (see `allocator::for_command`).
pub fn in_files(files: &[PathBuf], command: &Path) -> Result<Vec<Site>, UserError> {
    let mut sites = Vec::new();
    for file in files {
        sites.extend(in_file(file, &file.display().to_string())?);
    }
    none_is_an_error(sites, command.display().to_string())
}

/// Says, once per file, that a Go runtime among `sites` starts with its sampling off.
pub fn say_if_sampling_off(sites: &[Site]) {
    for site in sites.iter().filter(|site| site.starts_off && site.probe == Probe::Alloc) {
        tracing::warn!(
            "Go's runtime in {} starts with its heap sampling off (runtime.MemProfileRate 0), as the program links \
             no runtime/pprof: memprof sees only the samples taken once it sets runtime.MemProfileRate",
            site.path.display()
        );
    }
}

/// How `sites` trace a process, for the line `attach` and `run` start with.
pub fn describe(sites: &[Site]) -> String {
    let go = sites.iter().filter(|site| site.spec.sampler == usdt::sampler::GO).count();
    let otel = sites.len() - go;
    let mut parts = Vec::new();
    if otel > 0 {
        parts.push(format!("{otel} otel_memory probes, the allocator's own sampler"));
    }
    if go > 0 {
        parts.push("Go's runtime sampler (runtime.mProf_Malloc and runtime.freeSpecial)".to_string());
    }
    parts.join(" and ")
}

fn none_is_an_error(sites: Vec<Site>, target: String) -> Result<Vec<Site>, UserError> {
    if sites.iter().any(|site| site.probe == Probe::Alloc) {
        Ok(sites)
    } else {
        Err(UserError::NoUsdtProbes { target })
    }
}

/// The sites in the file at `path` (named `display` in errors): its `otel_memory` probes, and
/// Go's runtime sampler in a Go program; none when it is not ELF.
fn in_file(path: &Path, display: &str) -> Result<Vec<Site>, UserError> {
    let Ok(data) = super::elf_bytes::read_path(path) else { return Ok(Vec::new()) };
    let Ok(elf) = object::File::parse(&*data) else { return Ok(Vec::new()) };
    let mut sites = otel_sites(&elf, path, display)?;
    sites.extend(super::go_runtime::sites(&elf, path, display)?);
    Ok(sites)
}

/// The `otel_memory` probe sites of `elf`, from its `.note.stapsdt` notes.
fn otel_sites(elf: &object::File<'_>, path: &Path, display: &str) -> Result<Vec<Site>, UserError> {
    let Some(notes) = elf.section_by_name(".note.stapsdt").and_then(|section| section.data().ok()) else {
        return Ok(Vec::new());
    };
    let base = elf.section_by_name(".stapsdt.base").map(|section| section.address());
    let mut sites = Vec::new();
    for note in notes_of(notes) {
        let Some(found) = Note::parse(note) else { continue };
        if found.provider != PROVIDER {
            continue;
        }
        let probe = match found.name {
            "alloc" => Probe::Alloc,
            "free" => Probe::Free,
            _ => continue,
        };
        let bad = |detail: String| UserError::UsdtProbe { file: display.to_string(), name: found.name.into(), detail };
        // A prelinked file moved its sections: the note's base says by how much.
        let moved = |address: u64| match base {
            Some(actual) => address.wrapping_add(actual).wrapping_sub(found.base),
            None => address,
        };
        let address = moved(found.pc);
        let offset =
            file_offset(elf, address).ok_or_else(|| bad(format!("its address {address:#x} is in no section")))?;
        let semaphore = match found.semaphore {
            0 => None,
            at => Some(file_offset(elf, moved(at)).ok_or_else(|| {
                bad(format!("its semaphore's address {:#x} is in no section of the file", moved(at)))
            })?),
        };
        let mut spec = ProbeSpec::default();
        let wanted = if probe == Probe::Alloc { usdt::ARGS } else { 1 };
        let args: Vec<&str> = found.args.split_whitespace().collect();
        if args.len() < wanted {
            return Err(bad(format!("it has {} arguments, the contract {wanted}", args.len())));
        }
        for (slot, text) in spec.args.iter_mut().zip(&args[..wanted]) {
            *slot = usdt::parse(text).map_err(|err| bad(format!("argument `{text}`: {}", spec_error(err))))?;
        }
        sites.push(Site { path: path.to_path_buf(), offset, semaphore, probe, spec, starts_off: false });
    }
    Ok(sites)
}

fn spec_error(err: SpecError) -> &'static str {
    match err {
        SpecError::Size => "a size other than 1, 2, 4 or 8 bytes",
        SpecError::Register => "a register memprof does not read",
        SpecError::Operand => "an operand form memprof does not read (an index register or a symbol)",
    }
}

/// The file offset of virtual address `address`, in the loaded section that holds it.
pub(super) fn file_offset(elf: &object::File<'_>, address: u64) -> Option<u64> {
    let section = loaded_section(elf, address)?;
    let (offset, _) = section.file_range()?;
    Some(address - section.address() + offset)
}

/// The loaded section that holds virtual address `address`. Sections at address 0 are not
/// loaded (DWARF, the symbol table) and hold no address, however large they are.
pub(super) fn loaded_section<'data, 'file>(
    elf: &'file object::File<'data>,
    address: u64,
) -> Option<object::Section<'data, 'file>> {
    elf.sections().find(|section| {
        let start = section.address();
        start != 0 && (start..start + section.size()).contains(&address)
    })
}

/// One `stapsdt` note's description.
struct Note<'a> {
    pc: u64,
    base: u64,
    semaphore: u64,
    provider: &'a str,
    name: &'a str,
    args: &'a str,
}

impl<'a> Note<'a> {
    /// Parses a description: three 8-byte addresses, then provider, name and arguments, each
    /// ending with a NUL.
    fn parse(desc: &'a [u8]) -> Option<Self> {
        let word = |i: usize| Some(u64::from_le_bytes(desc.get(i * 8..i * 8 + 8)?.try_into().ok()?));
        let (pc, base, semaphore) = (word(0)?, word(1)?, word(2)?);
        let mut strings = desc.get(24..)?.split(|&b| b == 0).map(|s| std::str::from_utf8(s).ok());
        let (provider, name, args) = (strings.next()??, strings.next()??, strings.next().flatten().unwrap_or(""));
        Some(Note { pc, base, semaphore, provider, name, args })
    }
}

/// The descriptions of the `stapsdt` notes in a notes section (4-byte aligned, little-endian).
fn notes_of(mut data: &[u8]) -> Vec<&[u8]> {
    let align = |n: usize| n.div_ceil(4) * 4;
    let mut descriptions = Vec::new();
    while data.len() >= 12 {
        let field = |i: usize| u32::from_le_bytes(data[i * 4..i * 4 + 4].try_into().unwrap_or_default()) as usize;
        let (name_size, desc_size, kind) = (field(0), field(1), field(2) as u32);
        let name_end = 12 + align(name_size);
        let Some(desc) = data.get(name_end..name_end + desc_size) else { break };
        if kind == NT_STAPSDT && data.get(12..12 + name_size) == Some(b"stapsdt\0".as_slice()) {
            descriptions.push(desc);
        }
        data = data.get(name_end + align(desc_size)..).unwrap_or_default();
    }
    descriptions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend((name.len() as u32).to_le_bytes());
        out.extend((desc.len() as u32).to_le_bytes());
        out.extend(kind.to_le_bytes());
        out.extend(name);
        out.resize(out.len().div_ceil(4) * 4, 0);
        out.extend(desc);
        out.resize(out.len().div_ceil(4) * 4, 0);
        out
    }

    #[test]
    fn stapsdt_notes_are_read() {
        let mut desc = Vec::new();
        for word in [0x1139u64, 0x2000, 0] {
            desc.extend(word.to_le_bytes());
        }
        desc.extend(b"otel_memory\0alloc\08@%rax -8@%rdx 8@$524288\0");
        let mut section = note(b"GNU\0", 1, &[0; 5]);
        section.extend(note(b"stapsdt\0", NT_STAPSDT, &desc));
        let descriptions = notes_of(&section);
        assert_eq!(descriptions.len(), 1);
        let found = Note::parse(descriptions[0]).unwrap();
        assert_eq!((found.pc, found.base, found.semaphore), (0x1139, 0x2000, 0));
        assert_eq!((found.provider, found.name, found.args), ("otel_memory", "alloc", "8@%rax -8@%rdx 8@$524288"));
    }
}
