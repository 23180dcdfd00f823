//! The unwind-table builder on any bytes: a table, `Ok(None)` or an error, never a panic.
#![no_main]

#[path = "../../profiler-daemon/src/unwind/table.rs"]
mod table;

/// A Go program's function table, which `table.rs` reads and the symbolizer names frames by: the
/// table on any bytes too. The daemon's reading of it from a file is left out.
#[path = "../../profiler-daemon/src/process/go_functions.rs"]
#[allow(dead_code)]
mod go_functions;
mod process {
    pub(crate) use super::go_functions;
}

libfuzzer_sys::fuzz_target!(|elf: &[u8]| {
    if let Ok(Some(mut table)) = table::build(elf) {
        // What the registry does next with a table: mark the entry point's code.
        table.end_at_entry_point(u32::from_le_bytes([elf[24], elf[25], elf[26], elf[27]]));
    }
    if let Some(functions) = go_functions::GoFunctions::read(elf, Some(0x401000)) {
        for range in functions.ranges().take(64) {
            let _ = functions.frame(elf, range.start + (range.end - range.start) / 2);
        }
    }
});
