//! Real programs from Debian's archive under memprof, as a user runs them.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::TcpStream,
    os::unix::net::UnixStream,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::Duration,
};

use memprof_tests::{free_port, memprof_bin, released, wait_for};
use serde_json::{json, Value};

/// Debian's redis-server links Debian's libjemalloc2: under `memprof run` its per-key
/// allocations are counted, one dict entry per key, with stacks down to `main`. redis allocates
/// through `zmalloc` and its kin: every stack starts at their caller, the site.
#[test]
fn redis_server_on_jemalloc_under_run() {
    const KEYS: usize = 5000;
    // A socket of its own: a TCP port found free may be taken meanwhile by another test's
    // listener, which then gets the SETs.
    let socket = std::env::temp_dir().join(format!("memprof-redis-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let output = std::env::temp_dir().join(format!("memprof-redis-{}.json", std::process::id()));
    let memprof = Command::new(memprof_bin())
        .args(["run", "--json", "--interval", "1", "--output"])
        .arg(&output)
        .args([
            "--",
            "/usr/bin/redis-server",
            "--port",
            "0",
            "--unixsocket",
            socket.to_str().unwrap(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting memprof");
    wait_for(30, "redis-server to listen", || UnixStream::connect(&socket).ok());
    // Straight to the server, each reply read: a client that fails says so here, where a
    // redis-cli that failed silently left redis-server (and memprof with it) running.
    let mut redis = UnixStream::connect(&socket).expect("connecting to redis-server");
    redis.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut commands = String::new();
    for key in 0..KEYS {
        commands.push_str(&format!("SET key:{key} value-{key}\r\n"));
    }
    redis.write_all(commands.as_bytes()).expect("sending the SETs");
    let mut replies = BufReader::new(redis.try_clone().unwrap());
    for key in 0..KEYS {
        let mut reply = String::new();
        if let Err(err) = replies.read_line(&mut reply) {
            // Whether redis-server (and memprof with it) ended, and what memprof said.
            let mut memprof = memprof;
            let ended = memprof.try_wait().unwrap();
            let _ = memprof.kill();
            let said = memprof.wait_with_output().unwrap();
            panic!(
                "redis-server's reply to SET key:{key}: {err}; memprof had ended: {ended:?}; its stderr:\n{}",
                String::from_utf8_lossy(&said.stderr)
            );
        }
        assert_eq!(reply, "+OK\r\n", "SET key:{key}");
    }
    redis.write_all(b"SHUTDOWN NOSAVE\r\n").expect("sending SHUTDOWN");
    let outcome = memprof.wait_with_output().expect("memprof ends with redis-server");
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    assert!(outcome.status.success(), "{stderr}");
    assert!(stderr.contains("libjemalloc.so.2 (C library malloc, jemalloc"), "{stderr}");
    let text = std::fs::read_to_string(&output).unwrap();
    std::fs::remove_file(&output).unwrap();
    let _ = std::fs::remove_file(&socket);
    let report: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let stacks = report["stacks"].as_array().unwrap();
    for stack in stacks {
        let site = stack["frames"][0]["function"].as_str().unwrap_or("");
        let wrapper = ["zmalloc", "zcalloc", "zrealloc", "ztry", "zstrdup"].iter().any(|w| site.starts_with(w));
        assert!(!wrapper, "a stack starts at redis's wrapper {site}: {stack}");
    }
    let functions = unfolded;
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
        assert_eq!(stack["via"], json!(["zmalloc"]), "{stack}");
        assert!(functions(stack).iter().any(|f| f == "main"), "down to main: {:?}", functions(stack));
        // The program is named as it was run: /usr/bin/redis-server links to redis-check-rdb.
        let main = stack["frames"].as_array().unwrap().iter().find(|f| f["function"] == "main").unwrap();
        assert_eq!(main["module"], "/usr/bin/redis-server", "{main}");
    }
    assert_eq!(report["exe"], "/usr/bin/redis-server", "{}", report["exe"]);
    assert_eq!(report["totals"]["unknown_frees"], 0, "{}", report["totals"]);
}

/// redis-server (jemalloc) inspected by `memprof attach --inspect` while it serves: keys set before
/// memprof attaches and while it traces, a client counting all along. The classes are memcheck's
/// for a program that loses nothing: each key set while traced has a dict entry and a value
/// (an embedded string object) reachable from the keyspace's table, and its name, an sds string,
/// which the dict entry points to past its header: only interior pointers, so possibly lost, as
/// memcheck says of redis's keys (a few are reached at their start too, by stale words the
/// conservative scan finds). After the inspection the server answers, every key holds its value,
/// the count is the number of increments it acknowledged, and it exits on SHUTDOWN with 0, as
/// without memprof.
#[test]
fn redis_server_inspected_while_it_serves_runs_on_unharmed() {
    const KEYS: u64 = 1000;
    let port = free_port();
    let mut server = Running(
        Command::new("/usr/bin/redis-server")
            .args(["--port", &port.to_string(), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("starting redis-server"),
    );
    let pid = server.0.id().to_string();
    let mut client = wait_for(30, "redis-server to listen", || Redis::connect(port));
    client.set_keys(0..KEYS);

    let stop = AtomicBool::new(false);
    let (outcome, counted) = thread::scope(|s| {
        // A millisecond apart: the server serves while traced and inspected, not a load test.
        let counter = s.spawn(|| {
            let mut counter = Redis::connect(port).expect("a second connection");
            let mut acknowledged = 0;
            while !stop.load(Ordering::Relaxed) {
                acknowledged += 1;
                assert_eq!(counter.call("INCR counter"), Reply::Integer(acknowledged));
                thread::sleep(Duration::from_millis(1));
            }
            acknowledged
        });
        let mut memprof = Command::new(memprof_bin());
        memprof.args([
            "attach",
            "--pid",
            &pid,
            "--max-rate",
            "off",
            "--json",
            "--inspect",
            "--duration",
            "2",
            "--interval",
            "1",
        ]);
        let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| client.set_keys(KEYS..2 * KEYS));
        stop.store(true, Ordering::Relaxed);
        (outcome, counter.join().expect("the counting client"))
    });
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains(&format!("memprof: inspected pid {pid}:")), "{}", outcome.stderr);

    let report = outcome.final_report();
    let inspection = &report["inspection"];
    assert!(inspection["pause_ms"].as_f64().unwrap() > 0.0, "{inspection}");
    assert!(inspection["root_bytes_scanned"].as_u64().unwrap() > 0, "{inspection}");
    assert!(inspection["block_bytes_scanned"].as_u64().unwrap() > 0, "{inspection}");
    // jemalloc's malloc, not glibc's, though the C library is mapped: no walk of glibc's chunks.
    assert!(inspection["untracked_blocks"].is_null(), "{inspection}");
    // The report's figures are read after the inspection, while redis runs on (its cron resizes
    // client buffers ten times a second): its bytes in use are not the classes' sum, which is of
    // the blocks live at the stop (docs: guide/inspect.md#inspect-what-is-really-lost). The keys' stacks, still
    // since they were set, have every block in one class.
    let totals = &inspection["totals"];
    let class = |name: &str| totals[format!("{name}_bytes")].as_u64().unwrap();
    assert_eq!((class("definitely_lost"), class("indirectly_lost")), (0, 0), "{inspection}");
    assert!(class("reachable") > 0, "{inspection}");
    let reachable = |bytes: u64| {
        json!({
            "definitely_lost_bytes": 0, "definitely_lost_blocks": 0, "indirectly_lost_bytes": 0,
            "indirectly_lost_blocks": 0, "possibly_lost_bytes": 0, "possibly_lost_blocks": 0,
            "reachable_bytes": bytes * KEYS, "reachable_blocks": KEYS, "retained_bytes": 0,
        })
    };
    assert_eq!(reachability(&report, &["zmalloc", "dictAddRaw", "dbAdd"]), &reachable(24), "dict entries");
    let values = ["zmalloc", "createEmbeddedStringObject", "tryObjectEncoding", "setCommand"];
    assert_eq!(reachability(&report, &values), &reachable(30), "values");
    let names = reachability(&report, &["zmalloc_usable", "_sdsnewlen", "dbAdd"]);
    let blocks = |class: &str| names[format!("{class}_blocks")].as_u64().unwrap();
    assert_eq!((blocks("definitely_lost"), blocks("indirectly_lost")), (0, 0), "key names: {names}");
    assert_eq!(blocks("possibly_lost") + blocks("reachable"), KEYS, "key names: {names}");
    assert!(blocks("possibly_lost") > blocks("reachable"), "key names: {names}");

    assert_eq!(client.call("PING"), Reply::Simple("PONG".into()));
    let keys: Vec<String> = (0..2 * KEYS).map(|key| format!("key:{key}")).collect();
    let values = client.call(&format!("MGET {}", keys.join(" ")));
    let expected = (0..2 * KEYS).map(|key| Reply::Bulk(Some(format!("value-{key}")))).collect();
    assert!(values == Reply::Array(expected), "a value changed: {values:?}");
    assert_eq!(client.call("GET counter"), Reply::Bulk(Some(counted.to_string())));
    client.send("SHUTDOWN NOSAVE");
    assert_eq!(server.0.wait().unwrap().code(), Some(0));
}

/// A stack's functions innermost first, the allocation wrappers folded into the allocator
/// (`via`) included.
fn unfolded(stack: &Value) -> Vec<String> {
    let via = stack["via"].as_array().map(Vec::as_slice).unwrap_or_default().iter();
    let frames = stack["frames"].as_array().unwrap().iter().map(|f| &f["function"]);
    via.chain(frames).map(|name| name.as_str().unwrap_or("").to_string()).collect()
}

/// The `"reachability"` of the one stack whose innermost frames, wrappers included, are
/// `innermost`, which classes every byte it has in use.
fn reachability<'a>(report: &'a Value, innermost: &[&str]) -> &'a Value {
    let stacks: Vec<&Value> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            let functions = unfolded(s);
            functions.len() >= innermost.len() && functions.iter().zip(innermost).all(|(f, name)| f == name)
        })
        .collect();
    assert_eq!(stacks.len(), 1, "one stack from {innermost:?}");
    let reachability = &stacks[0]["reachability"];
    let classified: u64 = ["definitely_lost", "indirectly_lost", "possibly_lost", "reachable"]
        .iter()
        .map(|class| reachability[format!("{class}_bytes")].as_u64().unwrap())
        .sum();
    assert_eq!(classified, stacks[0]["outstanding_bytes"].as_u64().unwrap(), "{innermost:?}: {reachability}");
    reachability
}

/// A server killed if the test ends before it: it holds the test's stderr.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A connection to redis-server: commands sent inline, replies read in RESP.
struct Redis {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

#[derive(Debug, PartialEq)]
enum Reply {
    Simple(String),
    Integer(i64),
    Bulk(Option<String>),
    Array(Vec<Reply>),
}

impl Redis {
    fn connect(port: u16) -> Option<Self> {
        let writer = TcpStream::connect(("127.0.0.1", port)).ok()?;
        writer.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
        // A command and its answer at once, not after the peer's delayed acknowledgement.
        writer.set_nodelay(true).ok()?;
        Some(Self { reader: BufReader::new(writer.try_clone().ok()?), writer })
    }

    fn send(&mut self, command: &str) {
        self.writer.write_all(format!("{command}\r\n").as_bytes()).expect("sending to redis-server");
    }

    fn call(&mut self, command: &str) -> Reply {
        self.send(command);
        self.reply()
    }

    /// `SET key:N value-N` for each N of `keys`, sent at once, each acknowledged.
    fn set_keys(&mut self, keys: std::ops::Range<u64>) {
        let commands: String = keys.clone().map(|key| format!("SET key:{key} value-{key}\r\n")).collect();
        self.writer.write_all(commands.as_bytes()).expect("sending to redis-server");
        for _ in keys {
            assert_eq!(self.reply(), Reply::Simple("OK".into()));
        }
    }

    fn reply(&mut self) -> Reply {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("reading redis-server's reply");
        let line = line.strip_suffix("\r\n").unwrap_or_else(|| panic!("not a reply: {line:?}"));
        let (kind, rest) = line.split_at(1);
        let number = || rest.parse::<i64>().unwrap_or_else(|_| panic!("not a number: {line:?}"));
        match kind {
            "+" => Reply::Simple(rest.to_string()),
            "-" => panic!("redis-server refused a command: {rest}"),
            ":" => Reply::Integer(number()),
            "$" if number() < 0 => Reply::Bulk(None),
            "$" => {
                let mut bulk = vec![0; number() as usize + 2];
                self.reader.read_exact(&mut bulk).expect("reading a bulk reply");
                bulk.truncate(bulk.len() - 2);
                Reply::Bulk(Some(String::from_utf8(bulk).expect("a value in UTF-8")))
            }
            "*" => Reply::Array((0..number()).map(|_| self.reply()).collect()),
            _ => panic!("not a reply: {line:?}"),
        }
    }
}
