//! The book's command-line page and the man pages say what the binary says.

use std::process::Command;

use memprof_tests::{memprof, workspace};

/// The `## memprof ...` headings of the committed page, each with its text block.
fn documented_commands(page: &str) -> Vec<(String, String)> {
    let mut commands = Vec::new();
    let mut sections = page.split("\n## ").skip(1);
    for section in sections.by_ref() {
        let (title, body) = section.split_once('\n').unwrap_or((section, ""));
        let block = body.split_once("```text\n").and_then(|(_, rest)| rest.split_once("\n```")).map(|(block, _)| block);
        commands.push((title.to_string(), block.unwrap_or_else(|| panic!("{title}: no text block")).to_string()));
    }
    commands
}

/// docs/src/reference/cli.md holds each command's `--help`, as the binary under test prints it,
/// for every command `memprof --help` lists: a flag added, changed or removed without
/// `cargo xtask docs` fails here.
#[test]
fn the_cli_reference_is_each_commands_help() {
    let page = std::fs::read_to_string(workspace().join("docs/src/reference/cli.md")).unwrap();
    let documented = documented_commands(&page);
    let top = memprof(&["--help"]).stdout;
    let listed: Vec<String> = top
        .split_once("Commands:\n")
        .expect("memprof --help lists its commands")
        .1
        .lines()
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(|name| format!("memprof {name}"))
        .collect();
    let titles: Vec<&str> = documented.iter().map(|(title, _)| title.as_str()).collect();
    assert_eq!(titles[0], "memprof");
    assert_eq!(titles[1..], listed.iter().map(String::as_str).collect::<Vec<_>>()[..], "run cargo xtask docs");
    for (title, block) in &documented {
        let words: Vec<&str> = title.split(' ').skip(1).chain(["--help"]).collect();
        let help = memprof(&words);
        assert!(help.status.success(), "{title} --help: {help:?}");
        assert_eq!(help.stdout.trim_end(), block, "{title}: the page differs from --help: run cargo xtask docs");
    }
}

/// memprof(1) names only pages that exist: each subcommand's, and no memprof-help(1) (clap's
/// `help` subcommand, which `memprof --help` describes). `man -l` renders each without a warning.
#[test]
fn the_man_pages_name_only_pages_that_exist() {
    let dir = std::env::temp_dir().join(format!("memprof-man-{}", std::process::id()));
    let made = memprof(&["man", dir.to_str().unwrap()]);
    assert!(made.status.success(), "{made:?}");
    let mut pages: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    pages.sort();
    let main = std::fs::read_to_string(dir.join("memprof.1")).unwrap();
    for page in &pages {
        let rendered =
            Command::new("man").args(["-l", "-P", "cat"]).arg(dir.join(page)).env("MANWIDTH", "100").output().unwrap();
        let stderr = String::from_utf8_lossy(&rendered.stderr);
        assert!(rendered.status.success() && stderr.is_empty(), "{page}: {stderr}");
        if let Some(name) = page.strip_suffix(".1").and_then(|name| name.strip_prefix("memprof-")) {
            assert!(main.contains(&format!("memprof\\-{name}(1)")), "memprof.1 does not name {page}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let named = main.matches("(1)").count();
    assert_eq!(named, pages.len() - 1, "memprof.1 names {named} pages; there are {pages:?}");
    assert!(!main.contains("memprof\\-help"), "memprof.1 names memprof-help(1), which does not exist");
}
