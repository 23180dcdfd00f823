//! Allocation wrappers folded into the allocator: a program that allocates through redis-style
//! `zmalloc` (in the program) and `zcalloc` (in a library) has its leaks named by the wrappers'
//! callers, each site apart with its exact bytes, in every format; `--wrapper` and the daemon's
//! `wrappers` key fold a wrapper of any name; `--no-auto-wrappers` keeps the wrappers as leaves.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Command, Stdio},
};

use memprof_tests::{fixture_lib, fixture_with, memprof, run, site, wait_for, Daemon, Waiting};
use serde_json::{json, Value};

const RULE: [&str; 4] = ["--interval", "0.25", "--leak-window", "4"];

/// Sites, the wrappers between them and the allocator (innermost first) and the bytes and
/// blocks they leak (24 rounds).
const SITES: [(&str, &[&str], (u64, u64)); 5] = [
    ("site_a", &["ztrymalloc_usable", "zmalloc"], (24 * 100, 24)),
    ("site_b", &["ztrymalloc_usable", "zmalloc"], (24 * 200, 24)),
    ("lib_site_a", &["zcalloc"], (24 * 64, 24)),
    ("lib_site_b", &["zcalloc"], (24 * 16, 24)),
    ("pool_site", &["pool_get"], (24 * 32, 24)),
];

/// The wrapper names, none of which may be a site once folded.
const WRAPPERS: [&str; 4] = ["ztrymalloc_usable", "zmalloc", "zcalloc", "pool_get"];

/// The fixture linked with its library (`zcalloc`), found through its RPATH.
fn program() -> PathBuf {
    let lib = fixture_lib("wrappers_lib.c", "libwrappers.so", &["-g", "-O0", "-Wl,-soname,libwrappers.so"]);
    let dir = lib.parent().unwrap().to_str().unwrap().to_string();
    let flags = ["-g", "-O0", "-fno-omit-frame-pointer", "-Wl,--no-as-needed", "-L", &dir, "-Wl,-rpath", &dir];
    let flags: Vec<&str> = flags.iter().copied().chain(["-lwrappers"]).collect();
    fixture_with("wrappers.c", "wrappers", &flags)
}

fn stacks(report: &Value) -> &Vec<Value> {
    report["stacks"].as_array().expect("stacks")
}

fn first_function(stack: &Value) -> &str {
    stack["frames"][0]["function"].as_str().unwrap_or("")
}

fn bytes_and_count(stack: &Value) -> (u64, u64) {
    (stack["outstanding_bytes"].as_u64().unwrap(), stack["outstanding_allocations"].as_u64().unwrap())
}

#[test]
fn leaks_through_wrappers_are_named_by_their_callers_and_stay_apart() {
    let program = program();
    let recording = std::env::temp_dir().join(format!("memprof-wrappers-{}.rec", std::process::id()));
    let record = recording.to_str().unwrap();
    let outcome =
        run(&[&RULE[..], &["--wrapper", "pool_get", "--record", record]].concat(), &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    for (name, via, expected) in SITES {
        let found: Vec<&Value> = stacks(&report).iter().filter(|s| first_function(s) == name).collect();
        assert_eq!(found.len(), 1, "one stack at {name}: {report}");
        let stack = found[0];
        assert_eq!(bytes_and_count(stack), expected, "{name}: {stack}");
        assert_eq!(stack["via"], json!(via), "{name}: {stack}");
        assert_eq!(stack["frames"][0]["file"], "wrappers.c", "{name}: {stack}");
        assert_eq!(stack["frames"][0]["module"], program.to_str().unwrap(), "{name}: {stack}");
        assert_eq!(stack["leak"]["candidate"], true, "{name} leaks steadily: {stack}");
    }
    // Two calls of zmalloc in one function: two sites, on their own lines, each its own bytes.
    let mut two: Vec<(u64, (u64, u64))> = stacks(&report)
        .iter()
        .filter(|s| first_function(s) == "two_calls")
        .map(|s| (s["frames"][0]["line"].as_u64().unwrap(), bytes_and_count(s)))
        .collect();
    two.sort();
    assert_eq!(two.len(), 2, "{report}");
    assert!(two[0].0 < two[1].0, "{two:?}");
    assert_eq!((two[0].1, two[1].1), ((24 * 40, 24), (24 * 24, 24)), "{two:?}");
    for stack in stacks(&report) {
        assert!(!WRAPPERS.contains(&first_function(stack)), "a wrapper as the site: {stack}");
    }

    // The same names in the other formats, rendered from the recording.
    let render = |format: &str| {
        let rendered = memprof(&["report", record, "--format", format]);
        assert!(rendered.status.success(), "{rendered:?}");
        rendered.stdout
    };
    let table = render("table");
    assert!(table.contains("[via zmalloc > ztrymalloc_usable]"), "{table}");
    assert!(table.contains("[via pool_get]"), "{table}");
    let folded = render("folded");
    let leaves: BTreeMap<&str, u64> = folded
        .lines()
        .filter_map(|line| {
            let (stack, bytes) = line.rsplit_once(' ')?;
            Some((stack.rsplit(';').next()?, bytes.parse::<u64>().ok()?))
        })
        .fold(BTreeMap::new(), |mut sum, (leaf, bytes)| {
            *sum.entry(leaf).or_default() += bytes;
            sum
        });
    for (name, _, (bytes, _)) in SITES {
        assert_eq!(leaves.get(name), Some(&bytes), "{name} in the folded stacks: {folded}");
    }
    assert!(WRAPPERS.iter().all(|w| !folded.contains(w)), "{folded}");
    let svg = render("flamegraph");
    assert!(svg.contains("site_a") && !svg.contains("zmalloc"), "the flame graph names the callers only");
    // pprof's leaves, as go tool pprof reads them.
    let profile = recording.with_extension("pb.gz");
    let rendered = memprof(&["report", record, "--format", "pprof", "--output", profile.to_str().unwrap()]);
    assert!(rendered.status.success(), "{rendered:?}");
    let top = Command::new("/usr/bin/go")
        .args(["tool", "pprof", "-top", "-sample_index=inuse_space", "-unit=B"])
        .arg(&profile)
        .env("HOME", std::env::temp_dir())
        .stdin(Stdio::null())
        .output()
        .expect("go tool pprof (golang-go, installed by cargo xtask setup)");
    let top = String::from_utf8_lossy(&top.stdout);
    let flat: BTreeMap<&str, u64> = top
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            Some((*fields.last()?, fields.first()?.strip_suffix('B')?.parse().ok()?))
        })
        .collect();
    for (name, _, (bytes, _)) in SITES {
        assert_eq!(flat.get(name), Some(&bytes), "{name}'s flat bytes in pprof: {top}");
    }
    assert!(flat.keys().all(|name| !WRAPPERS.contains(name)), "{top}");
    let _ = std::fs::remove_file(&profile);
    let _ = std::fs::remove_file(&recording);
}

#[test]
fn without_automatic_detection_the_wrappers_are_the_sites() {
    let recording = std::env::temp_dir().join(format!("memprof-no-auto-wrappers-{}.rec", std::process::id()));
    let record = recording.to_str().unwrap();
    let outcome = run(&["--interval", "60", "--no-auto-wrappers", "--record", record], &[program().to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let report = outcome.final_report();
    assert_eq!(site(&report, "ztrymalloc_usable"), (24 * (100 + 200 + 40 + 24), 4 * 24), "{report}");
    assert_eq!(site(&report, "zcalloc"), (24 * (64 + 16), 2 * 24), "{report}");
    assert_eq!(site(&report, "pool_get"), (24 * 32, 24), "{report}");
    assert!(stacks(&report).iter().all(|s| s.get("via").is_none()), "nothing folded: {report}");
    // Each caller is still its own stack under the wrapper.
    let callers = stacks(&report).iter().filter(|s| first_function(s) == "ztrymalloc_usable").count();
    assert_eq!(callers, 4, "{report}");

    // The recording rendered with the wrappers named: folded then.
    let rendered = memprof(&["report", record, "--json", "--wrapper", "ztrymalloc_usable", "--wrapper", "zmalloc"]);
    let _ = std::fs::remove_file(&recording);
    assert!(rendered.status.success(), "{rendered:?}");
    let report = rendered.final_report();
    for (name, via, expected) in &SITES[..2] {
        let stack = stacks(&report).iter().find(|s| first_function(s) == *name).expect(name);
        assert_eq!((bytes_and_count(stack), &stack["via"]), (*expected, &json!(via)), "{stack}");
    }
    assert_eq!(site(&report, "zcalloc"), (24 * (64 + 16), 2 * 24), "not named, not folded: {report}");
}

#[test]
fn a_wrapper_name_that_is_not_one_is_refused_in_one_line() {
    let outcome = memprof(&["run", "--wrapper", "", "--", "/bin/true"]);
    assert_eq!(outcome.status.code(), Some(2), "{outcome:?}");
    assert!(outcome.stderr.contains("is not a function name; give one such as zmalloc"), "{}", outcome.stderr);
}

/// The daemon's `wrappers` key: its metrics name the callers, never a wrapper.
#[test]
fn the_daemon_names_the_callers_in_its_metrics() {
    let _one = memprof_tests::one_at_a_time();
    let config = std::env::temp_dir().join(format!("memprof-wrappers-{}.toml", std::process::id()));
    std::fs::write(&config, "wrappers = [\"pool_get\"]\n").unwrap();
    let mut target = Waiting::start(&program(), &[]);
    let pid = target.pid().to_string();
    let daemon = Daemon::start(&["--config", config.to_str().unwrap(), "--pid", &pid, "--top-stacks", "20"]);
    daemon.wait_traced(target.pid());
    target.go();
    let sites = wait_for(30, "every site in memprof_stack_info", || {
        let (_, metrics) = daemon.get("/metrics")?;
        let sites: Vec<String> = metrics
            .lines()
            .filter(|line| line.starts_with("memprof_stack_info{"))
            .filter_map(|line| Some(line.split("site=\"").nth(1)?.split(" (").next()?.to_string()))
            .collect();
        SITES.iter().all(|(name, _, _)| sites.iter().any(|s| s == name)).then_some(sites)
    });
    let _ = std::fs::remove_file(&config);
    assert!(sites.iter().all(|s| !WRAPPERS.contains(&s.as_str())), "{sites:?}");
    assert_eq!(sites.iter().filter(|s| *s == "two_calls").count(), 2, "{sites:?}");
}
