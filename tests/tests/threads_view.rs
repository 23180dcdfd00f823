//! `--threads`: the heap in use by the thread that allocated it, named, on
//! tests/fixtures/threads_named.c, whose truth is known: "worker-1" holds 10 blocks (10,000
//! bytes), "worker-2" 20 (20,000), "worker-3" 30 (30,000); the main thread its 5 of 100 bytes
//! and what glibc allocated for each thread it created.

use memprof_tests::{chromium, fixture, memprof, run};
use serde_json::Value;

/// `(name, bytes, blocks)` of the named workers, by name.
fn workers(report: &Value) -> Vec<(String, u64, u64)> {
    let mut named: Vec<(String, u64, u64)> = report["threads"]
        .as_array()
        .unwrap_or_else(|| panic!("no threads: {report}"))
        .iter()
        .filter_map(|t| {
            let name = t["name"].as_str()?.to_string();
            name.starts_with("worker-").then(|| {
                (name, t["outstanding_bytes"].as_u64().unwrap(), t["outstanding_allocations"].as_u64().unwrap())
            })
        })
        .collect();
    named.sort();
    named
}

fn expected() -> Vec<(String, u64, u64)> {
    vec![("worker-1".into(), 10_000, 10), ("worker-2".into(), 20_000, 20), ("worker-3".into(), 30_000, 30)]
}

#[test]
fn each_named_thread_holds_its_exact_bytes_live_and_in_the_recording() {
    let path = std::env::temp_dir().join(format!("memprof-threads-{}.rec", std::process::id()));
    let recorded = path.to_str().unwrap();
    let program = fixture("threads_named");
    let outcome = run(&["--interval", "0.2", "--threads", "--record", recorded], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let end = outcome.final_report();
    assert_eq!(workers(&end), expected());
    let threads = end["threads"].as_array().unwrap();
    let main = threads.iter().find(|t| t["tid"] == end["pid"]).unwrap_or_else(|| panic!("{end}"));
    assert_eq!(main["name"], "threads_named");
    assert!(main["outstanding_bytes"].as_u64().unwrap() >= 500, "{main}");
    // Every block in use is some thread's.
    let sum: u64 = threads.iter().map(|t| t["outstanding_bytes"].as_u64().unwrap()).sum();
    assert_eq!(sum, end["totals"]["outstanding_bytes"].as_u64().unwrap());

    let again = memprof(&["report", recorded, "--json", "--at", "final"]);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(workers(&again.final_report()), expected());
    let html = memprof(&["report", recorded, "--format", "html"]);
    let _ = std::fs::remove_file(&path);
    assert!(
        html.stdout.contains("\"name\":\"worker-3\",\"outstanding_bytes\":30000,\"outstanding_allocations\":30"),
        "the page's data"
    );
    // The page as a browser shows it: a row per thread, named, with its exact bytes.
    let page = std::env::temp_dir().join(format!("memprof-threads-{}.html", std::process::id()));
    std::fs::write(&page, &html.stdout).unwrap();
    let dom = chromium::dom(&format!("file://{}", page.display()));
    let _ = std::fs::remove_file(&page);
    let table = chromium::section(&dom, "thread-use");
    for (name, bytes, blocks) in
        [("worker-1", "10,000", "10"), ("worker-2", "20,000", "20"), ("worker-3", "30,000", "30")]
    {
        let row =
            table.split("<tr").find(|row| row.contains(&format!("({name})"))).unwrap_or_else(|| panic!("{table}"));
        assert!(row.contains(&format!("data-key=\"outstanding_bytes\">{bytes}<")), "{row}");
        assert!(row.contains(&format!("data-key=\"outstanding_allocations\">{blocks}<")), "{row}");
    }
}

#[test]
fn the_table_lists_threads_by_bytes() {
    let program = fixture("threads_named");
    let outcome = memprof(&["run", "--interval", "0.2", "--threads", "--", program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let table = outcome.stdout.rsplit("final report").next().unwrap().to_string();
    assert!(table.contains("  threads: in use by the thread that allocated it\n"), "{table}");
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.ends_with(&format!("({name})")))
            .unwrap_or_else(|| panic!("{name}: {table}"))
            .to_string()
    };
    assert!(row("worker-3").starts_with(&format!("  {:>12} {:>9}  tid ", 30_000, 30)), "{table}");
    assert!(row("worker-1").starts_with(&format!("  {:>12} {:>9}  tid ", 10_000, 10)), "{table}");
}

/// Sampled, each block counts for its weight: blocks at least `--sample-bytes` large are each
/// recorded and stand for themselves, so the numbers stay exact; the table says they are estimates.
#[test]
fn sampled_threads_count_each_block_for_its_weight() {
    let program = fixture("threads_named");
    let outcome = run(&["--interval", "0.2", "--threads", "--sample-bytes", "512"], &[program.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let end = outcome.final_report();
    assert_eq!(end["sample_bytes"], 512);
    assert_eq!(workers(&end), expected());
    let table =
        memprof(&["run", "--interval", "0.2", "--threads", "--sample-bytes", "512", "--", program.to_str().unwrap()]);
    assert!(
        table.stdout.contains(
            "threads: in use by the thread that allocated it; sampled: estimates, each block scaled by its weight"
        ),
        "{}",
        table.stdout
    );
}
