//! memprof killed by SIGKILL at any moment of an `--inspect` at defaults leaves its target as it
//! would have been: the default methods inject nothing into the process, and the kernel lets the
//! threads memprof held still go when memprof dies.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use memprof_tests::{fixture_with, memprof_bin, Waiting};

/// Inspections killed.
const TRIALS: u64 = 30;

/// The kill comes at a random moment up to this long after the target is first seen held still,
/// in every other trial: longer than the hold of this target on a loaded 2-core machine, so that
/// kills land in the hold, at its end and just after it.
const KILL_WITHIN: Duration = Duration::from_millis(40);

/// In the other trials, up to this long: the first millisecond or two, where the first brief
/// stop of `--inspect-precopy write-protect` injected its calls (1 target in 12 so killed died
/// of SIGTRAP).
const KILL_EARLY_WITHIN: Duration = Duration::from_millis(2);

/// The pid of `pid`'s tracer, 0 when none holds it (`TracerPid:` of its status).
fn tracer(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("TracerPid:")).and_then(|v| v.trim().parse().ok())
}

/// A generator of numbers good enough to spread the kills (xorshift).
struct Moments(u64);

impl Moments {
    fn next_below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// `write_watch.c --big` (32 MiB of heap, above which `--inspect` pre-copies by default; threads
/// writing it from user space and through read(2), two more waiting in read(2)) under
/// `memprof attach --inspect` at defaults, memprof SIGKILLed at a random moment after it first
/// holds the process still: every target prints what it prints alone and exits with its own
/// code (3).
#[test]
fn memprof_killed_at_any_moment_of_an_inspection_leaves_the_target_as_it_was() {
    let fixture = fixture_with("write_watch.c", "write_watch_kill", &["-O2", "-pthread"]);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos() as u64;
    let mut moments = Moments((u64::from(std::process::id()) << 32 | nanos) | 1);
    let mut killed_in_hold = 0;
    for trial in 0..TRIALS {
        let mut target = Waiting::start(&fixture, &["--big"]);
        let pid = target.pid();
        let mut memprof = Command::new(memprof_bin())
            .args([
                "attach",
                "--pid",
                &pid.to_string(),
                "--max-rate",
                "off",
                "--json",
                "--inspect",
                "--duration",
                "0.2",
                "--interval",
                "0.2",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting memprof");
        let mut stderr = BufReader::new(memprof.stderr.take().unwrap());
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            assert_ne!(stderr.read_line(&mut line).unwrap(), 0, "memprof ended before tracing: {seen}");
            seen.push_str(&line);
            if line.contains("memprof: tracing pid") {
                break;
            }
        }
        // Drained, so that memprof never blocks on a full pipe.
        let drain = thread::spawn(move || {
            let mut rest = String::new();
            let _ = stderr.read_to_string(&mut rest);
            rest
        });
        target.go();
        // Held still, or memprof gone: it ends soon after the inspection.
        let waited = Instant::now();
        while tracer(pid) == Some(0) && memprof.try_wait().unwrap().is_none() {
            assert!(waited.elapsed() < Duration::from_secs(60), "trial {trial}: no inspection began");
            thread::sleep(Duration::from_micros(20));
        }
        let within = if trial % 2 == 0 { KILL_EARLY_WITHIN } else { KILL_WITHIN };
        thread::sleep(Duration::from_micros(moments.next_below(within.as_micros() as u64)));
        if tracer(pid).is_some_and(|t| t != 0) {
            killed_in_hold += 1;
        }
        let _ = memprof.kill();
        memprof.wait().unwrap();
        drain.join().unwrap();
        let child = &mut target.child;
        child.stdin.as_mut().unwrap().write_all(b"end\n").unwrap();
        let mut rest = String::new();
        child.stdout.as_mut().unwrap().read_to_string(&mut rest).unwrap();
        let status = child.wait().unwrap();
        assert_eq!((rest.as_str(), status.code()), ("set\ndone ok\n", Some(3)), "trial {trial}: {status}");
    }
    eprintln!("{killed_in_hold} of {TRIALS} kills came while the target was held still");
    assert!(killed_in_hold > 0, "no kill came while the target was held still");
}
