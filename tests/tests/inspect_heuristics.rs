//! `--inspect` with memcheck's leak-check heuristics: `heuristics.cpp` holds a block of each shape
//! memcheck's heuristics accept only through a pointer into its interior, and a lost block that
//! points into one. Each site's classes equal memcheck's (valgrind 3.19, run by the test where
//! installed, at the fixture's exit: its blocks do not change after "set"), with the heuristics
//! (the default, `all`) and without (`none`); the heuristic that held each block is named per site,
//! and the totals per heuristic are memcheck's "reachable via heuristic" lines.
//!
//! memcheck's loss records, trimmed to the fixture's sites:
//!
//! ```text
//!                       --leak-check-heuristics=all     --leak-check-heuristics=none
//! second_base       32 B in 1  still reachable          possibly lost
//! cow_string        40 B in 1  still reachable          possibly lost
//! length_prefixed   48 B in 1  still reachable          possibly lost
//! held_by_lost      48 B in 1  indirectly lost          indirectly lost
//! new_array         56 B in 1  still reachable          possibly lost
//! lost_holder       64 (16 direct, 48 indirect) B in 1 definitely lost, either way
//! array_payload     72 B in 3  still reachable          possibly lost
//!      of which reachable via heuristic: stdstring 40 B in 1, length64 48 B in 1,
//!      newarray 56 B in 1, multipleinheritance 32 B in 1
//! ```

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    process::{Command, Stdio},
};

use memprof_tests::{
    attach, fixture_cpp,
    inspection::{memcheck, reach, reachability},
    memprof_bin, Daemon, Outcome, Waiting,
};
use serde_json::{json, Value};

const SITES: [&str; 7] =
    ["cow_string", "length_prefixed", "new_array", "array_payload", "second_base", "lost_holder", "held_by_lost"];

/// The heuristic memcheck's default holds each site's block by, if any.
const HELD_BY: [(&str, &str); 4] = [
    ("cow_string", "stdstring"),
    ("length_prefixed", "length64"),
    ("new_array", "newarray"),
    ("second_base", "multipleinheritance"),
];

/// Each site's classes as memcheck gives them (see the file's comment), with the heuristics or
/// without.
fn truth(heuristics: bool) -> BTreeMap<String, Value> {
    let none = (0, 0);
    let kept = |bytes, blocks| {
        if heuristics {
            reach(none, none, none, (bytes, blocks), 0)
        } else {
            reach(none, none, (bytes, blocks), none, 0)
        }
    };
    [
        ("cow_string", kept(40, 1)),
        ("length_prefixed", kept(48, 1)),
        ("new_array", kept(56, 1)),
        ("array_payload", kept(72, 3)),
        ("second_base", kept(32, 1)),
        ("lost_holder", reach((16, 1), none, none, none, 64)),
        ("held_by_lost", reach(none, (48, 1), none, none, 0)),
    ]
    .into_iter()
    .map(|(site, value)| (site.to_string(), value))
    .collect()
}

/// memprof's `"reachable_via_heuristic"` for one heuristic's bytes and blocks.
fn via(name: &str, bytes: u64, blocks: u64) -> Value {
    let mut via = json!({});
    for heuristic in ["stdstring", "length64", "newarray", "multipleinheritance"] {
        let (b, n) = if heuristic == name { (bytes, blocks) } else { (0, 0) };
        via[format!("{heuristic}_bytes")] = json!(b);
        via[format!("{heuristic}_blocks")] = json!(n);
    }
    via
}

/// `attach --inspect` with `flags` on the fixture, which runs on as without memprof: the report.
fn inspect(fixture: &std::path::Path, flags: &[&str]) -> Value {
    let mut target = Waiting::start(fixture, &[]);
    let args: Vec<&str> = ["--inspect", "--duration", "2", "--interval", "1"].iter().chain(flags).copied().collect();
    let outcome = attach(&mut target, &args);
    assert!(outcome.status.success(), "{outcome:?}");
    let child = &mut target.child;
    child.stdin.as_mut().unwrap().write_all(b"end\n").unwrap();
    let mut rest = String::new();
    child.stdout.as_mut().unwrap().read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "set\ndone ok\n");
    assert_eq!(child.wait().unwrap().code(), Some(3));
    outcome.final_report()
}

fn check(heuristics: &str) {
    let fixture = fixture_cpp("heuristics.cpp", "heuristics", &["-g", "-O2", "-fomit-frame-pointer"]);
    let on = heuristics == "all";
    let expected = truth(on);
    let memcheck = memcheck(&fixture, heuristics, &SITES);
    if let Some(memcheck) = &memcheck {
        assert_eq!(memcheck.sites, expected, "memcheck --leak-check-heuristics={heuristics}");
    }
    let flags: &[&str] = if on { &[] } else { &["--inspect-heuristics", "none"] };
    let report = inspect(&fixture, flags);
    let inspection = &report["inspection"];
    assert_eq!(inspection["heuristics"], heuristics, "{inspection}");
    for site in SITES {
        let mut found = reachability(&report, site).clone();
        let held_by = HELD_BY.iter().find(|(s, _)| *s == site).filter(|_| on);
        let via_heuristic = found.as_object_mut().unwrap().remove("reachable_via_heuristic");
        assert_eq!(found, expected[site], "{site}");
        match held_by {
            Some((_, name)) => {
                let (bytes, blocks) = (&expected[site]["reachable_bytes"], &expected[site]["reachable_blocks"]);
                assert_eq!(via_heuristic, Some(via(name, bytes.as_u64().unwrap(), blocks.as_u64().unwrap())), "{site}");
            }
            None => assert_eq!(via_heuristic, None, "{site}"),
        }
    }
    // The totals per heuristic are memcheck's summary lines: no other block is held by one.
    let totals = inspection["totals"]["reachable_via_heuristic"].clone();
    let memchecks: BTreeMap<String, (u64, u64)> = match &memcheck {
        Some(memcheck) => memcheck.via_heuristic.clone(),
        None if on => HELD_BY
            .iter()
            .map(|(site, name)| {
                let r = &expected[*site];
                (name.to_string(), (r["reachable_bytes"].as_u64().unwrap(), r["reachable_blocks"].as_u64().unwrap()))
            })
            .collect(),
        None => BTreeMap::new(),
    };
    if memchecks.is_empty() {
        assert_eq!(totals, Value::Null, "{inspection}");
    } else {
        for (name, (bytes, blocks)) in memchecks {
            assert_eq!(totals[format!("{name}_bytes")], bytes, "{name}: {inspection}");
            assert_eq!(totals[format!("{name}_blocks")], blocks, "{name}: {inspection}");
        }
    }
}

#[test]
fn each_heuristic_holds_its_block_as_memcheck_says() {
    check("all");
}

#[test]
fn without_heuristics_the_blocks_are_possibly_lost_as_memcheck_says() {
    check("none");
}

#[test]
fn a_heuristic_memprof_does_not_know_is_refused_in_one_line() {
    let outcome = memprof_tests::memprof(&["run", "--inspect", "--inspect-heuristics", "stdstring,cow", "--", "true"]);
    assert_eq!(outcome.status.code(), Some(2), "{outcome:?}");
    assert_eq!(outcome.stderr.lines().count(), 1, "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("no heuristic is called 'cow': give all, none or a comma list of stdstring"),
        "{}",
        outcome.stderr
    );
}

/// `memprof inspect --inspect-heuristics none` asks the daemon that traces the fixture for
/// memcheck's classes without heuristics; without the flag, with them all.
#[test]
fn the_daemon_inspects_with_the_heuristics_asked_for() {
    let fixture = fixture_cpp("heuristics.cpp", "heuristics", &["-g", "-O2", "-fomit-frame-pointer"]);
    let mut target = Waiting::start(&fixture, &[]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string()]);
    daemon.wait_traced(pid);
    target.go();
    let mut set = String::new();
    BufReader::new(target.child.stdout.as_mut().unwrap()).read_line(&mut set).unwrap();
    assert_eq!(set, "set\n");
    for (flags, heuristics) in [(&[][..], true), (&["--inspect-heuristics", "none"][..], false)] {
        let mut memprof = Command::new(memprof_bin());
        memprof.args(["inspect", "--pid", &pid.to_string(), "--json", "--daemon"]).arg(&daemon.socket).args(flags);
        let outcome: Outcome = memprof.stdin(Stdio::null()).output().expect("starting memprof").into();
        assert!(outcome.status.success(), "{outcome:?}");
        let report = outcome.final_report();
        let mut found = reachability(&report, "new_array").clone();
        found.as_object_mut().unwrap().remove("reachable_via_heuristic");
        assert_eq!(found, truth(heuristics)["new_array"], "{flags:?}");
    }
}
