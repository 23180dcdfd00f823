//! The daemon's inspections (`/api/v1/inspect`) of a process with a large heap: one at a time per
//! process, a second request refused at once (409) with a one-line answer, and `/metrics`
//! answered while one is under way (the inspection runs on the tracer thread, the scrape reads
//! the view it last published); of a busy process beside another's many blocks: only its
//! blocks that changed are read again in the stop.

use std::{
    io::Write as _,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use memprof_tests::{
    fixture, fixture_with, http_get, inspection::reachability, memprof_bin, sample, socket_answer, start_heapbench,
    Daemon, Outcome, Waiting,
};
use serde_json::{json, Value};

/// heapbench's live heap: 65536 blocks of 4 KiB. Its inspection copies it while the process runs,
/// then again in the stop, and scans it: about a second (BENCHMARKS.md, The pause), the time the
/// test has to ask its questions in.
const HEAP_MIB: u64 = 256;

/// Tries, each a full inspection: a try is spoiled when the first request reaches the daemon
/// after the one asking whether it is under way, or ends before the scrape is bracketed.
const TRIES: usize = 5;

/// How long `/metrics` may take while an inspection runs: a generous bound, seconds where a
/// scrape takes milliseconds; answering it only after the inspection would take about a second
/// per 256 MiB.
const SCRAPE_BOUND: Duration = Duration::from_secs(5);

#[test]
fn one_inspection_per_process_at_a_time_and_metrics_answered_meanwhile() {
    let mut target = start_heapbench(HEAP_MIB);
    let pid = target.id();
    let daemon = Daemon::start(&["--pid", &pid.to_string()]);
    daemon.wait_traced(pid);
    let port = daemon.port;
    let socket = &daemon.socket;
    let path = format!("/api/v1/inspect?pid={pid}");
    let busy = format!("pid {pid} is being inspected already; ask again once that inspection has answered");

    let mut tried = 0;
    let (report, scrape, took) = loop {
        tried += 1;
        assert!(tried <= TRIES, "in {TRIES} tries, no inspection lasted across the questions asked");
        let ask = || socket_answer(socket, "GET", &path).map(|answer| (answer.status, answer.body));
        let outcome = thread::scope(|s| {
            let first = s.spawn(|| ask().expect("the first inspection answers"));
            // Not a timing assertion: a first request that comes later spoils this try only.
            thread::sleep(Duration::from_millis(300));
            // A second request for the pid while the first is under way: refused at once.
            let (status, body) = ask().expect("the second request answers");
            if status != 409 {
                let _ = first.join();
                return None;
            }
            assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), json!({"error": busy}), "{body}");
            assert!(!body.contains('\n'), "one line: {body}");
            let asked = Instant::now();
            let scrape = http_get(port, "/metrics").expect("/metrics answers");
            let took = asked.elapsed();
            // Still under way after the scrape: `memprof inspect` is refused too, in one line.
            let refused = inspect_command(socket, pid);
            let (status, body) = first.join().expect("the first request's thread");
            if refused.status.success() {
                return None;
            }
            assert_eq!(refused.status.code(), Some(1), "{refused:?}");
            assert_eq!(refused.stderr.lines().count(), 1, "{}", refused.stderr);
            assert!(refused.stderr.contains(&format!("answered 409: {busy}")), "{}", refused.stderr);
            assert_eq!(status, 200, "{body}");
            Some((serde_json::from_str::<Value>(&body).expect("a JSON report"), scrape, took))
        });
        if let Some(outcome) = outcome {
            break outcome;
        }
    };

    assert_eq!(scrape.0, 200, "{}", scrape.1);
    assert!(took < SCRAPE_BOUND, "/metrics took {took:?} while an inspection ran");
    let inuse = format!("memprof_heap_inuse_bytes{{pid=\"{pid}\"}}");
    assert!(sample(&scrape.1, &inuse).is_some(), "{inuse} in {}", scrape.1);
    // The blocks were made before the daemon attached: none is tracked.
    let inspection = &report["inspection"];
    assert!(inspection["pause_ms"].as_f64().unwrap() > 0.0, "{inspection}");
    assert_eq!(inspection["unclassified_heap_scanned"], true, "{inspection}");
    assert_eq!(inspection["totals"]["reachable_blocks"], 0, "{inspection}");
    // Counted by glibc's chunk headers: heapbench's blocks of 4 KiB (4104 usable) and its array
    // of their pointers, mapped on its own (8 bytes each, 528368 usable).
    let blocks = HEAP_MIB << 8;
    assert_eq!(inspection["untracked_blocks"], blocks + 1, "{inspection}");
    assert_eq!(inspection["untracked_bytes"], blocks * 4104 + 528_368, "{inspection}");
    // Those in the heap are classed together: the array, a root as a block mapped alone, holds
    // them all.
    let unseen = &inspection["untracked_classes"];
    assert_eq!((&unseen["reachable_blocks"], &unseen["reachable_bytes"]), (&json!(blocks), &json!(blocks * 4104)));
    assert!(inspection["heap_bytes_not_classified"].as_u64().unwrap() < HEAP_MIB << 20, "{inspection}");
    drop(target.stdin.take());
    assert!(target.wait().unwrap().success());
}

/// `memprof inspect --pid PID` against the daemon on `socket`.
fn inspect_command(socket: &Path, pid: u32) -> Outcome {
    let mut memprof = Command::new(memprof_bin());
    memprof.args(["inspect", "--pid", &pid.to_string(), "--json", "--daemon"]).arg(socket);
    memprof.stdin(Stdio::null()).output().expect("starting memprof").into()
}

/// `churn_hold.c` replaces its held blocks all the time (a malloc and a free each) while the
/// daemon, which traces it beside a process holding 500,000 blocks, inspects it: in the stop only
/// its blocks that changed since the listing are read again, not the whole table, and the classes
/// are those of the fixture's truth. (The whole table was read again in the stop: the busy
/// process was held still for as long as every traced process's blocks took to read.)
#[test]
fn a_busy_process_beside_many_blocks_has_only_its_changes_read_in_the_stop() {
    let inspection = inspect_churning(500_000, 1024, &[]);
    assert_eq!(inspection["live_read_in_pause"], false, "{inspection}");
    assert!(inspection["live_changes_in_pause"].as_u64() > Some(0), "{inspection}");
}

/// More of its blocks change while the daemon lists the table than it can note (8,192 addresses
/// with a table of 524,288 entries): the whole table is read again in the stop, and the classes
/// are as exact.
#[test]
fn more_changes_than_can_be_noted_have_the_whole_table_read_in_the_stop() {
    let inspection = inspect_churning(400_000, 100_000, &["--max-live", "524288"]);
    assert_eq!(inspection["live_read_in_pause"], true, "{inspection}");
    assert_eq!(inspection["live_changes_in_pause"], 0, "{inspection}");
}

/// The daemon (with `daemon_args`, every call recorded) inspects `churn_hold` holding `held`
/// blocks, traced beside `small_blocks` holding `crowd`: its classes are the fixture's truth, and
/// it ends as without memprof. The report's `inspection`.
fn inspect_churning(crowd: u32, held: u64, daemon_args: &[&str]) -> Value {
    let mut crowd = Waiting::start(&fixture("small_blocks"), &[&crowd.to_string(), "after"]);
    let churn = fixture_with("churn_hold.c", "churn_hold", &["-g", "-O2", "-pthread"]);
    let mut busy = Waiting::start(&churn, &[&held.to_string()]);
    let (crowd_pid, busy_pid) = (crowd.pid(), busy.pid());
    let pids = ["--pid", &crowd_pid.to_string(), "--pid", &busy_pid.to_string(), "--max-rate", "off"];
    let daemon = Daemon::start(&[&pids[..], daemon_args].concat());
    daemon.wait_traced(crowd_pid);
    daemon.wait_traced(busy_pid);
    crowd.go();
    assert_eq!(crowd.next_line(), "held");
    busy.go();
    assert_eq!(busy.next_line(), "set");
    let (status, report) = daemon.get_json(&format!("/api/v1/inspect?pid={busy_pid}"));
    assert_eq!(status, 200, "{report}");
    // Two stacks make held blocks (the first made, those replacing them): their sum, one more
    // when stopped between a new block's malloc and the old one's free. The other tracked block
    // is the thread's, possibly lost as memcheck says of it.
    let totals = &report["inspection"]["totals"];
    let blocks = totals["reachable_blocks"].as_u64().unwrap();
    assert!(blocks == held || blocks == held + 1, "{totals}");
    assert_eq!(totals["reachable_bytes"], blocks * 96, "{totals}");
    assert_eq!((&totals["definitely_lost_blocks"], &totals["definitely_lost_bytes"]), (&json!(8), &json!(8 * 64)));
    let lost = reachability(&report, "lost_block");
    assert_eq!(
        (&lost["definitely_lost_blocks"], &lost["definitely_lost_bytes"]),
        (&json!(8), &json!(8 * 64)),
        "{lost}"
    );
    busy.child.stdin.as_mut().unwrap().write_all(b"end\n").unwrap();
    assert_eq!(busy.next_line(), "done ok");
    assert!(busy.child.wait().unwrap().success());
    report["inspection"].clone()
}
