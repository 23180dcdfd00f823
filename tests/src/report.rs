//! Reading memprof's JSON reports.

use serde_json::Value;

use crate::time_scale;

/// Outstanding (bytes, allocations) of the stacks whose innermost frame is `function`.
pub fn site(report: &Value, function: &str) -> (u64, u64) {
    let mut total = (0, 0);
    for stack in report["stacks"].as_array().expect("stacks is an array") {
        if stack["frames"][0]["function"] == function {
            total.0 += stack["outstanding_bytes"].as_u64().expect("bytes");
            total.1 += stack["outstanding_allocations"].as_u64().expect("count");
        }
    }
    total
}

/// Outstanding (bytes, allocations) of the stacks that pass through `function` anywhere: for
/// sites reached through library code (C++'s containers, Rust's `Vec`).
pub fn through(report: &Value, function: &str) -> (u64, u64) {
    let mut total = (0, 0);
    for stack in report["stacks"].as_array().expect("stacks is an array") {
        if stack["frames"].as_array().expect("frames").iter().any(|f| f["function"] == function) {
            total.0 += stack["outstanding_bytes"].as_u64().expect("bytes");
            total.1 += stack["outstanding_allocations"].as_u64().expect("count");
        }
    }
    total
}

/// The report's totals as (name, value) for assertions.
pub fn total(report: &Value, name: &str) -> u64 {
    report["totals"][name].as_u64().unwrap_or_else(|| panic!("totals.{name} missing in {report}"))
}

/// Every drop counter must be zero in a clean run. Under emulation (`time_scale` above 1) but
/// `age_generation_missed`: it loses no event, it counts memprof's reads coming more than two
/// intervals apart, and there each read's work takes the emulator's many times longer.
pub fn assert_nothing_dropped(report: &Value) {
    for (reason, count) in report["dropped"].as_object().expect("dropped is an object") {
        if reason == "age_generation_missed" && time_scale() > 1 {
            continue;
        }
        assert_eq!(count, 0, "dropped {reason}: {report}");
    }
}

/// The bytes the `held_before_pages` blind spot of a report in growth mode says; 0 without it.
pub fn held_before_bytes(report: &Value) -> u64 {
    let spots = report["blind_spots"].as_array().expect("blind_spots");
    let held = spots.iter().find(|spot| spot["kind"] == "held_before_pages");
    held.map_or(0, |spot| spot["bytes"].as_u64().expect("the blind spot's bytes"))
}
