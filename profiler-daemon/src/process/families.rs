//! Allocator families: the entry points each allocator exports and what each does.
//!
//! A file is probed for a family when it defines the family's mark (jemalloc's `mallocx`,
//! mimalloc's `mi_malloc`, ...). Every entry point of the family that the file defines is then
//! probed, one probe per distinct address (aliases such as tcmalloc's `tc_new` and `operator new`
//! share one). C++'s `operator new`/`delete` are probed only in a file that is an allocator of its
//! own: libstdc++'s call `malloc`, which is probed already.

use profiler_common::AllocFn;
use AllocFn::*;
use Role::{Alloc, Free};

/// What an entry point does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Returns a block (or resizes one), with its arguments laid out as the `AllocFn` says.
    Alloc(AllocFn),
    /// Takes a block as its first argument and frees it (sized or not).
    Free,
}

/// One family: its name for messages, what says a file holds it, and its entry points.
pub struct Family {
    pub name: &'static str,
    /// The symbol whose presence says a file holds the family; without one, any of its entry
    /// points does (a static link keeps only the functions used: a Rust binary on the mimalloc
    /// crate has `mi_malloc_aligned` and `mi_free`, no `mi_malloc`).
    pub mark: Option<String>,
    pub entries: Vec<(String, Role)>,
    /// Probed only beside another family of the same file (C++'s operators).
    pub companion: bool,
}

/// The C library's names, as glibc and musl export them and as allocators that replace the C
/// library's (jemalloc, tcmalloc, mimalloc) export them too.
const STANDARD: &[(&str, Role)] = &[
    ("malloc", Alloc(Malloc)),
    ("calloc", Alloc(Calloc)),
    ("realloc", Alloc(Realloc)),
    ("reallocarray", Alloc(Reallocarray)),
    ("posix_memalign", Alloc(PosixMemalign)),
    ("aligned_alloc", Alloc(AlignedAlloc)),
    ("memalign", Alloc(Memalign)),
    ("valloc", Alloc(Valloc)),
    ("pvalloc", Alloc(Pvalloc)),
    ("free", Free),
    ("cfree", Free),
];

/// jemalloc's own API (5.x): `sdallocx` is what Rust's tikv-jemallocator frees with.
const JEMALLOC: &[(&str, Role)] = &[
    ("mallocx", Alloc(Malloc)),
    ("rallocx", Alloc(Realloc)),
    ("xallocx", Alloc(ResizeInPlace)),
    ("sdallocx", Free),
    ("dallocx", Free),
];

/// Prefixes jemalloc is built with: none (Debian's libjemalloc2), `je_` (`--with-jemalloc-prefix`),
/// `_rjem_` (tikv-jemallocator, statically linked into Rust binaries).
const JEMALLOC_PREFIXES: [&str; 3] = ["", "je_", "_rjem_"];

const TCMALLOC: &[(&str, Role)] = &[
    ("tc_malloc", Alloc(Malloc)),
    ("tc_malloc_skip_new_handler", Alloc(Malloc)),
    ("tc_new", Alloc(Malloc)),
    ("tc_newarray", Alloc(Malloc)),
    ("tc_new_nothrow", Alloc(Malloc)),
    ("tc_newarray_nothrow", Alloc(Malloc)),
    ("tc_new_aligned", Alloc(Malloc)),
    ("tc_newarray_aligned", Alloc(Malloc)),
    ("tc_new_aligned_nothrow", Alloc(Malloc)),
    ("tc_newarray_aligned_nothrow", Alloc(Malloc)),
    ("tc_calloc", Alloc(Calloc)),
    ("tc_realloc", Alloc(Realloc)),
    ("tc_memalign", Alloc(Memalign)),
    ("tc_posix_memalign", Alloc(PosixMemalign)),
    ("tc_valloc", Alloc(Valloc)),
    ("tc_pvalloc", Alloc(Pvalloc)),
    ("tc_free", Free),
    ("tc_cfree", Free),
    ("tc_free_sized", Free),
    ("tc_delete", Free),
    ("tc_delete_sized", Free),
    ("tc_delete_nothrow", Free),
    ("tc_delete_aligned", Free),
    ("tc_delete_sized_aligned", Free),
    ("tc_delete_aligned_nothrow", Free),
    ("tc_deletearray", Free),
    ("tc_deletearray_sized", Free),
    ("tc_deletearray_nothrow", Free),
    ("tc_deletearray_aligned", Free),
    ("tc_deletearray_sized_aligned", Free),
    ("tc_deletearray_aligned_nothrow", Free),
];

/// mimalloc's API (2.x) without the `mi_heap_*` functions, which take a heap first. The Rust
/// `mimalloc` crate links it statically and calls `mi_malloc_aligned`, `mi_zalloc_aligned`,
/// `mi_realloc_aligned` and `mi_free`.
const MIMALLOC: &[(&str, Role)] = &[
    ("mi_malloc", Alloc(Malloc)),
    ("mi_zalloc", Alloc(Malloc)),
    ("mi_malloc_small", Alloc(Malloc)),
    ("mi_zalloc_small", Alloc(Malloc)),
    ("mi_malloc_aligned", Alloc(Malloc)),
    ("mi_malloc_aligned_at", Alloc(Malloc)),
    ("mi_zalloc_aligned", Alloc(Malloc)),
    ("mi_zalloc_aligned_at", Alloc(Malloc)),
    ("mi_new", Alloc(Malloc)),
    ("mi_new_aligned", Alloc(Malloc)),
    ("mi_new_nothrow", Alloc(Malloc)),
    ("mi_new_aligned_nothrow", Alloc(Malloc)),
    ("mi_calloc", Alloc(Calloc)),
    ("mi_mallocn", Alloc(Calloc)),
    ("mi_new_n", Alloc(Calloc)),
    ("mi_calloc_aligned", Alloc(Calloc)),
    ("mi_calloc_aligned_at", Alloc(Calloc)),
    ("mi_realloc", Alloc(Realloc)),
    ("mi_reallocf", Alloc(Realloc)),
    ("mi_rezalloc", Alloc(Realloc)),
    ("mi_new_realloc", Alloc(Realloc)),
    ("mi_realloc_aligned", Alloc(Realloc)),
    ("mi_realloc_aligned_at", Alloc(Realloc)),
    ("mi_rezalloc_aligned", Alloc(Realloc)),
    ("mi_rezalloc_aligned_at", Alloc(Realloc)),
    ("mi_reallocn", Alloc(Reallocarray)),
    ("mi_reallocarray", Alloc(Reallocarray)),
    ("mi_recalloc", Alloc(Reallocarray)),
    ("mi_new_reallocn", Alloc(Reallocarray)),
    ("mi_posix_memalign", Alloc(PosixMemalign)),
    ("mi_memalign", Alloc(Memalign)),
    ("mi_aligned_alloc", Alloc(AlignedAlloc)),
    ("mi_valloc", Alloc(Valloc)),
    ("mi_pvalloc", Alloc(Pvalloc)),
    ("mi_free", Free),
    ("mi_cfree", Free),
    ("mi_free_size", Free),
    ("mi_free_aligned", Free),
    ("mi_free_size_aligned", Free),
];

/// C++'s `operator new` and `operator delete` in every variant (plain, array, nothrow, aligned,
/// sized), by their mangled names. The size (or the block) is always the first argument.
const CXX_OPERATORS: &[(&str, Role)] = &[
    ("_Znwm", Alloc(Malloc)),
    ("_Znam", Alloc(Malloc)),
    ("_ZnwmRKSt9nothrow_t", Alloc(Malloc)),
    ("_ZnamRKSt9nothrow_t", Alloc(Malloc)),
    ("_ZnwmSt11align_val_t", Alloc(Malloc)),
    ("_ZnamSt11align_val_t", Alloc(Malloc)),
    ("_ZnwmSt11align_val_tRKSt9nothrow_t", Alloc(Malloc)),
    ("_ZnamSt11align_val_tRKSt9nothrow_t", Alloc(Malloc)),
    ("_ZdlPv", Free),
    ("_ZdaPv", Free),
    ("_ZdlPvm", Free),
    ("_ZdaPvm", Free),
    ("_ZdlPvRKSt9nothrow_t", Free),
    ("_ZdaPvRKSt9nothrow_t", Free),
    ("_ZdlPvSt11align_val_t", Free),
    ("_ZdaPvSt11align_val_t", Free),
    ("_ZdlPvmSt11align_val_t", Free),
    ("_ZdaPvmSt11align_val_t", Free),
    ("_ZdlPvSt11align_val_tRKSt9nothrow_t", Free),
    ("_ZdaPvSt11align_val_tRKSt9nothrow_t", Free),
];

/// Rust's global allocator when it is a custom one (`#[global_allocator]`): `__rust_alloc` and
/// its kin call these. Probed only where no family above is in the file (a Rust binary on
/// jemalloc or mimalloc is probed in those), and never for Rust's default allocator, which is
/// the C library's malloc.
const RUST_GLOBAL: &[(&str, Role)] = &[
    ("__rg_alloc", Alloc(Malloc)),
    ("__rg_alloc_zeroed", Alloc(Malloc)),
    ("__rg_realloc", Alloc(RustRealloc)),
    ("__rg_dealloc", Free),
];

/// Name of the Rust family, which stands back when another family is in the file.
pub const RUST: &str = "Rust global allocator";

/// Name of the family every C library and every replacement of it exports.
pub const STANDARD_FAMILY: &str = "C library malloc";

impl Family {
    /// Whether a file whose defined symbols `defines` says holds this family.
    pub fn is_in(&self, defines: impl Fn(&str) -> bool) -> bool {
        match &self.mark {
            Some(mark) => defines(mark),
            None => self.entries.iter().any(|(symbol, _)| defines(symbol)),
        }
    }
}

fn family(name: &'static str, prefix: &str, tables: &[&[(&str, Role)]], companion: bool) -> Family {
    Family {
        name,
        mark: None,
        entries: tables.iter().flat_map(|t| t.iter()).map(|(s, role)| (format!("{prefix}{s}"), *role)).collect(),
        companion,
    }
}

/// Every family memprof knows, in the order they are looked for.
pub fn all() -> Vec<Family> {
    // Many libraries define a `free` or `calloc` of their own for their objects; only `malloc`
    // says a file is an allocator.
    let standard = Family { mark: Some("malloc".to_string()), ..family(STANDARD_FAMILY, "", &[STANDARD], false) };
    let mut families = vec![standard];
    for prefix in JEMALLOC_PREFIXES {
        // A prefixed jemalloc exports the standard names with its prefix too.
        let tables: &[&[(&str, Role)]] = if prefix.is_empty() { &[JEMALLOC] } else { &[JEMALLOC, STANDARD] };
        families.push(family("jemalloc", prefix, tables, false));
    }
    families.push(family("tcmalloc", "", &[TCMALLOC], false));
    families.push(family("mimalloc", "", &[MIMALLOC], false));
    families.push(family(RUST, "", &[RUST_GLOBAL], false));
    families.push(family("C++ operator new/delete", "", &[CXX_OPERATORS], true));
    families
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixed_jemalloc_has_the_standard_names_with_its_prefix() {
        let families = all();
        let rjem = families
            .iter()
            .find(|f| f.entries.iter().any(|(s, _)| s == "_rjem_mallocx"))
            .expect("tikv-jemallocator's prefix");
        let names: Vec<&str> = rjem.entries.iter().map(|(s, _)| s.as_str()).collect();
        for wanted in ["_rjem_sdallocx", "_rjem_malloc", "_rjem_free", "_rjem_rallocx"] {
            assert!(names.contains(&wanted), "{wanted} in {names:?}");
        }
    }

    #[test]
    fn every_symbol_has_one_meaning() {
        let mut seen = std::collections::HashMap::new();
        for family in all() {
            for (symbol, role) in family.entries {
                if let Some(other) = seen.insert(symbol.clone(), role) {
                    assert_eq!(other, role, "{symbol}");
                }
            }
        }
    }
}
