//! Names a traced process chooses (its comm, its functions' symbols) reach every output escaped:
//! no terminal escape is printed raw, folded lines and the SVG stay well-formed; and C names are
//! not demangled as C++ types.

use memprof_tests::{attach, fixture, memprof, site, Waiting};
use serde_json::Value;

/// The fixture's symbol, as memprof prints it: every control character written out.
const HOSTILE: &str = "evil\\x1b]0;owned\\x07\\x1b[2J<a&b>\\x01name";

fn no_raw_control(what: &str, text: &str) {
    let raw = text.chars().find(|c| c.is_control() && *c != '\n');
    assert!(raw.is_none(), "{what} holds a raw control character {raw:?}:\n{text}");
}

#[test]
fn a_hostile_comm_and_symbol_are_escaped_under_attach_and_c_names_stay_c() {
    let mut target = Waiting::start(&fixture("hostile_names"), &["--wait"]);
    let outcome = attach(&mut target, &[]);
    assert!(outcome.status.success(), "{outcome:?}");
    no_raw_control("attach's stderr", &outcome.stderr);
    assert!(outcome.stderr.contains("(\\x1b]0;owned\\x07x)"), "{}", outcome.stderr);
    let report = outcome.final_report();
    assert_eq!(report["comm"], "\\x1b]0;owned\\x07x");
    assert_eq!(site(&report, HOSTILE), (77, 1), "{report}");
    // One-letter C functions: not `wchar_t` and `long long`.
    assert_eq!(site(&report, "w"), (11, 1), "{report}");
    assert_eq!(site(&report, "x"), (13, 1), "{report}");
}

#[test]
fn every_text_format_is_safe_with_a_hostile_symbol() {
    let program = fixture("hostile_names");
    let program = program.to_str().unwrap();
    let table = memprof(&["run", "--format", "table", "--", program]);
    assert!(table.status.success(), "{table:?}");
    no_raw_control("the table", &table.stdout);
    assert!(table.stdout.contains(HOSTILE), "{}", table.stdout);

    let folded = memprof(&["run", "--format", "folded", "--", program]);
    no_raw_control("the folded stacks", &folded.stdout);
    let line = folded.stdout.lines().find(|l| l.contains("evil")).expect("the hostile site's line");
    // main;hostile, with the symbol's own `;` made a `,`.
    assert!(line.ends_with(&format!(";{} 77", HOSTILE.replace(';', ","))), "{line}");

    let svg = std::env::temp_dir().join(format!("memprof-names-{}.svg", std::process::id()));
    let drawn = memprof(&["run", "--format", "flamegraph", "--output", svg.to_str().unwrap(), "--", program]);
    assert!(drawn.status.success(), "{drawn:?}");
    let text = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).unwrap();
    let options = roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() };
    let document = roxmltree::Document::parse_with_options(&text, options).expect("the SVG is well-formed XML");
    assert!(document.descendants().any(|n| n.text().is_some_and(|t| t.contains("<a&b>"))), "{text}");
}

/// `diff` prints frames from files anyone may have written: a raw escape in a report is escaped.
#[test]
fn diff_escapes_the_names_in_the_reports_it_reads() {
    let outcome = memprof(&["run", "--json", "--", fixture("hostile_names").to_str().unwrap()]);
    let report: Value = outcome.final_report();
    let forged = serde_json::to_string(&report).unwrap().replace("\\\\x1b", "\\u001b");
    assert!(forged.contains("\\u001b"), "the forged report holds a raw escape");
    let dir = std::env::temp_dir();
    let (old, new) = (
        dir.join(format!("memprof-names-{}-old.json", std::process::id())),
        dir.join(format!("memprof-names-{}-new.json", std::process::id())),
    );
    let mut empty = report.clone();
    empty["stacks"] = Value::Array(Vec::new());
    std::fs::write(&old, serde_json::to_string(&empty).unwrap()).unwrap();
    std::fs::write(&new, forged).unwrap();
    let diff = memprof(&["diff", old.to_str().unwrap(), new.to_str().unwrap()]);
    std::fs::remove_file(&old).unwrap();
    std::fs::remove_file(&new).unwrap();
    assert!(diff.status.success(), "{diff:?}");
    no_raw_control("diff's table", &diff.stdout);
    assert!(diff.stdout.contains(HOSTILE), "{}", diff.stdout);
}
