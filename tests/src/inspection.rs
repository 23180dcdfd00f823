//! What `--inspect` tests read of a report (a stack's classes) and the truth they compare it with:
//! valgrind's memcheck on the same fixture.

use std::{
    collections::BTreeMap,
    io::Write as _,
    path::Path,
    process::{Command, Stdio},
};

use serde_json::{json, Value};

/// A stack's `"reachability"`: bytes and blocks definitely lost, indirectly lost, possibly lost
/// and reachable, and the bytes retained.
pub fn reach(dl: (u64, u64), il: (u64, u64), pl: (u64, u64), r: (u64, u64), retained: u64) -> Value {
    json!({
        "definitely_lost_bytes": dl.0, "definitely_lost_blocks": dl.1,
        "indirectly_lost_bytes": il.0, "indirectly_lost_blocks": il.1,
        "possibly_lost_bytes": pl.0, "possibly_lost_blocks": pl.1,
        "reachable_bytes": r.0, "reachable_blocks": r.1,
        "retained_bytes": retained,
    })
}

/// The one stack through `function` (a C function, or a C++ one named with its parameters).
pub fn stack<'a>(report: &'a Value, function: &str) -> &'a Value {
    let stacks: Vec<&Value> = report["stacks"]
        .as_array()
        .expect("stacks")
        .iter()
        .filter(|s| s["frames"].as_array().expect("frames").iter().any(|f| named(&f["function"], function)))
        .collect();
    assert_eq!(stacks.len(), 1, "one stack through {function}: {report}");
    stacks[0]
}

fn named(frame: &Value, function: &str) -> bool {
    frame.as_str().is_some_and(|f| f == function || f.strip_prefix(function).is_some_and(|rest| rest.starts_with('(')))
}

pub fn reachability<'a>(report: &'a Value, function: &str) -> &'a Value {
    &stack(report, function)["reachability"]
}

/// What memcheck said of a run: per site, its loss records (class to bytes and blocks; for
/// definitely lost, the bytes retained too), and its "reachable via heuristic" lines.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Memcheck {
    pub sites: BTreeMap<String, Value>,
    /// Per heuristic name: bytes and blocks.
    pub via_heuristic: BTreeMap<String, (u64, u64)>,
}

/// valgrind's memcheck on `fixture` (a C++ fixture that makes its blocks at once, prints "set",
/// and exits on a line of stdin) with `--leak-check-heuristics=HEURISTICS`, at its exit: each of
/// `sites` (the first of them on a loss record's stack names it) as a `"reachability"`. None
/// where valgrind is not installed (it is by `cargo xtask setup`; under CI that fails).
///
/// The fixture runs under a copy of its loader and libraries: memprof's probes in the host's
/// libc (a daemon's, or another test's) are breakpoints that valgrind would run into.
pub fn memcheck(fixture: &Path, heuristics: &str, sites: &[&str]) -> Option<Memcheck> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "valgrind is not installed: run `cargo xtask setup`");
        eprintln!("valgrind is not installed: the fixture's truth is not checked against it");
        return None;
    }
    let dir = std::env::temp_dir().join(format!(
        "memprof-memcheck-{}-{}-{heuristics}",
        std::process::id(),
        fixture.file_name().unwrap().to_string_lossy()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let ldd = Command::new("ldd").arg(fixture).output().expect("ldd");
    let mut loader = None;
    for path in String::from_utf8_lossy(&ldd.stdout).split_whitespace().filter(|w| w.starts_with('/')) {
        let copy = dir.join(Path::new(path).file_name().unwrap());
        std::fs::copy(path, &copy).expect("copying a library");
        if path.contains("/ld-linux") {
            loader = Some(copy);
        }
    }
    let log = dir.join("memcheck.log");
    let mut valgrind = Command::new("valgrind")
        .args(["--leak-check=full", "--show-leak-kinds=all"])
        .arg(format!("--leak-check-heuristics={heuristics}"))
        .arg(format!("--log-file={}", log.display()))
        .arg(loader.expect("the fixture's loader"))
        .arg("--library-path")
        .arg(&dir)
        .arg(fixture)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting valgrind");
    valgrind.stdin.take().unwrap().write_all(b"end\n").unwrap();
    let out = valgrind.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "set\ndone ok\n");
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Some(parse(&text, sites))
}

fn parse(log: &str, sites: &[&str]) -> Memcheck {
    let mut found = Memcheck::default();
    // Each line without valgrind's `==PID== ` prefix.
    let lines: Vec<&str> = log.lines().map(|l| l.split_once("== ").map_or(l, |(_, rest)| rest)).collect();
    for (at, line) in lines.iter().enumerate() {
        if let Some(record) = line.split_once(" in loss record ").map(|(record, _)| record) {
            let site = lines[at + 1..]
                .iter()
                .take_while(|l| !l.is_empty())
                .find_map(|frame| {
                    let function = Value::from(frame.split_once(": ")?.1.split(' ').next()?);
                    sites.iter().find(|site| named(&function, site))
                })
                .copied();
            if let Some(site) = site {
                let entry =
                    found.sites.entry(site.to_string()).or_insert_with(|| reach((0, 0), (0, 0), (0, 0), (0, 0), 0));
                record_into(entry, record);
            }
        } else if let Some((name, counts)) = line.trim().split_once(": ") {
            let name = name.trim();
            if ["stdstring", "length64", "newarray", "multipleinheritance"].contains(&name) {
                let numbers: Vec<u64> = counts.split(' ').filter_map(|w| w.replace(',', "").parse().ok()).collect();
                found.via_heuristic.insert(name.to_string(), (numbers[0], numbers[1]));
            }
        }
    }
    found
}

/// `64 (16 direct, 48 indirect) bytes in 1 blocks are definitely lost` added to `entry`.
fn record_into(entry: &mut Value, record: &str) {
    let numbers: Vec<u64> = record
        .split(|c: char| !c.is_ascii_digit() && c != ',')
        .filter_map(|w| w.replace(',', "").parse().ok())
        .collect();
    let (total, direct, blocks) = match numbers[..] {
        [total, direct, _indirect, blocks] => (total, direct, blocks),
        [bytes, blocks] => (bytes, bytes, blocks),
        _ => panic!("a loss record: {record}"),
    };
    let class = [
        ("definitely lost", "definitely_lost"),
        ("indirectly lost", "indirectly_lost"),
        ("possibly lost", "possibly_lost"),
        ("still reachable", "reachable"),
    ]
    .iter()
    .find(|(words, _)| record.ends_with(words))
    .map(|(_, key)| *key)
    .unwrap_or_else(|| panic!("a loss record's class: {record}"));
    let add = |entry: &mut Value, key: String, n: u64| entry[&key] = json!(entry[&key].as_u64().unwrap() + n);
    add(entry, format!("{class}_bytes"), direct);
    add(entry, format!("{class}_blocks"), blocks);
    if class == "definitely_lost" {
        add(entry, "retained_bytes".into(), total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_records_and_heuristics_are_read_per_site() {
        let log = "\
==1== 64 (16 direct, 48 indirect) bytes in 1 blocks are definitely lost in loss record 6 of 7
==1==    at 0x48407B4: malloc (vg_replace_malloc.c:381)
==1==    by 0x48014D2: lost_holder() (heuristics.cpp:96)
==1==    by 0x480155A: make() (heuristics.cpp:126)
==1== 
==1== 1,072 bytes in 3 blocks are still reachable in loss record 7 of 7
==1==    by 0x480141D: array_payload() (heuristics.cpp:76)
==1== 
==1==                       of which reachable via heuristic:
==1==                         newarray           : 56 bytes in 1 blocks
";
        let found = parse(log, &["lost_holder", "array_payload", "make"]);
        assert_eq!(found.sites["lost_holder"], reach((16, 1), (0, 0), (0, 0), (0, 0), 64));
        assert_eq!(found.sites["array_payload"], reach((0, 0), (0, 0), (0, 0), (1072, 3), 0));
        assert_eq!(found.via_heuristic, BTreeMap::from([("newarray".to_string(), (56, 1))]));
    }
}
