//! `--suppressions` (valgrind's file format) and `--gen-suppressions`, on
//! tests/fixtures/suppressions.c, whose truth is known: at exit accepted_cache holds 24,000
//! bytes, accepted_init 7,200 and real_leak 12,288, each in 24 blocks, each a leak candidate.

use std::{process::Command, sync::OnceLock};

use memprof_tests::{
    chromium, fixture, fixture_cpp, fixture_with, memprof, metric, run, site, wait_for, Daemon, Outcome, Scratch,
    Waiting,
};
use serde_json::{json, Value};

/// The team's file: one rule as valgrind writes them (from `malloc`), one as memprof's
/// frames read (a wildcard, then the site).
const ACCEPTED: &str = "\
# accepted by the team
{
   cache
   Memcheck:Leak
   match-leak-kinds: definite
   fun:malloc
   fun:accepted_cache
   fun:cache_fill
   fun:main
}
{
   init
   Memcheck:Leak
   ...
   fun:accepted_init
   fun:main
}
";

/// The recording, made once and kept in memory: each test writes it into its own directory, so
/// that nothing outlives the tests (a static is never dropped).
static RECORDING: OnceLock<Vec<u8>> = OnceLock::new();

/// `text` written to `name` in `dir`: its path.
fn written(dir: &Scratch, name: &str, text: &str) -> String {
    let path = dir.file(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A recording of the fixture without suppressions (made once), in `dir`: its path.
fn recording(dir: &Scratch) -> String {
    let bytes = RECORDING.get_or_init(|| {
        let made = Scratch::new("suppressions", "recording");
        let path = made.file("run.rec");
        let outcome = run(&["--interval", "0.2", "--record", &path], &[program().as_str()]);
        assert!(outcome.status.success(), "{outcome:?}");
        // Without suppressions, the three sites are leak candidates.
        let end = outcome.final_report();
        assert_eq!(
            candidates(&end),
            owned(&[("accepted_cache", 24_000), ("accepted_init", 7_200), ("real_leak", 12_288)])
        );
        std::fs::read(&path).unwrap()
    });
    let path = dir.file("run.rec");
    if !std::path::Path::new(&path).exists() {
        std::fs::write(&path, bytes).unwrap();
    }
    path
}

fn program() -> String {
    fixture("suppressions").to_str().unwrap().to_string()
}

/// `(site, bytes)` of the leak candidates, by site.
fn candidates(report: &Value) -> Vec<(String, u64)> {
    let mut sites: Vec<(String, u64)> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["leak"]["candidate"] == true)
        .map(|s| (s["frames"][0]["function"].as_str().unwrap().to_string(), s["outstanding_bytes"].as_u64().unwrap()))
        .collect();
    sites.sort();
    sites
}

fn owned(sites: &[(&str, u64)]) -> Vec<(String, u64)> {
    sites.iter().map(|&(s, n)| (s.to_string(), n)).collect()
}

/// `memprof report` of the recording (written into `dir`) with `args`.
fn report(dir: &Scratch, args: &[&str]) -> Outcome {
    let path = recording(dir);
    let all: Vec<&str> = ["report", path.as_str()].iter().chain(args).copied().collect();
    memprof(&all)
}

#[test]
fn accepted_stacks_leave_the_leak_candidates_and_are_counted_by_rule() {
    let dir = Scratch::new("suppressions", "accepted");
    let accepted = written(&dir, "accepted.supp", ACCEPTED);
    let outcome = report(&dir, &["--json", "--at", "final", "--suppressions", &accepted]);
    assert!(outcome.status.success(), "{outcome:?}");
    let end = outcome.final_report();
    assert_eq!(candidates(&end), owned(&[("real_leak", 12_288)]));
    let expected = json!({"stacks": 2, "bytes": 31_200, "by_rule": [
        {"rule": "cache", "stacks": 1, "bytes": 24_000}, {"rule": "init", "stacks": 1, "bytes": 7_200}]});
    assert_eq!(end["suppressed"], expected);
    let marked = |site: &str| {
        end["stacks"].as_array().unwrap().iter().find(|s| s["frames"][0]["function"] == site).unwrap()["suppressed"]
            .clone()
    };
    assert_eq!(
        (marked("accepted_cache"), marked("accepted_init"), marked("real_leak")),
        (json!("cache"), json!("init"), Value::Null)
    );

    let table = report(&dir, &["--at", "final", "--suppressions", &accepted]).stdout;
    assert!(table.contains("  suppressed: 2 stacks, 31200 bytes, by rule cache (1), init (1)\n"), "{table}");
    assert!(table.contains("[suppressed by cache]"), "{table}");
    let html = report(&dir, &["--format", "html", "--suppressions", &accepted]).stdout;
    assert!(html.contains("\"suppressed\":{\"stacks\":2,\"bytes\":31200"), "the page's data says it");
    // The page as a browser shows it: the rules' count under the leaks, the accepted stacks no leaks.
    let page = written(&dir, "page.html", &html);
    let dom = chromium::dom(&format!("file://{page}"));
    let leaks = chromium::section(&dom, "leaks");
    assert!(
        leaks.contains("Suppressed: 2 stacks, 31,200 bytes, by rule cache (1), init (1)."),
        "the note under the leaks: {leaks}"
    );
    assert!(leaks.contains("real_leak") && !leaks.contains("accepted_cache"), "{leaks}");

    // Live, with a CI gate: only the real leak's bytes count.
    let live = run(
        &["--interval", "0.2", "--suppressions", &accepted, "--fail-on-leak-bytes", "12288"],
        &[program().as_str()],
    );
    assert!(live.status.success(), "{live:?}");
    let end = live.final_report();
    assert_eq!(candidates(&end), owned(&[("real_leak", 12_288)]));
    assert_eq!(end["suppressed"], expected);
}

/// With `--inspect`, the accepted stacks' blocks leave the classes: what is classed is the real
/// leak's alone (its last block's pointer may linger in a register or on the stack: reachable).
#[test]
fn inspected_accepted_blocks_leave_the_lost_classes() {
    let dir = Scratch::new("suppressions", "inspect");
    let accepted = written(&dir, "inspect.supp", ACCEPTED);
    let args = ["--interval", "0.2", "--inspect", "--duration", "3", "--suppressions", &accepted];
    let outcome = run(&args, &[program().as_str(), "--linger"]);
    assert!(outcome.status.success(), "{outcome:?}");
    let end = outcome.final_report();
    let totals = &end["inspection"]["totals"];
    let classed = |what: &str| -> u64 {
        ["definitely_lost", "indirectly_lost", "possibly_lost", "reachable"]
            .iter()
            .map(|class| totals[format!("{class}_{what}")].as_u64().unwrap())
            .sum()
    };
    assert_eq!((classed("bytes"), classed("blocks")), (12_288, 24), "{totals}");
    assert!(totals["definitely_lost_bytes"].as_u64().unwrap() >= 12_288 - 512, "{totals}");
    assert_eq!(end["suppressed"]["bytes"], 31_200, "{}", end["suppressed"]);
    let stacks = end["stacks"].as_array().unwrap();
    let at = |site: &str| stacks.iter().find(|s| s["frames"][0]["function"] == site).unwrap();
    assert_eq!(at("accepted_cache")["reachability"], Value::Null);
    assert!(at("real_leak")["reachability"].is_object());
}

#[test]
fn generated_suppressions_accept_every_candidate_in_memprof_and_valgrind() {
    let dir = Scratch::new("suppressions", "generated");
    let outcome = report(&dir, &["--at", "final", "--gen-suppressions", "-o", &dir.file("gen.txt")]);
    assert!(outcome.status.success(), "{outcome:?}");
    let generated = outcome.stdout;
    assert_eq!(generated.matches("Memcheck:Leak").count(), 3, "{generated}");
    assert!(generated.contains("   fun:*\n   fun:accepted_cache\n   fun:cache_fill\n   fun:main\n}\n"), "{generated}");
    let file = written(&dir, "generated.supp", &generated);
    let end = report(&dir, &["--json", "--at", "final", "--suppressions", &file]).final_report();
    assert_eq!(candidates(&end), owned(&[]));
    assert_eq!((&end["suppressed"]["stacks"], &end["suppressed"]["bytes"]), (&json!(3), &json!(43_488)));
    if let Some(used) = valgrind(&file, &program()) {
        let mut bytes: Vec<u64> = used.iter().map(|(_, bytes)| *bytes).collect();
        bytes.sort();
        assert_eq!(bytes, [7_200, 12_288, 24_000], "{used:?}");
    }
    // A session writes the same rules after its final report, whatever its --top.
    let session = memprof(&["run", "--interval", "0.2", "--top", "1", "--gen-suppressions", "--", &program()]);
    assert!(session.status.success(), "{session:?}");
    let rules = &session.stdout[session.stdout.find("{\n").expect("rules after the report")..];
    assert_eq!(rules, generated, "{}", session.stdout);
    let refused = memprof(&["report", &recording(&dir), "--json", "--gen-suppressions"]);
    assert!(!refused.status.success());
    assert!(
        refused.stderr.contains("write the report to a file (-o FILE) or give --format table"),
        "{}",
        refused.stderr
    );
}

/// Where valgrind is installed: the same rules suppress the same bytes in memcheck.
#[test]
fn valgrind_suppresses_the_same_sites_with_the_same_file() {
    let dir = Scratch::new("suppressions", "valgrind");
    let accepted = written(&dir, "valgrind.supp", ACCEPTED);
    let Some(used) = valgrind(&accepted, &program()) else { return };
    assert_eq!(used, [("cache".to_string(), 24_000), ("init".to_string(), 7_200)]);
    let end = report(&dir, &["--json", "--at", "final", "--suppressions", &accepted]).final_report();
    let ours: Vec<(String, u64)> = end["suppressed"]["by_rule"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["rule"].as_str().unwrap().to_string(), r["bytes"].as_u64().unwrap()))
        .collect();
    assert_eq!(ours, used);
}

/// valgrind names C++ functions by their mangled names: generated rules do too, and leave out
/// the operator new that memprof folds into malloc (valgrind's stacks start there).
#[test]
fn generated_suppressions_name_cpp_functions_as_valgrind_matches_them() {
    let program = fixture_cpp("suppressions_cpp.cpp", "suppressions_cpp", &["-g", "-O0"]);
    let program = program.to_str().unwrap();
    let outcome = memprof(&["run", "--interval", "0.2", "--gen-suppressions", "--", program]);
    assert!(outcome.status.success(), "{outcome:?}");
    let rules = &outcome.stdout[outcome.stdout.find("{\n").expect("rules after the report")..];
    assert_eq!(rules.matches("Memcheck:Leak").count(), 2, "{rules}");
    assert!(rules.contains("   fun:*\n   fun:_ZN3app5Cache4fillEv\n   fun:main\n}"), "{rules}");
    assert!(rules.contains("   fun:*\n   fun:_ZN3app4growEi\n   fun:_ZN3app5Cache4fillEv\n   fun:main\n}"), "{rules}");
    let dir = Scratch::new("suppressions", "generated_cpp");
    let file = written(&dir, "generated_cpp.supp", rules);
    let accepted = memprof(&["run", "--interval", "0.2", "--json", "--suppressions", &file, "--", program]);
    let end = accepted.final_report();
    assert_eq!(candidates(&end), owned(&[]), "{end}");
    assert_eq!((&end["suppressed"]["stacks"], &end["suppressed"]["bytes"]), (&json!(2), &json!(31_200)));
    if let Some(used) = valgrind(&file, program) {
        let mut bytes: Vec<u64> = used.iter().map(|(_, bytes)| *bytes).collect();
        bytes.sort();
        assert_eq!(bytes, [7_200, 24_000], "{used:?}");
    }
}

/// A function GCC cloned at -O2 is named in generated rules as the symbol table names it
/// (`fill.constprop.0.isra.0`), as valgrind names it, though the debug information memprof reads
/// names it `fill`.
#[test]
fn generated_suppressions_name_a_cloned_function_as_valgrind_matches_it() {
    let program = fixture_with("suppressions_clone.c", "suppressions_clone", &["-g", "-O2"]);
    let program = program.to_str().unwrap();
    let symbols = Command::new("nm").arg(program).output().expect("nm");
    let symbols = String::from_utf8_lossy(&symbols.stdout);
    let clone =
        symbols.lines().filter_map(|line| line.split_whitespace().nth(2)).find(|name| name.starts_with("fill."));
    let clone = clone.unwrap_or_else(|| panic!("GCC made no clone of fill: {symbols}"));
    let outcome = memprof(&["run", "--interval", "0.2", "--gen-suppressions", "--", program]);
    assert!(outcome.status.success(), "{outcome:?}");
    let rules = &outcome.stdout[outcome.stdout.find("{\n").expect("rules after the report")..];
    assert!(rules.contains(&format!("   fun:*\n   fun:{clone}\n   fun:main\n}}")), "{rules}");
    let dir = Scratch::new("suppressions", "generated_clone");
    let file = written(&dir, "generated_clone.supp", rules);
    let accepted = memprof(&["run", "--interval", "0.2", "--json", "--suppressions", &file, "--", program]);
    let end = accepted.final_report();
    assert_eq!(candidates(&end), owned(&[]), "{end}");
    assert_eq!(end["suppressed"]["bytes"], json!(24_000), "{end}");
    if let Some(used) = valgrind(&file, program) {
        assert_eq!(used.iter().map(|(_, bytes)| *bytes).collect::<Vec<_>>(), [24_000], "{used:?}");
    }
}

/// `(rule, bytes suppressed)` of each rule memcheck used on `program`, by rule name; None
/// without valgrind.
fn valgrind(file: &str, program: &str) -> Option<Vec<(String, u64)>> {
    let output = Command::new("valgrind")
        .args(["-v", "--leak-check=full", "--default-suppressions=no", &format!("--suppressions={file}")])
        .arg(program)
        .output()
        .ok()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "valgrind refused the file: {stderr}");
    // `--1234-- used_suppression:      1 cache /tmp/x.supp:3 suppressed: 24,000 bytes in 24 blocks`
    let mut used: Vec<(String, u64)> = stderr
        .lines()
        .filter_map(|line| line.split_once("used_suppression:"))
        .filter_map(|(_, rest)| {
            let (name_and_file, suppressed) = rest.split_once(" suppressed: ")?;
            let mut words = name_and_file.split_whitespace();
            let (_count, _file) = (words.next()?, words.next_back()?);
            let name = words.collect::<Vec<_>>().join(" ");
            let bytes = suppressed.split(" bytes").next()?.replace(',', "").parse().ok()?;
            Some((name, bytes))
        })
        .collect();
    used.sort();
    Some(used)
}

#[test]
fn a_malformed_file_is_refused_in_one_line_with_its_place() {
    let dir = Scratch::new("suppressions", "bad");
    let bad = written(&dir, "bad.supp", "{\n   cache\n   Memcheck:Leak\n   func:accepted_cache\n}\n");
    let outcome = report(&dir, &["--suppressions", &bad]);
    assert!(!outcome.status.success());
    assert_eq!(outcome.stderr.lines().count(), 1, "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains(&format!("{bad}:4: `func:accepted_cache` is not a frame; give fun:NAME")),
        "{}",
        outcome.stderr
    );
    let missing = memprof(&["run", "--suppressions", "/nonexistent.supp", "--", "true"]);
    assert!(!missing.status.success());
    assert!(missing.stderr.contains("reading the suppressions file /nonexistent.supp"), "{}", missing.stderr);
    // The cause once: in the message, not again as its source.
    assert_eq!(missing.stderr.matches("No such file or directory").count(), 1, "{}", missing.stderr);
}

/// The daemon given the same file: on `/metrics` the accepted stacks are no leak candidates, so
/// no alert fires for them, while the real leak is one; its reports count the rules' stacks.
#[test]
fn the_daemon_leaves_accepted_stacks_out_of_its_leak_metrics() {
    let dir = Scratch::new("suppressions", "daemon");
    let accepted = written(&dir, "daemon.supp", ACCEPTED);
    let mut target = Waiting::start(&fixture("suppressions"), &["--slow"]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string(), "--leak-window", "3", "--suppressions", &accepted]);
    daemon.wait_traced(pid);
    target.go();
    let series = |name: &str| format!("{name}{{pid=\"{pid}\",comm=\"suppressions\"}}");
    wait_for(30, "the real leak to be the one candidate", || {
        (metric(daemon.port, &series("memprof_leak_candidates"))? == 1).then_some(())
    });
    let (_, report) = daemon.get_json(&format!("/api/v1/leaks?pid={pid}"));
    let sites: Vec<String> = candidates(&report).into_iter().map(|(site, _)| site).collect();
    assert_eq!(sites, ["real_leak"], "{report}");
    let rules: Vec<&str> =
        report["suppressed"]["by_rule"].as_array().unwrap().iter().map(|r| r["rule"].as_str().unwrap()).collect();
    assert_eq!(rules, ["cache", "init"], "{report}");
    let bytes = metric(daemon.port, &series("memprof_leak_candidate_bytes")).unwrap();
    assert_eq!(bytes % 512, 0, "real_leak's blocks only: {bytes}");
}

/// A reload's suppressions apply to every target by the next interval, a settled target's too:
/// its view, which it would otherwise keep until it moves, is built anew.
#[test]
fn a_reloaded_suppression_applies_to_a_settled_target() {
    let dir = Scratch::new("suppressions", "reload");
    let mut held = Waiting::start(&fixture("settle"), &[]);
    let pid = held.pid();
    let settings = format!("pids = [{pid}]\nleak_window = 2\n");
    let config = written(&dir, "memprof.toml", &settings);
    let daemon = Daemon::start(&["--config", &config]);
    daemon.wait_traced(pid);
    held.go();
    wait_for(30, "the target settled", || (metric(daemon.port, "memprof_settled_targets")? == 1).then_some(()));
    let path = format!("/api/v1/leaks?pid={pid}");
    let rules = |report: &Value| -> Vec<String> {
        let by_rule = report["suppressed"]["by_rule"].as_array().cloned().unwrap_or_default();
        by_rule.iter().map(|r| r["rule"].as_str().unwrap().to_string()).collect()
    };
    let before = daemon.get_json(&path).1;
    assert_eq!((site(&before, "first_site"), rules(&before)), ((10_000, 10), vec![]), "{before}");

    let first = written(&dir, "first.supp", "{\n   first\n   Memcheck:Leak\n   ...\n   fun:first_site\n}\n");
    written(&dir, "memprof.toml", &format!("{settings}suppressions = [\"{first}\"]\n"));
    daemon.signal(libc::SIGHUP);
    let after = wait_for(20, "the reloaded rule applied", || {
        let report = daemon.get_json(&path).1;
        (rules(&report) == ["first"]).then_some(report)
    });
    assert_eq!(site(&after, "first_site"), (10_000, 10), "{after}");
}
