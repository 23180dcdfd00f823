//! The names a file's symbol table gives the functions a compiler cloned: GCC's `fill.isra.0`,
//! `.constprop.0`, `.part.0` and `.cold`, LLVM's `.llvm.N`. The debug information names a clone
//! as the function it came from (`fill`); valgrind names it as the symbol table does, and so
//! must the suppressions memprof writes for it.

use std::{collections::HashMap, fs::File};

use object::{Object as _, ObjectSymbol as _, SymbolKind};

/// A file's function symbols whose names carry a suffix after a dot, by address.
pub struct Clones(HashMap<u64, String>);

impl Clones {
    /// Read from the file's symbol tables; none when it is not ELF.
    pub fn read(file: &File) -> Self {
        let cache = object::ReadCache::new(file);
        let Ok(elf) = object::File::parse(&cache) else { return Self(HashMap::new()) };
        let clones = elf
            .symbols()
            .chain(elf.dynamic_symbols())
            .filter(|symbol| symbol.kind() == SymbolKind::Text)
            .filter_map(|symbol| {
                let name = symbol.name().ok()?;
                name.contains('.').then(|| (symbol.address(), name.to_string()))
            })
            .collect();
        Self(clones)
    }

    /// The symbol table's name for the function at `address`, when it is `origin` (as the debug
    /// information names it) with a suffix.
    pub fn of(&self, address: u64, origin: &str) -> Option<&str> {
        let name = self.0.get(&address)?;
        name.strip_prefix(origin)?.starts_with('.').then_some(name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_is_named_only_for_its_origin() {
        let clones =
            Clones(HashMap::from([(0x11d0, "fill.isra.0".to_string()), (0x1200, "_Z4growi.constprop.0".into())]));
        assert_eq!(clones.of(0x11d0, "fill"), Some("fill.isra.0"));
        assert_eq!(clones.of(0x1200, "_Z4growi"), Some("_Z4growi.constprop.0"));
        assert_eq!(clones.of(0x11d0, "fil"), None, "a longer name is not a clone of a shorter one");
        assert_eq!(clones.of(0x11d0, "other"), None);
        assert_eq!(clones.of(0x1300, "fill"), None);
    }
}
