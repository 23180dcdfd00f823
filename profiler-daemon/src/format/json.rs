//! One JSON object per report (docs: reference/json-schema.md#the-json-schema).

use std::io;

use crate::heap::report::Report;

/// Writes the report and a line break to `out`, token by token: a report of tens of thousands of
/// stacks is never held whole in memory, written out.
pub fn write(report: &Report, out: &mut dyn io::Write) -> io::Result<()> {
    serde_json::to_writer(&mut *out, report)?;
    out.write_all(b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples;

    #[test]
    fn json_follows_the_documented_schema() {
        let report = samples::report();
        let mut written = Vec::new();
        write(&report, &mut written).unwrap();
        assert_eq!(written.last(), Some(&b'\n'));
        let value: serde_json::Value = serde_json::from_slice(&written).unwrap();
        assert_eq!(value["final"], true);
        assert_eq!(value["totals"]["unknown_frees"], 0);
        assert_eq!(value["dropped"]["live_map_full"], 0);
        assert_eq!(value["stacks"][0]["frames"][0]["function"], "leak_here");
        assert_eq!(value["stacks"][0]["frames"][0]["inlined"], false);
        assert_eq!(value["stacks"][0]["truncated"], false);
        assert!(value["stacks"][0].get("via").is_none(), "no wrapper was folded");
    }
}
