//! C++ objects named by type (`--inspect`): an object of a class with virtual functions starts
//! with a pointer into its class's vtable, the symbol `_ZTV<type>` ("vtable for T") of the file
//! that defines the class (in `.data.rel.ro`, listed in `.symtab`, and in `.dynsym` when
//! exported). Words are matched to those symbols by file offset, so no load bias is needed.
//! memcheck's `multipleinheritance` heuristic knows no symbols: it takes for a vtable what
//! looks like one in memory (`Lookalike`).

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet, HashMap},
};

use object::{Object as _, ObjectSection as _, ObjectSymbol as _};

use super::{
    image::{self, Segment},
    procfs::{self, FileMapping},
};

/// Words of a vtable memcheck looks at, at most.
const LOOKALIKE_WORDS: u64 = 21;

/// memcheck's test for a vtable (`aligned_ptr_above_page0_is_vtable_addr`): an address in a
/// file mapping whose words, from it, hold two pointers into executable file mappings before any
/// word that is neither zero nor such a pointer. Read from the process as it runs: the
/// mappings of its files' code and read-only data do not change.
pub struct Lookalike {
    pid: u32,
    mappings: Vec<FileMapping>,
    known: RefCell<HashMap<u64, bool>>,
}

impl Lookalike {
    pub fn new(pid: u32) -> Self {
        Self { pid, mappings: procfs::file_mappings(pid).unwrap_or_default(), known: RefCell::default() }
    }

    fn mapping(&self, addr: u64) -> Option<&FileMapping> {
        let at = self.mappings.partition_point(|m| m.start <= addr).checked_sub(1)?;
        Some(&self.mappings[at]).filter(|m| addr < m.end)
    }

    pub fn is_vtable(&self, addr: u64) -> bool {
        if let Some(&known) = self.known.borrow().get(&addr) {
            return known;
        }
        let answer = self.looks_like_vtable(addr);
        self.known.borrow_mut().insert(addr, answer);
        answer
    }

    fn looks_like_vtable(&self, addr: u64) -> bool {
        let Some(mapping) = self.mapping(addr) else { return false };
        // memcheck's last word looked at starts 9 bytes before the mapping's end.
        let last = (addr + 8 * (LOOKALIKE_WORDS - 1)).min(mapping.end.saturating_sub(9));
        let Some(len) = (last + 8).checked_sub(addr).filter(|len| *len >= 8) else { return false };
        let mut segment = [Segment { start: addr, bytes: vec![0; len as usize], data: vec![(0, len as usize)] }];
        let (_, unreadable) = image::read_runs(self.pid, &mut segment, &[vec![(0, len as usize)]]);
        if unreadable > 0 {
            // A mapping without read permission: not one memcheck would read.
            return false;
        }
        let mut functions = 0;
        for word in segment[0].bytes.chunks_exact(8).map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes"))) {
            if word == 0 {
                continue;
            }
            if !self.mapping(word).is_some_and(|m| m.executable) {
                return false;
            }
            functions += 1;
            if functions == 2 {
                return true;
            }
        }
        false
    }
}

/// The type whose vtable each of `words` (addresses in `pid`) points into, for those that do.
/// Only the files the words point into are read.
pub fn types(pid: u32, words: &[u64]) -> HashMap<u64, String> {
    // Objects of one class share their first word: each distinct word is looked up once.
    let words: BTreeSet<u64> = words.iter().copied().collect();
    let Ok(mappings) = procfs::file_mappings(pid) else { return HashMap::new() };
    let mut files: BTreeMap<&str, FileWords> = BTreeMap::new();
    for &word in &words {
        let Some(at) = mappings.partition_point(|m| m.start <= word).checked_sub(1) else { continue };
        let mapping = &mappings[at];
        if word < mapping.end {
            let offset = word - mapping.start + mapping.offset;
            let file = files.entry(mapping.path.as_str()).or_insert_with(|| FileWords { mapping, words: Vec::new() });
            file.words.push((word, offset));
        }
    }
    let mut types = HashMap::new();
    for FileWords { mapping, words } in files.values() {
        let vtables = match mapping.open(pid).map(read_vtables) {
            Some(Ok(vtables)) => vtables,
            Some(Err(err)) => {
                tracing::debug!(path = %mapping.path, "no vtables read: {err}");
                continue;
            }
            None => continue,
        };
        for &(word, offset) in words {
            let Some(at) = vtables.partition_point(|v| v.start <= offset).checked_sub(1) else { continue };
            let vtable = &vtables[at];
            if offset < vtable.end {
                types.insert(word, vtable.name.clone());
            }
        }
    }
    types
}

/// The words that point into one file.
struct FileWords<'a> {
    /// One of its mappings, to open it by.
    mapping: &'a FileMapping,
    /// (word, its offset in the file).
    words: Vec<(u64, u64)>,
}

/// One vtable: its bytes' range in the file and the type it is for.
#[derive(Debug, PartialEq, Eq)]
struct Vtable {
    start: u64,
    end: u64,
    name: String,
}

/// The file's vtables, sorted by offset.
fn read_vtables(file: std::fs::File) -> Result<Vec<Vtable>, String> {
    let data = super::elf_bytes::read(&file).map_err(|e| e.to_string())?;
    let elf = object::File::parse(&*data).map_err(|e| e.to_string())?;
    let mut vtables: Vec<Vtable> = elf
        .symbols()
        .chain(elf.dynamic_symbols())
        .filter(|symbol| !symbol.is_undefined() && symbol.size() > 0)
        .filter_map(|symbol| {
            let name = type_name(symbol.name().ok()?)?;
            let start = file_offset(&elf, symbol.address())?;
            Some(Vtable { start, end: start + symbol.size(), name })
        })
        .collect();
    vtables.sort_unstable_by_key(|v| v.start);
    // .symtab and .dynsym both list an exported vtable.
    vtables.dedup_by_key(|v| v.start);
    Ok(vtables)
}

/// `Circle` for `_ZTV6Circle` ("vtable for Circle"); None for any other symbol.
fn type_name(symbol: &str) -> Option<String> {
    // What follows `_ZTV` is the type's encoding, demangled as a name of its own (cpp_demangle
    // writes the vtable itself as `{vtable(Circle)}`).
    let encoding = symbol.strip_prefix("_ZTV")?;
    crate::demangle::cpp(&format!("_Z{encoding}"))
}

/// Where the bytes at virtual address `address` are in the file.
fn file_offset(elf: &object::File, address: u64) -> Option<u64> {
    elf.sections().find_map(|section| {
        let (offset, _) = section.file_range()?;
        (section.address()..section.address() + section.size())
            .contains(&address)
            .then(|| address - section.address() + offset)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vtable_symbols_name_their_type() {
        assert_eq!(type_name("_ZTV6Circle").as_deref(), Some("Circle"));
        assert_eq!(type_name("_ZTVN2ns6WidgetE").as_deref(), Some("ns::Widget"));
        assert_eq!(type_name("_ZTVN12_GLOBAL__N_15LocalE").as_deref(), Some("(anonymous namespace)::Local"));
        assert_eq!(type_name("_ZTI6Circle"), None);
        assert_eq!(type_name("main"), None);
    }
}
