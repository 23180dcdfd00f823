//! `--live`: each interval's report drawn in place on a terminal (a pseudo-terminal made by
//! `script`), on tests/fixtures/reports.c, whose truth is known: grow_site grows by 4096 bytes
//! every 100 ms for 2.4 s (a leak candidate once the rule has seen six 0.2 s intervals),
//! hold_site holds 10 x 1000 bytes from the start.

use std::process::Command;

use memprof_tests::{fixture, memprof, memprof_bin};

/// The terminal's size: rows and columns.
const ROWS: usize = 12;
const COLUMNS: usize = 70;

/// `memprof ARGS` as a shell command.
fn memprof_command(args: &[&str]) -> String {
    std::iter::once(memprof_bin().to_str().unwrap()).chain(args.iter().copied()).collect::<Vec<_>>().join(" ")
}

/// What `memprof ARGS` writes to a terminal of `ROWS` x `COLUMNS`, through `script`.
fn on_a_terminal(args: &[&str]) -> String {
    in_a_terminal(&memprof_command(args))
}

/// What the shell command `run` writes to a terminal of `ROWS` x `COLUMNS`.
fn in_a_terminal(run: &str) -> String {
    let command = format!("stty rows {ROWS} cols {COLUMNS}; {run}");
    let output = Command::new("script").args(["-qfec", &command, "/dev/null"]).output().expect("running script");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{text}\n{}", String::from_utf8_lossy(&output.stderr));
    text
}

#[test]
fn the_screen_is_redrawn_in_place_with_leak_candidates_first_then_the_final_report() {
    let program = fixture("reports");
    let text = on_a_terminal(&["run", "--live", "--interval", "0.2", "--", program.to_str().unwrap()]);
    let (live, after) =
        text.split_once("\x1b[?25h\x1b[?1049l").unwrap_or_else(|| panic!("never left the screen: {text:?}"));
    assert!(live.contains("\x1b[?1049h"), "the alternate screen: {live:?}");
    // Each screen ends with a clear of what is below it; memprof's messages may follow.
    let screens: Vec<&str> = live.split("\x1b[H").skip(1).map(|s| s.split("\x1b[J").next().unwrap()).collect();
    assert!(screens.len() >= 5, "redrawn every interval: {} screens", screens.len());
    let last = screens.last().unwrap();
    assert!(last.contains("every call traced"), "{last}");
    // The leak candidate first, above the larger block set held from the start... once it is one.
    let rows: Vec<&str> = last.lines().skip(4).collect();
    assert!(rows[0].contains("!  grow_site (reports.c:"), "{last}");
    assert!(
        rows.iter().any(|r| r.contains(&format!("{:>12} {:>9}        hold_site (reports.c:", 10_000, 10))),
        "{last}"
    );
    for screen in &screens {
        let lines: Vec<&str> =
            screen.lines().map(|l| l.trim_end_matches(['\r', '\n']).trim_end_matches("\x1b[K")).collect();
        assert!(lines.len() <= ROWS + 1, "fits the terminal's rows: {screen}");
        assert!(lines.iter().all(|l| l.chars().count() <= COLUMNS), "fits its columns: {screen}");
    }
    // Then the usual final report, on the main screen.
    assert!(after.contains("final report after"), "{after}");
    assert!(after.contains("grow_site (reports.c:"), "{after}");
}

#[test]
fn live_without_a_terminal_is_refused_in_one_line() {
    let outcome = memprof(&["run", "--live", "--", "true"]);
    assert!(!outcome.status.success());
    assert_eq!(outcome.stderr.lines().count(), 1, "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("--live draws on a terminal, and standard output is not one"),
        "{}",
        outcome.stderr
    );
}

#[test]
fn ctrl_c_ends_the_view_with_the_final_report() {
    let memprof = memprof_command(&["run", "--live", "--interval", "0.2", "--", "sleep", "30"]);
    // Ctrl-C at the terminal signals the whole foreground group; memprof alone here, as `kill -INT`,
    // a second after its command runs `sleep` (memprof's start takes longer on a loaded machine).
    let text = in_a_terminal(&format!(
        "{memprof} & m=$!; for i in $(seq 300); do c=$(cut -d' ' -f1 /proc/$m/task/$m/children 2>/dev/null); \
         [ -n \"$c\" ] && grep -qx sleep /proc/$c/comm 2>/dev/null && break; sleep 0.1; done; \
         sleep 1; kill -INT $m; wait $m"
    ));
    let (live, after) =
        text.split_once("\x1b[?25h\x1b[?1049l").unwrap_or_else(|| panic!("never left the screen: {text:?}"));
    assert!(live.contains("\x1b[Hmemprof: pid "), "a screen was drawn: {live:?}");
    assert!(after.contains("(sleep) final report after"), "{after}");
}
