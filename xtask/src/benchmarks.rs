//! BENCHMARKS.md is written by several commands: `bench` writes its own sections, and the long runs
//! (`soak`, `fuzz`, `pause`) each own one section at the end. Each keeps the others' sections. "Scale" is
//! measured with the `shared_links` test at several N and kept likewise, as is the per-program
//! breakdown of the real services' cost (measured by hand with the kernel's BPF statistics), and
//! the measurements behind design choices (by hand, cited from code comments).

use std::path::Path;

/// Sections owned by the long-running commands, kept at the end of the file in this order.
const TRAILING: [&str; 7] = [
    "## Real services: where the time goes",
    "## Scale",
    crate::pause::TITLE,
    "## Soak",
    "## Fuzzing",
    "## The first leak page at shipped defaults",
    "## Measurements behind design choices",
];

/// Splits `text` into what precedes the trailing sections and each trailing section found.
fn split(text: &str) -> (String, Vec<(&'static str, String)>) {
    let mut head = String::new();
    let mut sections: Vec<(&'static str, String)> = Vec::new();
    for line in text.split_inclusive('\n') {
        if let Some(title) = TRAILING.iter().find(|t| line.trim_end() == **t) {
            sections.push((title, String::new()));
        } else if line.starts_with("## ") {
            // A section of another command after ours: it belongs before the trailing ones.
            sections.push(("", String::new()));
        }
        match sections.last_mut() {
            Some((title, body)) if !title.is_empty() => body.push_str(line),
            _ => head.push_str(line),
        }
    }
    (head, sections)
}

/// Joins a head and trailing sections, one blank line between each.
fn join(head: &str, sections: &[(&'static str, String)]) -> String {
    let mut out = head.trim_end().to_string();
    for title in TRAILING {
        if let Some((_, body)) = sections.iter().find(|(t, _)| *t == title) {
            out.push_str("\n\n");
            out.push_str(body.trim_end());
        }
    }
    out.push('\n');
    out
}

/// Replaces (or adds) the trailing section `title`, whose text `body` starts with the title line.
pub fn write_section(path: &Path, title: &'static str, body: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let (head, mut sections) = split(&text);
    sections.retain(|(t, _)| !t.is_empty() && *t != title);
    sections.push((title, body.to_string()));
    std::fs::write(path, join(&head, &sections))?;
    Ok(())
}

/// Replaces bench's own section `title` in the file at `path` by `section` (which starts with its
/// title line), keeping everything else: for a part of the bench run alone.
pub fn replace_section(path: &Path, title: &str, section: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let Some(start) = lines.iter().position(|line| line.trim_end() == title) else {
        anyhow::bail!("{} has no section {title:?}: run the whole bench (cargo xtask bench) first", path.display());
    };
    let end = (start + 1..lines.len()).find(|&i| lines[i].starts_with("## ")).unwrap_or(lines.len());
    let mut out = lines[..start].concat().trim_end().to_string();
    if !out.is_empty() {
        out.push_str("\n\n");
    }
    out.push_str(section.trim());
    if end < lines.len() {
        out.push_str("\n\n");
        out.push_str(&lines[end..].concat());
    } else {
        out.push('\n');
    }
    std::fs::write(path, out)?;
    Ok(())
}

/// Replaces bench's own section `title` as `replace_section` does, or adds it after bench's other
/// sections where the file has none yet.
pub fn replace_or_add_section(path: &Path, title: &str, section: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    if text.lines().any(|line| line.trim_end() == title) {
        return replace_section(path, title, section);
    }
    let (head, _) = split(&text);
    let report = format!("{}\n\n{}\n", head.trim_end(), section.trim());
    std::fs::write(path, with_trailing_sections(path, &report))?;
    Ok(())
}

/// `report` (bench's own sections) followed by the trailing sections already in the file at `path`.
pub fn with_trailing_sections(path: &Path, report: &str) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let (_, sections) = split(&text);
    let kept: Vec<_> = sections.into_iter().filter(|(t, _)| !t.is_empty()).collect();
    join(report, &kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_is_replaced_and_the_others_kept_in_order() {
        let dir = std::env::temp_dir().join(format!("xtask-benchmarks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("BENCHMARKS.md");
        std::fs::write(&path, "# Benchmarks\n\n## Cost\n\nrows\n").unwrap();
        write_section(&path, "## Fuzzing", "## Fuzzing\n\nfirst\n").unwrap();
        write_section(&path, "## Soak", "## Soak\n\nflat\n").unwrap();
        write_section(&path, "## Fuzzing", "## Fuzzing\n\nsecond\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "# Benchmarks\n\n## Cost\n\nrows\n\n## Soak\n\nflat\n\n## Fuzzing\n\nsecond\n");
        let rewritten = with_trailing_sections(&path, "# Benchmarks\n\n## Cost\n\nnew rows\n");
        assert_eq!(rewritten, "# Benchmarks\n\n## Cost\n\nnew rows\n\n## Soak\n\nflat\n\n## Fuzzing\n\nsecond\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn one_of_benchs_sections_is_replaced_in_place() {
        let dir = std::env::temp_dir().join(format!("xtask-benchmarks-one-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("BENCHMARKS.md");
        std::fs::write(&path, "# Benchmarks\n\n## Cost\n\nrows\n\n## Daemon\n\nold\n\n## Soak\n\nflat\n").unwrap();
        replace_section(&path, "## Daemon", "\n## Daemon\n\nnew\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "# Benchmarks\n\n## Cost\n\nrows\n\n## Daemon\n\nnew\n\n## Soak\n\nflat\n");
        replace_section(&path, "## Soak", "## Soak\n\nstill flat\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "# Benchmarks\n\n## Cost\n\nrows\n\n## Daemon\n\nnew\n\n## Soak\n\nstill flat\n");
        assert!(replace_section(&path, "## Missing", "## Missing\n").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
