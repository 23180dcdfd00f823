//! A process the daemon stops tracing call by call: one above `max_rate`, or the one crowding
//! the others out of a shared table (`crowding`). It is moved to growth mode, whose cost follows
//! its new pages, not its calls; except where growth mode would slow every other process's
//! system calls (a kernel that refuses `fexit` programs, a process without wrappers of its
//! mapping calls that memprof can probe, and no `mappings`): there a busy process is sampled
//! instead, and a crowding one left as it is.

use std::num::NonZeroU32;

use tracing::warn;

use super::{crowding::Crowder, Tracer};
use crate::{
    heap::leak::LeakTracker,
    heap::sampling::{RateGuard, Sampling, Switch},
};

/// Why a process leaves exact tracing.
pub(super) enum ToPages {
    AboveMaxRate(Switch),
    Crowding(Crowder),
}

impl Tracer {
    /// Moves `pid` to growth mode, or, where that would make every other process pay or fails,
    /// does what spares them (`stay_off_pages`).
    pub(super) fn move_out(&mut self, pid: u32, why: ToPages) {
        let because = match self.loaded.pages_spare_system_calls(pid) {
            Ok(true) => match self.switch_to_pages(pid, &why) {
                Ok(()) => return,
                Err(err) => format!("switching to growth mode failed: {err:#}"),
            },
            Ok(false) => "growth mode would slow every system call on this host: its kernel refuses fexit \
                          programs and the process maps memory through no wrapper memprof can probe (docs: \
                          reference/limits.md#mappings); --mappings (mappings = true) has it moved all the same"
                .to_string(),
            Err(err) => format!("growth mode cannot be loaded: {err:#}"),
        };
        self.stay_off_pages(pid, &why, &because);
    }

    /// Traces `pid` by the pages it touches from now on, not its calls: the always-on mode,
    /// whose cost follows its new pages. What its calls recorded goes with them.
    fn switch_to_pages(&mut self, pid: u32, why: &ToPages) -> anyhow::Result<()> {
        // Before its calls' stacks go with them.
        self.collect_double_frees();
        let Some(target) = self.targets.get_mut(&pid) else { return Ok(()) };
        let nonzero = NonZeroU32::new(pid).expect("a target's pid is positive");
        self.loaded.switch_to_pages(nonzero, &mut target.attachment)?;
        target.probed_files.clear();
        target.blind_spots.pages_from_now(pid);
        target.leaks = LeakTracker::new(self.config.leak);
        target.known_stacks.forget();
        let comm = &target.comm;
        // What it holds already, growth mode cannot see into.
        let held = target.blind_spots.held_before_pages().map(|spot| format!("; not seen: {}", spot.what));
        let held = held.unwrap_or_default();
        match why {
            ToPages::AboveMaxRate(switch) => warn!(
                pid,
                comm,
                calls_per_second = switch.calls_per_second,
                "above max_rate: traced by the pages it touches from now on (growth mode){held}"
            ),
            ToPages::Crowding(crowder) => crowder.say(
                comm,
                &format!(
                    "traced by the pages it touches from now on (growth mode); a larger {} keeps it traced by its \
                     calls{held}",
                    crowder.table.setting()
                ),
            ),
        }
        Ok(())
    }

    /// `pid` left off growth mode, `because`: sampled when it is too busy, left traced by its
    /// calls when it crowds a table (sampling would not empty the table of what it holds). Said
    /// once: the daemon does not try again.
    fn stay_off_pages(&mut self, pid: u32, why: &ToPages, because: &str) {
        let Some(target) = self.targets.get_mut(&pid) else { return };
        target.pages_refused = true;
        let comm = &target.comm;
        match why {
            ToPages::AboveMaxRate(switch) => match self.loaded.sample(pid, switch.sample_bytes) {
                Ok(()) => warn!(
                    pid,
                    comm,
                    calls_per_second = switch.calls_per_second,
                    "above max_rate: sampled one in every {} bytes from now on, not moved to growth mode: {because}",
                    switch.sample_bytes
                ),
                Err(err) => {
                    warn!(pid, comm, "above max_rate: sampling it: {err:#}; it stays traced by its every call");
                    // Not tried again at each interval: its next program (an exec) is.
                    target.rate_guard = RateGuard::new(Sampling::default());
                }
            },
            ToPages::Crowding(crowder) => crowder.say(
                comm,
                &format!(
                    "left traced by its calls, not moved to growth mode: {because}; a larger {} makes room",
                    crowder.table.setting()
                ),
            ),
        }
    }
}
