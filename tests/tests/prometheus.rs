//! memprof as Prometheus sees it: /metrics that promtool finds clean in the format asked for, a
//! real Prometheus server scraping a daemon (in two jobs, as two servers' daemons), and the shipped
//! alerting rules and Grafana dashboard run against it.

use std::{
    io::Write as _,
    process::{Command, Stdio},
};

use memprof_tests::{
    fixture,
    prometheus::{of_pid, Prometheus},
    wait_for, workspace, Daemon, Waiting,
};
use serde_json::Value;

/// The Accept header Prometheus 2 scrapes with.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// (Content-Type, body) of /metrics fetched with `accept`.
fn scrape(port: u16, accept: &str) -> (String, String) {
    let url = format!("http://127.0.0.1:{port}/metrics");
    let out = Command::new("curl").args(["-sS", "-D", "-", "-H", &format!("Accept: {accept}"), &url]).output();
    let out = String::from_utf8(out.expect("curl").stdout).expect("UTF-8");
    let (headers, body) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no headers: {out}"));
    let content_type =
        headers.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type: ").map(String::from));
    (content_type.unwrap_or_default(), body.to_string())
}

/// `promtool ARGS` with `stdin`; panics with its output unless it exits 0.
fn promtool(args: &[&str], stdin: &str) {
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(workspace())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package, installed by xtask setup)");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {args:?}: {said}");
}

/// Text 0.0.4 unless OpenMetrics is preferred, and promtool has nothing to say about it.
fn assert_exposition(port: u16) {
    for accept in ["*/*", "text/plain; version=0.0.4"] {
        let (content_type, body) = scrape(port, accept);
        assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8", "{accept}");
        assert!(body.contains("# HELP memprof_allocations_total "), "{body}");
        assert!(body.contains("memprof_stack_leak_candidate{") && !body.contains("# EOF"), "{body}");
        promtool(&["check", "metrics"], &body);
    }
    let (content_type, body) = scrape(port, PROMETHEUS_ACCEPT);
    assert_eq!(content_type, "application/openmetrics-text; version=1.0.0; charset=utf-8");
    assert!(body.contains("# TYPE memprof_allocations counter") && body.ends_with("# EOF\n"), "{body}");
}

/// The YAML file at `path` in the workspace.
fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(workspace().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_shipped_rules_pass_promtool_and_the_prometheus_rule_holds_the_same() {
    promtool(&["check", "rules", "deploy/memprof.rules.yml"], "");
    promtool(&["test", "rules", "tests/promtool/rules_test.yml"], "");
    let groups = yaml("deploy/memprof.rules.yml")["groups"].clone();
    assert_eq!(yaml("deploy/prometheusrule.yaml")["spec"]["groups"], groups);
}

/// Every query of the dashboard, with its variables as Grafana sets them for all instances;
/// `label_values(M, L)` (a Grafana function) as the query that has data when it has values.
fn dashboard_queries() -> Vec<String> {
    let path = workspace().join("deploy/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap().iter();
    let mut queries: Vec<String> =
        panels.flat_map(|p| p["targets"].as_array().unwrap()).map(|t| t["expr"].as_str().unwrap().into()).collect();
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(query) = variable["query"]["query"].as_str() {
            let (metric, label) =
                query.strip_prefix("label_values(").unwrap().trim_end_matches(')').split_once(", ").unwrap();
            queries.push(format!("count by ({label}) ({metric})"));
        }
    }
    queries.iter().map(|q| q.replace("$instance", ".*").replace("$__rate_interval", "1m")).collect()
}

#[test]
fn prometheus_sees_each_processs_heap_to_the_byte_and_the_rules_name_the_leak() {
    let mut first = Waiting::start(&fixture("daemon_target"), &[]);
    let mut second = Waiting::start(&fixture("daemon_target"), &[]);
    // Leaks 1000 bytes every 0.8 s for 29 s (tests/fixtures/leak_kinds.c).
    let mut leaking = Waiting::start(&fixture("leak_kinds"), &["8"]);
    let daemon = Daemon::start(&[
        "--comm",
        "^daemon_target$",
        "--comm",
        "^leak_kinds$",
        "--leak-window",
        "3",
        "--size-histograms",
    ]);
    for target in [&first, &second, &leaking] {
        daemon.wait_traced(target.pid());
    }
    first.go();
    second.go();
    leaking.go();
    let prometheus = Prometheus::start(daemon.port);

    // The shipped alert names the leaking function, once per scrape job.
    let rules = yaml("deploy/memprof.rules.yml");
    let rules = rules["groups"][0]["rules"].as_array().unwrap();
    let leak_alert = rules.iter().find(|r| r["alert"] == "MemprofLeak").unwrap()["expr"].as_str().unwrap();
    wait_for(30, "MemprofLeak to name leak_steady in both jobs", || {
        let leaks = prometheus.series(leak_alert).ok()?;
        let named = |s: &&Value| s["metric"]["comm"] == "leak_kinds" && s["metric"]["function"] == "leak_steady";
        (leaks.iter().filter(named).count() == 2).then_some(())
    });
    assert_exposition(daemon.port);
    for rule in rules {
        let expr = rule["expr"].as_str().unwrap();
        prometheus.series(expr).unwrap_or_else(|e| panic!("{expr}: {e}"));
    }
    // Joining on the stack alone matches each series of the other job too.
    let old_join = "memprof_stack_inuse_bytes * on(stack) group_left(site) memprof_stack_info";
    assert!(prometheus.series(old_join).is_err(), "two targets: duplicate series");
    for query in dashboard_queries() {
        wait_for(30, &format!("data for the dashboard's {query}"), || {
            prometheus.series(&query).ok().filter(|series| !series.is_empty())
        });
    }

    // Two processes of one name: slots 0 and 1, each pid given by memprof_target_attached.
    let slots = wait_for(30, "both daemon_target processes", || {
        let attached = prometheus.series("memprof_target_attached{comm=\"daemon_target\",job=\"memprof\"}").ok()?;
        let mut slots: Vec<(String, String)> = (attached.iter())
            .map(|s| (s["metric"]["slot"].as_str().unwrap().into(), s["metric"]["pid"].as_str().unwrap().into()))
            .collect();
        slots.sort();
        (slots.len() == 2).then_some(slots)
    });
    let mut pids: Vec<String> = slots.iter().map(|(_, pid)| pid.clone()).collect();
    pids.sort();
    let mut expected = vec![first.pid().to_string(), second.pid().to_string()];
    expected.sort();
    assert_eq!((slots[0].0.as_str(), slots[1].0.as_str(), pids), ("0", "1", expected));
    for pid in [first.pid(), second.pid()] {
        let inuse = of_pid("memprof_heap_inuse_bytes", pid);
        wait_for(60, &format!("{inuse} == 50000 in Prometheus"), || {
            (prometheus.query(&inuse)? == 50_000.0).then_some(())
        });
    }
    let allocations = of_pid("memprof_allocations_total", first.pid());
    let before = wait_for(30, "allocations in Prometheus", || prometheus.query(&allocations));
    wait_for(30, "memprof_allocations_total to grow", || (prometheus.query(&allocations)? > before).then_some(()));
    let histogram = of_pid("memprof_allocation_size_bytes_bucket{le=\"1024.0\"}", first.pid());
    let small = wait_for(30, "the size histogram", || prometheus.query(&histogram));
    assert!(small >= 50.0, "the 50 x 1000-byte blocks fall at or below 1024: {small}");
    let top = of_pid("memprof_stack_inuse_bytes{stack!=\"other\"}", first.pid());
    assert_eq!(wait_for(30, "the top stack", || prometheus.query(&top)), 50_000.0);
    assert_series_budget(&prometheus);
    let site = "count(memprof_stack_info{site=~\"hold_site \\\\(daemon_target.c:[0-9]+\\\\)\"})";
    assert!(wait_for(30, "the stack's site", || prometheus.query(site)) >= 1.0);
}

/// Series of one traced process at the defaults, besides its stacks' and the drop reasons it met
/// (docs: daemon/metrics.md#series-budget): 20 counts and gauges, 2 leak verdicts, the rule's
/// warm-up, the RSS difference and memprof_target_attached.
const PROCESS_SERIES: usize = 25;
/// Series of each exported stack (memprof_stack_inuse_bytes, _info, _leak_candidate).
const STACK_SERIES: usize = 3;
/// memprof_allocation_size_bytes with --size-histograms: 34 buckets, the sum and the count.
const HISTOGRAM_SERIES: usize = 36;

/// Each process's series in Prometheus number exactly the budget the docs give.
fn assert_series_budget(prometheus: &Prometheus) {
    let per_process = "count by (job, comm, slot) ({__name__=~\"memprof_.+\", slot!=\"\"})";
    let stacks = "count by (job, comm, slot) (memprof_stack_info)";
    let drops = "count by (job, comm, slot) (memprof_events_dropped_total)";
    let by_process = |query: &str| -> Vec<(String, usize)> {
        let series = prometheus.series(query).unwrap_or_else(|e| panic!("{query}: {e}"));
        series
            .iter()
            .map(|s| {
                let m = &s["metric"];
                let key = format!("{} {} {}", m["job"], m["comm"], m["slot"]);
                (key, s["value"][1].as_str().unwrap().parse().unwrap())
            })
            .collect()
    };
    let (stacks, drops) = (by_process(stacks), by_process(drops));
    let processes = by_process(per_process);
    assert!(processes.len() >= 4, "two daemon_target processes in two jobs: {processes:?}");
    for (process, count) in processes {
        let of = |list: &[(String, usize)]| list.iter().find(|(p, _)| *p == process).map_or(0, |(_, n)| *n);
        // The stacks' series and the rest under stack="other".
        let budget = PROCESS_SERIES + STACK_SERIES * of(&stacks) + 1 + of(&drops) + HISTOGRAM_SERIES;
        assert_eq!(count, budget, "{process}: {} stacks, {} drop reasons", of(&stacks), of(&drops));
    }
}
