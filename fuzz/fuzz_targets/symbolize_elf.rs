//! The symbolizer's reading of a mapped file, on any bytes: blazesym's ELF source looked up at
//! file offsets as `symbolize.rs` does, and the build id as `symbolize.rs` reads it. Never a panic.
#![no_main]

use std::{io::Write as _, path::PathBuf};

use blazesym::symbolize::{
    source::{Elf, Source},
    Input, Symbolizer,
};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // blazesym reads files: one per fuzzing process, rewritten for each input, in fuzz/target.
    let path = PathBuf::from(format!("{}/target/symbolize-input.{}", env!("CARGO_MANIFEST_DIR"), std::process::id()));
    std::fs::File::create(&path).and_then(|mut f| f.write_all(data)).expect("writing the input");
    let file = std::fs::File::open(&path).expect("reading the input back");
    let cache = object::ReadCache::new(&file);
    let _ = object::File::parse(&cache).ok().and_then(|elf| object::Object::build_id(&elf).ok().flatten());
    // A fresh symbolizer: its caches are keyed by path, and the path's contents change.
    let symbolizer = Symbolizer::new();
    let source = Source::Elf(Elf::new(&path));
    let len = data.len() as u64;
    for offset in [0, len / 3, len / 2, len.saturating_sub(1), 0x1000, 0x1139] {
        let _ = symbolizer.symbolize_single(&source, Input::FileOffset(offset));
    }
});
