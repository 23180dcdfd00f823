//! Allocation wrappers: functions whose job is to call the allocator (redis's `zmalloc`, nginx's
//! `ngx_palloc`, postgres's `palloc`, glib's `g_malloc`, `xmalloc`, perl's `Perl_safesysmalloc`,
//! the JVM's `os::malloc`, C++'s `operator new`, Rust's `__rust_alloc`). Their frames at the leaf
//! end of a stack are folded into the allocator: the stack then starts at the code that asked for
//! memory, its site, on every allocator (C++'s
//! `operator new` is probed itself where tcmalloc or mimalloc provide it, and is a frame above
//! glibc's `malloc`), and names the wrappers it came through (`via`).
//!
//! Folding only relabels the site: a stack keeps the id of its whole walk (`report::stack_hash`),
//! so two stacks that were apart stay apart. Only the leaf end is folded, and a stack of nothing
//! but wrappers (a walk cut short) keeps its frames. Names are matched whole: a list of known
//! wrappers, not a guess from a stack's shape, since any function that calls `malloc` and
//! nothing else looks like a wrapper by shape, and its callers are not always the site.

use clap::Args;

use crate::symbolize::Frames;

/// `--wrapper`, `--no-auto-wrappers`: for `attach`, `run` and the daemon.
#[derive(Debug, Args, Clone, Default, PartialEq, Eq)]
pub struct WrapperArgs {
    /// Fold this function into the allocator: a stack that calls the allocator through it starts
    /// at its caller. Repeatable; matches the whole function name (C++: before its parameters).
    #[arg(long = "wrapper", value_name = "NAME", value_parser = wrapper_name)]
    pub wrappers: Vec<String>,
    /// Fold only the --wrapper functions, none of the wrappers memprof knows (zmalloc, palloc,
    /// g_malloc, operator new, ...): stacks start at the function that called the allocator.
    #[arg(long)]
    pub no_auto_wrappers: bool,
}

pub fn wrapper_name(value: &str) -> Result<String, String> {
    if value.is_empty() || value.chars().any(|c| c.is_whitespace() && c != ' ') || value.trim() != value {
        return Err(format!("`{value}` is not a function name; give one such as zmalloc"));
    }
    Ok(value.to_string())
}

/// Which functions are folded into the allocator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wrappers {
    auto: bool,
    names: Vec<String>,
}

impl Default for Wrappers {
    fn default() -> Self {
        Self { auto: true, names: Vec::new() }
    }
}

/// The language runtimes' allocation entry points, matched by prefix: `operator new(unsigned
/// long)`, `operator new[](...)`, Rust's `__rust_alloc`, Go's `runtime.makeslice` and the like.
const RUNTIME_PREFIXES: [&str; 24] = [
    "operator new",
    "__rust_alloc",
    "__rust_realloc",
    "__rustc::__rust_",
    "__rdl_alloc",
    "__rdl_realloc",
    "__rg_alloc",
    // Rust's `alloc` crate: `Box::new`, `Vec`'s growth, `str::repeat`, ... (inlined at the site).
    "alloc::",
    "<alloc::",
    "<std::alloc::System as core::alloc::global::GlobalAlloc>",
    // Go's runtime, where its sampler records a sample (`--usdt`), and the functions the
    // compiler calls to allocate (`new`, `make`, `append`, string building).
    "runtime.mProf_Malloc",
    "runtime.profilealloc",
    "runtime.mallocgc",
    "runtime.newobject",
    "runtime.newarray",
    "runtime.makeslice",
    "runtime.growslice",
    "runtime.makemap",
    "runtime.makechan",
    "runtime.rawstring",
    "runtime.rawbyteslice",
    "runtime.rawruneslice",
    "runtime.concatstring",
    "runtime.slicebytetostring",
];

/// Libraries' and programs' own allocation functions, matched whole.
const KNOWN: [&str; 129] = [
    // redis (zmalloc.c), and the same in keydb and valkey.
    "zmalloc",
    "zcalloc",
    "zrealloc",
    "zstrdup",
    "zmalloc_usable",
    "zcalloc_usable",
    "zrealloc_usable",
    "zcalloc_num",
    "zmalloc_no_tcache",
    "ztrymalloc",
    "ztrycalloc",
    "ztryrealloc",
    "ztrymalloc_usable",
    "ztrycalloc_usable",
    "ztryrealloc_usable",
    "ztrymalloc_usable_internal",
    "ztrycalloc_usable_internal",
    "ztryrealloc_usable_internal",
    // nginx (ngx_alloc.c, ngx_palloc.c).
    "ngx_alloc",
    "ngx_calloc",
    "ngx_memalign",
    "ngx_palloc",
    "ngx_pnalloc",
    "ngx_pcalloc",
    "ngx_pmemalign",
    "ngx_palloc_small",
    "ngx_palloc_block",
    "ngx_palloc_large",
    // postgres (mcxt.c and its memory contexts): malloc is called for a context's new block.
    "palloc",
    "palloc0",
    "palloc_extended",
    "palloc_aligned",
    "palloc_mul",
    "palloc0_mul",
    "palloc_mul_extended",
    "repalloc",
    "repalloc0",
    "repalloc_extended",
    "repalloc_huge",
    "repalloc_mul",
    "repalloc_mul_extended",
    "SPI_palloc",
    "SPI_repalloc",
    "pstrdup",
    "pnstrdup",
    "MemoryContextAlloc",
    "MemoryContextAllocZero",
    "MemoryContextAllocExtended",
    "MemoryContextAllocHuge",
    "MemoryContextAllocAligned",
    "MemoryContextAllocZeroAligned",
    "MemoryContextStrdup",
    "AllocSetAlloc",
    "AllocSetAllocLarge",
    "AllocSetAllocFromNewBlock",
    "AllocSetRealloc",
    "GenerationAlloc",
    "GenerationRealloc",
    "SlabAlloc",
    "BumpAlloc",
    // A context's creation allocates its header and first block: the site is who created it.
    "AllocSetContextCreateInternal",
    "GenerationContextCreate",
    "SlabContextCreate",
    "BumpContextCreate",
    // glib (gmem.c; g_new and g_new0 are macros over the _n functions).
    "g_malloc",
    "g_malloc0",
    "g_realloc",
    "g_try_malloc",
    "g_try_malloc0",
    "g_try_realloc",
    "g_malloc_n",
    "g_malloc0_n",
    "g_realloc_n",
    "g_try_malloc_n",
    "g_try_malloc0_n",
    "g_try_realloc_n",
    "g_strdup",
    "g_strndup",
    "g_memdup",
    "g_memdup2",
    // gnulib's and git's xalloc.
    "xmalloc",
    "xcalloc",
    "xrealloc",
    "xstrdup",
    "xstrndup",
    "xzalloc",
    "xmemdup",
    "xnmalloc",
    "xreallocarray",
    "xnrealloc",
    // OpenSSL (crypto/mem.c, crypto/o_str.c): in nginx, postgres, node, python and curl.
    "CRYPTO_malloc",
    "CRYPTO_zalloc",
    "CRYPTO_realloc",
    "CRYPTO_clear_realloc",
    "CRYPTO_strdup",
    "CRYPTO_strndup",
    "CRYPTO_memdup",
    // CPython (Objects/obmalloc.c): its raw, memory and object allocators, pymalloc under the
    // last two (a block above 512 bytes goes on to malloc from them).
    "PyMem_RawMalloc",
    "PyMem_RawCalloc",
    "PyMem_RawRealloc",
    "_PyMem_RawMalloc",
    "_PyMem_RawCalloc",
    "_PyMem_RawRealloc",
    "PyMem_Malloc",
    "PyMem_Calloc",
    "PyMem_Realloc",
    "PyObject_Malloc",
    "PyObject_Calloc",
    "PyObject_Realloc",
    "_PyObject_Malloc",
    "_PyObject_Calloc",
    "_PyObject_Realloc",
    "pymalloc_alloc",
    "pymalloc_realloc",
    // perl (util.c, its PerlMem_* macros): every allocation of the interpreter.
    "Perl_safesysmalloc",
    "Perl_safesyscalloc",
    "Perl_safesysrealloc",
    "Perl_savepv",
    "Perl_savepvn",
    "Perl_savesharedpv",
    "Perl_savesharedpvn",
    // The JVM (HotSpot's os.cpp, allocation.cpp, arena.cpp): its own C heap, under every
    // NEW_C_HEAP_ARRAY and CHeapObj, and its arenas' chunks.
    "os::malloc",
    "os::realloc",
    "os::strdup",
    "os::strdup_check_oom",
    "AllocateHeap",
    "ReallocateHeap",
    "ChunkPool::allocate",
    "Arena::grow",
];

impl Wrappers {
    pub fn new(args: &WrapperArgs) -> Self {
        Self { auto: !args.no_auto_wrappers, names: args.wrappers.clone() }
    }

    /// The daemon's: the config file's `wrappers` and `auto_wrappers` with the flags over them
    /// (the flags' names when any, else the file's; automatic unless either turns it off), each
    /// name checked as the flag checks it.
    pub fn merged(args: &WrapperArgs, names: Option<Vec<String>>, auto: Option<bool>) -> Result<Self, String> {
        let names = if args.wrappers.is_empty() { names.unwrap_or_default() } else { args.wrappers.clone() };
        names.iter().try_for_each(|name| wrapper_name(name).map(drop))?;
        Ok(Self { auto: !args.no_auto_wrappers && auto.unwrap_or(true), names })
    }

    pub fn is_wrapper(&self, function: &str) -> bool {
        self.names.iter().any(|name| names(function, name))
            || (self.auto
                && (KNOWN.iter().any(|name| names(function, name))
                    || RUNTIME_PREFIXES.iter().any(|p| function.starts_with(p))
                    || is_global_allocator(function)))
    }

    /// `frames` (innermost first) without the wrappers at their leaf end, and those wrappers'
    /// functions, innermost first, each once in a row. A frame without a name between them goes
    /// too: a function a wrapper called is the allocation's own machinery, named or not (the
    /// static `AllocSetAlloc` under `palloc` in Debian's stripped postgres). It is listed by its
    /// module's whole path and its offset, as a suppression's `obj:` line names it.
    /// The shared list is kept when nothing is folded.
    pub fn fold(&self, frames: Frames) -> (Frames, Vec<String>) {
        let leaf_end = frames.iter().take_while(|f| f.is_unnamed() || self.is_wrapper(&f.function)).count();
        let wrapped = frames[..leaf_end].iter().rposition(|f| self.is_wrapper(&f.function)).map_or(0, |i| i + 1);
        if wrapped == 0 || wrapped == frames.len() {
            return (frames, Vec::new());
        }
        let mut via: Vec<String> = Vec::new();
        for frame in &frames[..wrapped] {
            let name = match frame.function.rsplit_once("+0x") {
                Some((_, offset)) if frame.is_unnamed() => format!("{}+0x{offset}", frame.module),
                _ => frame.function.clone(),
            };
            if via.last() != Some(&name) {
                via.push(name);
            }
        }
        (frames[wrapped..].into(), via)
    }
}

/// `function` is `name`, or `name(...)` as C++ names are demangled.
fn names(function: &str, name: &str) -> bool {
    function.strip_prefix(name).is_some_and(|rest| rest.is_empty() || rest.starts_with('('))
}

/// A global allocator's own functions (`<tikv_jemallocator::Jemalloc as GlobalAlloc>::alloc`,
/// `<mimalloc::MiMalloc as GlobalAlloc>::realloc`).
fn is_global_allocator(function: &str) -> bool {
    function.starts_with('<') && function.contains(" as core::alloc::global::GlobalAlloc>::")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{heap::report::samples::frame, symbolize::Frame};

    fn functions(frames: &[Frame]) -> Vec<&str> {
        frames.iter().map(|f| f.function.as_str()).collect()
    }

    #[test]
    fn the_leaf_end_wrappers_are_folded_and_named() {
        let stack = || -> Frames {
            [
                frame("ztrymalloc_usable_internal", None, None),
                frame("ztrymalloc_usable_internal", None, None),
                frame("zmalloc", None, None),
                frame("createObject", Some("object.c"), Some(40)),
                frame("zmalloc", None, None),
                frame("main", None, None),
            ]
            .into()
        };
        let (frames, via) = Wrappers::default().fold(stack());
        assert_eq!(functions(&frames), ["createObject", "zmalloc", "main"], "only the leaf end");
        assert_eq!(via, ["ztrymalloc_usable_internal", "zmalloc"]);
        let off = Wrappers::new(&WrapperArgs { no_auto_wrappers: true, ..WrapperArgs::default() });
        assert_eq!(off.fold(stack()).0.len(), 6);
        let only = WrapperArgs { wrappers: vec!["ztrymalloc_usable_internal".into()], no_auto_wrappers: true };
        assert_eq!(functions(&Wrappers::new(&only).fold(stack()).0)[0], "zmalloc");
    }

    /// Debian's postgres has no symbol for the static `AllocSetAlloc` that `palloc` calls, nor
    /// for some of its callers: the frames a wrapper called go with it, its callers stay.
    #[test]
    fn frames_without_a_name_that_a_wrapper_called_are_folded_with_it() {
        let unnamed = |offset: &str| {
            let mut f = frame(&format!("postgres+{offset}"), None, None);
            f.module = "/usr/lib/postgresql/15/bin/postgres".into();
            f
        };
        let stack: Frames = [
            unnamed("0x5c7860"),
            frame("palloc", None, None),
            unnamed("0x362167"),
            frame("list_copy_deep", None, None),
        ]
        .into();
        let (frames, via) = Wrappers::default().fold(stack);
        assert_eq!(functions(&frames), ["postgres+0x362167", "list_copy_deep"]);
        assert_eq!(via, ["/usr/lib/postgresql/15/bin/postgres+0x5c7860", "palloc"]);
        // No wrapper below it: a frame without a name may be the program's own, and stays.
        let alone: Frames = [unnamed("0xfb51c"), frame("PyByteArray_Resize", None, None)].into();
        assert_eq!(Wrappers::default().fold(alone).0.len(), 2);
    }

    #[test]
    fn names_match_whole_or_before_cxx_parameters() {
        let wrappers = Wrappers::new(&WrapperArgs { wrappers: vec!["Pool::get".into()], no_auto_wrappers: true });
        assert!(wrappers.is_wrapper("Pool::get"));
        assert!(wrappers.is_wrapper("Pool::get(unsigned long)"));
        assert!(!wrappers.is_wrapper("Pool::get_more"));
        assert!(!Wrappers::default().is_wrapper("palloc_stats"));
        assert!(Wrappers::default().is_wrapper("os::malloc(unsigned long, MEMFLAGS, NativeCallStack const&)"));
        assert!(Wrappers::default().is_wrapper("Perl_safesysmalloc"));
        assert!(Wrappers::default().is_wrapper("CRYPTO_zalloc"));
        assert!(Wrappers::default().is_wrapper("operator new[](unsigned long)"));
        assert!(Wrappers::default().is_wrapper("<mimalloc::MiMalloc as core::alloc::global::GlobalAlloc>::alloc"));
        assert!(!wrappers.is_wrapper("operator new(unsigned long)"), "automatic detection off");
    }

    /// A python with its symbols (pyenv's 3.11, by hand): a bytearray's block, 10001 bytes, is
    /// malloc'd by pymalloc's `_PyObject_Malloc`, inlined into itself; the site is the caller.
    #[test]
    fn cpython_s_allocators_fold_into_the_object_that_asked() {
        let stack: Frames = [
            frame("_PyObject_Malloc", Some("obmalloc.c"), Some(2003)),
            frame("_PyObject_Malloc", Some("obmalloc.c"), Some(1996)),
            frame("PyByteArray_Resize", Some("bytearrayobject.c"), Some(233)),
            frame("bytearray___init__", Some("bytearrayobject.c.h"), Some(68)),
        ]
        .into();
        let (frames, via) = Wrappers::default().fold(stack);
        assert_eq!(functions(&frames), ["PyByteArray_Resize", "bytearray___init__"]);
        assert_eq!(via, ["_PyObject_Malloc"]);
        assert!(Wrappers::default().is_wrapper("PyMem_RawMalloc"));
        assert!(!Wrappers::default().is_wrapper("PyObject_MallocStats"));
    }

    #[test]
    fn a_stack_of_wrappers_only_keeps_its_frames() {
        let (frames, via) = Wrappers::default().fold([frame("operator new(unsigned long)", None, None)].into());
        assert_eq!((frames.len(), via.len()), (1, 0));
        assert_eq!(Wrappers::default().fold(Frames::default()).0.len(), 0);
    }

    #[test]
    fn names_with_other_white_space_than_spaces_are_refused() {
        assert!(wrapper_name("").is_err());
        assert!(wrapper_name(" zmalloc").is_err());
        assert!(wrapper_name("z\nmalloc").is_err());
        assert_eq!(wrapper_name("operator new").unwrap(), "operator new");
    }
}
