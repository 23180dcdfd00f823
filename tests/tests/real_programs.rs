//! Real programs from Debian's archive under memprof, as a user runs them.

use std::{
    io::Write as _,
    net::TcpStream,
    process::{Command, Stdio},
};

use memprof_tests::{free_port, memprof_bin, wait_for};
use serde_json::Value;

/// Debian's redis-server links Debian's libjemalloc2: under `memprof run` its per-key
/// allocations are counted, one dict entry per key, with stacks down to `main`.
#[test]
fn redis_server_on_jemalloc_under_run() {
    const KEYS: usize = 5000;
    let port = free_port().to_string();
    let output = std::env::temp_dir().join(format!("memprof-redis-{}.json", std::process::id()));
    let memprof = Command::new(memprof_bin())
        .args(["run", "--json", "--interval", "1", "--output"])
        .arg(&output)
        .args([
            "--",
            "/usr/bin/redis-server",
            "--port",
            &port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting memprof");
    wait_for(30, "redis-server to listen", || TcpStream::connect(("127.0.0.1", port.parse().unwrap())).ok());
    let mut commands = String::new();
    for key in 0..KEYS {
        commands.push_str(&format!("SET key:{key} value-{key}\n"));
    }
    commands.push_str("SHUTDOWN NOSAVE\n");
    let mut cli = Command::new("redis-cli")
        .args(["-p", &port])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting redis-cli");
    cli.stdin.take().unwrap().write_all(commands.as_bytes()).unwrap();
    let _ = cli.wait();
    let outcome = memprof.wait_with_output().expect("memprof ends with redis-server");
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    assert!(outcome.status.success(), "{stderr}");
    assert!(stderr.contains("libjemalloc.so.2 (C library malloc, jemalloc"), "{stderr}");
    let text = std::fs::read_to_string(&output).unwrap();
    std::fs::remove_file(&output).unwrap();
    let report: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let functions = |stack: &Value| -> Vec<String> {
        stack["frames"].as_array().unwrap().iter().map(|f| f["function"].as_str().unwrap_or("").to_string()).collect()
    };
    let stacks = report["stacks"].as_array().unwrap();
    // The keyspace's entries: zmalloc in dictAddRaw called by dbAdd (other dicts, the command
    // table's, fill at start; the keyspace's own table grows from dictAddRaw too).
    let entries: Vec<&Value> = stacks
        .iter()
        .filter(|s| functions(s).get(..3) == Some(&["zmalloc", "dictAddRaw", "dbAdd"].map(String::from)[..]))
        .collect();
    let (bytes, count) = entries.iter().fold((0, 0), |(b, c), s| {
        (b + s["outstanding_bytes"].as_u64().unwrap(), c + s["outstanding_allocations"].as_u64().unwrap())
    });
    assert_eq!((bytes, count), (24 * KEYS as u64, KEYS as u64), "one 24-byte dict entry per key");
    for stack in entries {
        assert!(functions(stack).iter().any(|f| f == "main"), "down to main: {:?}", functions(stack));
        // The program is named as it was run: /usr/bin/redis-server links to redis-check-rdb.
        let main = stack["frames"].as_array().unwrap().iter().find(|f| f["function"] == "main").unwrap();
        assert_eq!(main["module"], "/usr/bin/redis-server", "{main}");
    }
    assert_eq!(report["exe"], "/usr/bin/redis-server", "{}", report["exe"]);
    assert_eq!(report["totals"]["unknown_frees"], 0, "{}", report["totals"]);
}
