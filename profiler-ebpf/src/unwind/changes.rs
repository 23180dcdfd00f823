//! What tells a walk, and the daemon, that a process's code may have moved: its execs, its
//! dynamic linker's changes (with the linker's list of objects) and its mappings of files' code.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, bpf_probe_read_user_str_bytes},
    macros::map,
    maps::HashMap,
};
use profiler_common::{DropReason, LinkMapEvent, LINK_MAP_OBJECTS};

use super::UNWIND_EVENTS;
use crate::shared::{add, count_drop, NO_PREALLOC};

/// Per traced process, how many times it may have mapped code since it was traced: its execs,
/// its dynamic linker's changes (`on_mappings_changed`) and, while memprof traces mappings, its
/// mappings of files' code. A walk stopped outside the process's mapping list waits for
/// a newer list (`defer`) only while the list is older than the latest change (see
/// `ProcMappings::code_changes_seen`); else the frame is in no file (code built at run time, or a
/// frame pointer that pointed nowhere) and the walk ends there, cut, without a copy of the stack.
#[map]
static CODE_CHANGES: HashMap<u32, u64> = HashMap::with_max_entries(4_096, NO_PREALLOC);

/// Process `tgid` exec'd or mapped a file's code: its mapping list may lack it.
pub fn code_changed(tgid: u32) {
    // Inserted at 0 first, so that an insert by the daemon meanwhile (at 0) loses no change.
    let _ = CODE_CHANGES.insert(tgid, 0, BPF_NOEXIST as u64);
    // Without an entry (the map is full), no list of the process is taken as current.
    if let Some(changes) = CODE_CHANGES.get_ptr_mut(tgid) {
        // SAFETY: a map value pointer stays valid while the program runs.
        add(unsafe { &mut *changes }, 1);
    }
}

/// Whether the mapping list of process `tgid` whose `code_changes_seen` is `seen` holds every
/// file it maps: no change since the daemon read the mappings the list was built from. Asked of
/// the list the walk searched, not of the one in the map now: the daemon may have written a
/// newer one, with the file the walk missed, since.
pub(super) fn list_was_current(tgid: u32, seen: u64) -> bool {
    // SAFETY: a field read at once from a map value.
    seen != NO_LIST && unsafe { CODE_CHANGES.get(tgid) }.is_some_and(|&changes| changes == seen)
}

/// `Walk::list_seen` before the walk has searched a list, or when the process has none.
pub(super) const NO_LIST: u64 = u64::MAX;

/// At the dynamic linker's `_dl_debug_state`. `r_debug` is the address of its `_r_debug` (0:
/// unknown): when the change is complete, the linker's list of objects goes to the daemon with
/// the event, so that it knows the process's mappings even if the process is gone before it
/// reads `/proc`; else just the process's id.
pub fn on_mappings_changed(r_debug: u64) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // Before a library's mapping and after it, both before its code runs.
    code_changed(tgid);
    if r_debug != 0 && send_link_map(tgid, r_debug) {
        return;
    }
    if UNWIND_EVENTS.output::<u32>(&tgid, 0).is_err() {
        // The daemon finds new mappings at its next refresh anyway.
        count_drop(DropReason::MappingEventLost);
    }
}

/// `struct r_debug`: `r_map` at 8, `r_state` at 24; `struct link_map`: `l_addr` at 0, `l_name`
/// at 8, `l_next` at 24.
const R_MAP: u64 = 8;
const R_STATE: u64 = 24;
const L_NAME: u64 = 8;
const L_NEXT: u64 = 24;
/// `r_state` when the list is consistent (not in the middle of an add or a delete).
const RT_CONSISTENT: i32 = 0;

/// Sends the linker's list of objects; false when it is not consistent now or cannot be read.
fn send_link_map(tgid: u32, r_debug: u64) -> bool {
    let state = unsafe { bpf_probe_read_user((r_debug + R_STATE) as *const i32) };
    if state != Ok(RT_CONSISTENT) {
        return false;
    }
    let Ok(mut object) = (unsafe { bpf_probe_read_user((r_debug + R_MAP) as *const u64) }) else { return false };
    let Some(mut entry) = UNWIND_EVENTS.reserve::<LinkMapEvent>(0) else {
        count_drop(DropReason::MappingEventLost);
        return true;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: the reserved record is ours until submitted.
    unsafe {
        (*event).tgid = tgid;
        (*event).count = 0;
        (*event).time_ns = bpf_ktime_get_ns();
        for index in 0..LINK_MAP_OBJECTS {
            if object == 0 {
                break;
            }
            let slot = &mut (*event).objects[index];
            slot.base = bpf_probe_read_user(object as *const u64).unwrap_or(0);
            slot.name[0] = 0;
            if let Ok(name) = bpf_probe_read_user((object + L_NAME) as *const u64) {
                let _ = bpf_probe_read_user_str_bytes(name as *const u8, &mut slot.name);
            }
            (*event).count = index as u32 + 1;
            object = bpf_probe_read_user((object + L_NEXT) as *const u64).unwrap_or(0);
        }
    }
    entry.submit(0);
    true
}
