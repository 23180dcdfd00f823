//! One JSON object per report (docs: reference/json-schema.md#the-json-schema).

use crate::heap::report::Report;

pub fn render(report: &Report) -> String {
    serde_json::to_string(report).expect("a report always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples;

    #[test]
    fn json_follows_the_documented_schema() {
        let report = samples::report();
        let value: serde_json::Value = serde_json::from_str(&render(&report)).unwrap();
        assert_eq!(value["final"], true);
        assert_eq!(value["totals"]["unknown_frees"], 0);
        assert_eq!(value["dropped"]["live_map_full"], 0);
        assert_eq!(value["stacks"][0]["frames"][0]["function"], "leak_here");
        assert_eq!(value["stacks"][0]["frames"][0]["inlined"], false);
        assert_eq!(value["stacks"][0]["truncated"], false);
        assert!(value["stacks"][0].get("via").is_none(), "no wrapper was folded");
    }
}
