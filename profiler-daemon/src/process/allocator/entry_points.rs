//! A file's allocator entry points, read from its symbols once per file, each placed where the
//! kernel's probe costs least (see `placement`).

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    path::Path,
    sync::LazyLock,
};

use object::{Object, ObjectSection, ObjectSymbol};
use profiler_common::{completion::RDI, AllocFn, MOVABLE_ARGUMENTS};

use super::{blind_spots::UNPROBED, is_libc, AllocatorFile, BlindSpot, FileScan, FreePoint, ProbePoint};
use crate::process::{
    elf_bytes,
    families::{self, Family, Role},
    fast_path,
    file_cache::{FileCache, FileId, Opened},
    placement::{self, Placement},
};

/// Scans with every family, by file: every exec and attach scans the files its process maps,
/// the C library and the shell among them each time, and a scan reads all of a file but its
/// debugging sections.
static SCANS: LazyLock<FileCache<Option<FileScan>>> = LazyLock::new(|| FileCache::new(1024));

/// `scan_file` with every family, once per file: a file scanned through another path (another
/// process's `/proc/PID/root`) is attached through this one.
pub(super) fn scan(attach_path: &Path, display_path: &str) -> Option<FileScan> {
    let opened = Opened::open(attach_path).ok()?;
    let mut scan = SCANS
        .get_or_read(&opened, display_path, |_| scan_file(&families::all(), &opened, attach_path, display_path))?;
    if let Some(file) = &mut scan.allocator {
        file.attach_path = attach_path.to_path_buf();
    }
    Some(scan)
}

/// Reads what the ELF file `opened` (at `attach_path`) holds of allocators, with one pass over
/// its symbols; `None` when it holds none at all.
pub(super) fn scan_file(
    families: &[Family],
    opened: &Opened,
    attach_path: &Path,
    display_path: &str,
) -> Option<FileScan> {
    let data = elf_bytes::read(opened.file()).ok()?;
    let elf = object::File::parse(&*data).ok()?;
    let wanted: HashSet<&str> = families
        .iter()
        .flat_map(|f| f.entries.iter().map(|(s, _)| s.as_str()))
        .chain(UNPROBED.iter().map(|unprobed| unprobed.mark))
        .collect();
    let functions = functions(&elf, &wanted);
    let unprobed: Vec<BlindSpot> = UNPROBED
        .iter()
        .filter(|unprobed| {
            functions.contains_key(unprobed.mark)
                || unprobed.section.is_some_and(|name| elf.section_by_name(name).is_some())
        })
        .map(|unprobed| BlindSpot {
            kind: "unprobed_allocator",
            what: format!("{}, in {display_path}", unprobed.what),
            advice: unprobed.advice.to_string(),
            heap: Some(unprobed.heap),
            bytes: None,
            unless_env: unprobed.unless_env,
        })
        .collect();
    // Probe sites are chosen by decoding x86-64 code; on other machines they stay on the symbols.
    let code = |function: Function| match elf.architecture() {
        object::Architecture::X86_64 => function.code(&data),
        _ => &[],
    };
    let text = crate::unwind::load_segments(&data).unwrap_or_default();
    let allocator = read_file(families, &functions, code, &text, (attach_path, opened.id()), display_path);
    (allocator.is_some() || !unprobed.is_empty()).then_some(FileScan { allocator, unprobed })
}

/// The entry points of `families` a file defines, from its `functions`, if it holds any; `code`
/// gives a function's bytes to decode (none: probed at its symbol); `text`, the file's
/// executable segments (file offset, size, address).
fn read_file<'d>(
    families: &[Family],
    functions: &HashMap<&str, Function>,
    code: impl Fn(Function) -> &'d [u8],
    text: &[(u64, u64, u64)],
    (attach_path, id): (&Path, FileId),
    display_path: &str,
) -> Option<AllocatorFile> {
    let present = |family: &&Family| family.is_in(|symbol| functions.contains_key(symbol));
    let mut found: Vec<&Family> = families.iter().filter(|f| !f.companion).filter(present).collect();
    let own_allocator = found.iter().any(|f| f.name != families::STANDARD_FAMILY);
    if found.len() > 1 {
        // Rust's global allocator calls one of the others, probed already.
        found.retain(|f| f.name != families::RUST);
    }
    if own_allocator {
        found.extend(families.iter().filter(|f| f.companion).filter(present));
    }
    if found.is_empty() {
        return None;
    }
    let wrapper = !is_libc(display_path);
    let mut file = AllocatorFile {
        display_path: display_path.to_string(),
        attach_path: attach_path.to_path_buf(),
        id,
        families: Vec::new(),
        allocs: Vec::new(),
        frees: Vec::new(),
    };
    // Symbol addresses probed already: aliases (glibc's `cfree` is `free`) get one probe, and a
    // probe may sit past the symbol's address (see `placement`).
    let mut probed = HashSet::new();
    for family in found {
        if !file.families.contains(&family.name) {
            file.families.push(family.name);
        }
        for (symbol, role) in &family.entries {
            let Some(&function) = functions.get(symbol.as_str()) else { continue };
            if !probed.insert(function.offset) {
                continue;
            }
            // A C library's free probe's cookie spans its code (`FreePoint::c_library_code`),
            // where moved arguments would be said.
            let may_move = wrapper || matches!(role, Role::Alloc(_));
            let entry = placement::probe_site(code(function), *role, may_move);
            match role {
                Role::Alloc(func) => file.allocs.extend(alloc_points(*func, function.offset, entry, code(function))),
                Role::Free => {
                    let offset = function.offset + entry.distance;
                    let c_library_code = if wrapper { None } else { code_around(text, offset) };
                    file.frees.push(FreePoint { offset, wrapper, c_library_code, moved: entry.moved })
                }
            }
        }
    }
    (!file.allocs.is_empty() && !file.frees.is_empty()).then_some(file)
}

/// Where allocation function `func`, at file offset `start`, is probed: on its fast path's sites
/// where it has one that memprof can follow (only the size read: see `fast_path`), else at
/// `entry`, its entry probe's placement.
fn alloc_points(func: AllocFn, start: u64, entry: Placement, code: &[u8]) -> Vec<ProbePoint> {
    let size_only = func.arguments().read().eq([0]);
    let Some(fast_path) = size_only.then(|| fast_path::of(code)).flatten() else {
        return vec![ProbePoint { offset: start + entry.distance, func, completion: None, moved: entry.moved }];
    };
    let slow_paths = fast_path.slow_paths.iter().map(|&site| (site, None));
    let completions = fast_path.completions.iter().map(|&(site, completion)| (site, Some(completion)));
    slow_paths
        .chain(completions)
        .map(|(site, completion)| {
            let mut moved = [None; MOVABLE_ARGUMENTS];
            moved[0] = (site.size_register != RDI).then_some(site.size_register);
            ProbePoint { offset: start + site.offset, func, completion, moved }
        })
        .collect()
}

/// How far the executable segment of `text` that holds file offset `offset` reaches below and
/// above it: distances in the file are distances in memory within one segment.
fn code_around(text: &[(u64, u64, u64)], offset: u64) -> Option<(u64, u64)> {
    let &(start, size, _) = text.iter().find(|(start, size, _)| (*start..start + size).contains(&offset))?;
    Some((offset - start, start + size - offset))
}

/// Symbols looked up by file: each process's dynamic linker is hooked by them, and a forking
/// server's children all map the same one.
static SYMBOLS: LazyLock<FileCache<Option<u64>>> = LazyLock::new(|| FileCache::new(64));

/// The file offset of function `name` in the ELF file `file` (to probe it).
pub fn function_file_offset(file: &Opened, name: &'static str) -> Option<u64> {
    SYMBOLS.get_or_read(file, name, |file| read_function_file_offset(file, name))
}

fn read_function_file_offset(file: &File, name: &'static str) -> Option<u64> {
    let data = elf_bytes::read(file).ok()?;
    let file = object::File::parse(&*data).ok()?;
    functions(&file, &HashSet::from([name])).get(name).map(|function| function.offset)
}

/// How far symbol `to` is from symbol `from` in the ELF file `file` (their virtual addresses,
/// the same distance once loaded); None unless both are defined.
pub fn symbol_distance(file: &Opened, from: &str, to: &str) -> Option<u64> {
    SYMBOLS.get_or_read(file, &format!("{from} to {to}"), |file| read_symbol_distance(file, from, to))
}

fn read_symbol_distance(file: &File, from: &str, to: &str) -> Option<u64> {
    let data = elf_bytes::read(file).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let address = |wanted: &str| {
        file.dynamic_symbols().chain(file.symbols()).find_map(|symbol| {
            let name = symbol.name().ok()?;
            (!symbol.is_undefined() && name.split('@').next() == Some(wanted)).then(|| symbol.address())
        })
    };
    Some(address(to)?.wrapping_sub(address(from)?))
}

/// Each function named in `wanted` that the ELF file `data` (parsed: `elf`) defines: its file
/// offset and its bytes, as its symbol's size bounds them (none on a machine other than x86-64).
pub fn functions_with_code<'d, 'a>(
    data: &'d [u8],
    elf: &object::File,
    wanted: &HashSet<&'a str>,
) -> HashMap<&'a str, (u64, &'d [u8])> {
    let x86_64 = elf.architecture() == object::Architecture::X86_64;
    let code = |function: Function| if x86_64 { function.code(data) } else { &[] };
    functions(elf, wanted).into_iter().map(|(name, function)| (name, (function.offset, code(function)))).collect()
}

/// A function in an ELF file: where its code starts in the file, and its symbol's size.
#[derive(Debug, Clone, Copy)]
struct Function {
    offset: u64,
    size: u64,
}

impl Function {
    /// Its bytes in `data` (the whole file); none when its size is unknown or out of the file.
    fn code(self, data: &[u8]) -> &[u8] {
        let range = usize::try_from(self.offset).ok().zip(usize::try_from(self.size).ok());
        range.and_then(|(start, size)| data.get(start..start.checked_add(size)?)).unwrap_or(&[])
    }
}

/// The functions named in `wanted` that the file defines, from the dynamic table and the full
/// symbol table (static binaries, Rust's static allocators).
fn functions<'a>(file: &object::File, wanted: &HashSet<&'a str>) -> HashMap<&'a str, Function> {
    let mut found = HashMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.is_undefined() || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        let Ok(name) = symbol.name() else { continue };
        // Versioned names such as `malloc@@GLIBC_2.2.5` are the same function.
        let name = name.split('@').next().unwrap_or(name);
        let Some(&wanted) = wanted.get(name) else {
            continue;
        };
        if found.contains_key(wanted) {
            continue;
        }
        if let Some(offset) = file_offset(file, symbol.address()) {
            found.insert(wanted, Function { offset, size: symbol.size() });
        }
    }
    found
}

/// Uprobes are placed by file offset: the address's distance into its section plus the section's
/// offset in the file.
fn file_offset(file: &object::File, address: u64) -> Option<u64> {
    file.sections().find_map(|section| {
        let (start, size) = (section.address(), section.size());
        let (offset, _) = section.file_range()?;
        (address >= start && address < start + size).then(|| address - start + offset)
    })
}

#[cfg(test)]
mod tests {
    use profiler_common::MovedArguments;

    use super::*;

    /// Where each entry point of each family is probed in Debian's allocator libraries (the
    /// project's set-up installs them for the allocator tests): a table on stdout for review,
    /// and the sites measured to matter.
    #[test]
    fn debian_allocators_are_probed_past_their_single_stepped_openings() {
        const LIBRARIES: [&str; 4] =
            ["libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libmimalloc.so.2.0", "libc.so.6"];
        let families = families::all();
        let wanted: HashSet<&str> = families.iter().flat_map(|f| f.entries.iter().map(|(s, _)| s.as_str())).collect();
        let mut placed = HashMap::new();
        for library in LIBRARIES {
            let path = format!("/usr/lib/x86_64-linux-gnu/{library}");
            let data =
                std::fs::read(&path).unwrap_or_else(|err| panic!("{path}: {err} (cargo xtask setup installs it)"));
            let elf = object::File::parse(&*data).expect("an ELF file");
            let functions = functions(&elf, &wanted);
            let mut rows: Vec<(&str, u64, MovedArguments)> = families
                .iter()
                .flat_map(|family| family.entries.iter())
                .filter_map(|(symbol, role)| {
                    let function = functions.get(symbol.as_str())?;
                    let site = placement::probe_site(function.code(&data), *role, true);
                    Some((symbol.as_str(), site.distance, site.moved))
                })
                .collect();
            rows.sort();
            rows.dedup();
            for (symbol, distance, moved) in rows {
                println!("{library:26} {symbol:40} +{distance} {moved:?}");
                placed.insert((library, symbol), distance);
            }
        }
        for (library, symbol, distance) in [
            // cmp $0x1000,%rdi; ja: at the ja
            ("libjemalloc.so.2", "malloc", 7),
            // mov %rdi,%rax; ... cmp 0x1b0(%rax),%rcx; jne: at the jne
            ("libjemalloc.so.2", "free", 48),
            ("libjemalloc.so.2", "sdallocx", 10),
            // opens with pushes: emulated at the symbol
            ("libjemalloc.so.2", "calloc", 0),
            ("libtcmalloc_minimal.so.4", "tc_malloc", 10),
            ("libtcmalloc_minimal.so.4", "tc_free", 10),
            // mov %rdi,%rcx; test %rdi,%rdi; je, then rdi is rewritten: at the je
            ("libmimalloc.so.2.0", "mi_free", 6),
            // the arguments copied to rsi and rdx, rdi rewritten: at the tail call's jmp
            ("libmimalloc.so.2.0", "realloc", 20),
            // the count copied to rax, rdi rewritten: at the first je
            ("libmimalloc.so.2.0", "calloc", 18),
            // test %rdi,%rdi; je; push %rbp: at the je (a push is emulated by writing the stack)
            ("libc.so.6", "free", 3),
            ("libc.so.6", "malloc", 0),
        ] {
            assert_eq!(placed.get(&(library, symbol)), Some(&distance), "{symbol} in {library}");
        }
    }

    /// Which allocation functions of Debian's allocator libraries record their fast path's calls
    /// in one trap (see `fast_path`): a table on stdout for review, and the ones that matter.
    #[test]
    fn debian_allocators_fast_paths() {
        let families = families::all();
        let wanted: HashSet<&str> = families.iter().flat_map(|f| f.entries.iter().map(|(s, _)| s.as_str())).collect();
        let mut found = HashSet::new();
        for library in ["libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libmimalloc.so.2.0", "libc.so.6"] {
            let path = format!("/usr/lib/x86_64-linux-gnu/{library}");
            let data =
                std::fs::read(&path).unwrap_or_else(|err| panic!("{path}: {err} (cargo xtask setup installs it)"));
            let elf = object::File::parse(&*data).expect("an ELF file");
            let functions = functions(&elf, &wanted);
            for family in &families {
                for (symbol, role) in &family.entries {
                    let (Some(function), Role::Alloc(func)) = (functions.get(symbol.as_str()), role) else { continue };
                    let points = alloc_points(*func, function.offset, Placement::default(), function.code(&data));
                    if points.iter().any(|point| point.completion.is_some()) && found.insert((library, symbol.as_str()))
                    {
                        let sites: Vec<String> = points
                            .iter()
                            .map(|point| {
                                let (offset, size) = (point.offset - function.offset, point.moved[0]);
                                format!("+{offset:#x} {:?} size in {size:?}", point.completion)
                            })
                            .collect();
                        println!("{library:26} {symbol:40} {}", sites.join(", "));
                    }
                }
            }
        }
        assert!(found.contains(&("libjemalloc.so.2", "malloc")));
        assert!(found.contains(&("libmimalloc.so.2.0", "malloc")));
    }
}
