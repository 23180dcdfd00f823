//! The unwind-table builder on any bytes: a table, `Ok(None)` or an error, never a panic.
#![no_main]

#[path = "../../profiler-daemon/src/unwind/table.rs"]
mod table;

libfuzzer_sys::fuzz_target!(|elf: &[u8]| {
    if let Ok(Some(mut table)) = table::build(elf) {
        // What the registry does next with a table: mark the entry point's code.
        table.end_at_entry_point(u32::from_le_bytes([elf[24], elf[25], elf[26], elf[27]]));
    }
});
