//! valgrind's suppression file format, as its manual and `m_errormgr.c` read it: blocks of
//! `{`, a name, `Tool:Kind` (tools comma-separated), an optional extra line (for
//! `Memcheck:Leak`, `match-leak-kinds: ...`), one to 24 locations (`fun:`, `obj:`, `src:`,
//! `...`), `}`. Blank lines and lines starting with `#` are skipped everywhere.

use std::path::{Path, PathBuf};

use super::{Kinds, Location, Rule};

/// valgrind refuses a suppression with more locations than this.
pub const MAX_LOCATIONS: usize = 24;

/// A file that is not a suppression file: where, what, and the fix.
#[derive(Debug, thiserror::Error)]
#[error("{}:{line}: {problem}", path.display())]
pub struct ParseError {
    pub path: PathBuf,
    pub line: usize,
    pub problem: String,
}

/// A file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading the suppressions file {}: {cause}; give a readable file", path.display())]
pub struct ReadError {
    pub path: PathBuf,
    pub cause: std::io::Error,
}

/// The rules of `text`, read from `path`; those for other tools or other Memcheck kinds than
/// `Leak` are read (so that a mistake in them is still said) and left out.
pub fn parse(path: &Path, text: &str) -> Result<Vec<Rule>, ParseError> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'));
    let fail = |line: usize, problem: String| ParseError { path: path.to_path_buf(), line, problem };
    let mut rules = Vec::new();
    while let Some((at, open)) = lines.next() {
        if open != "{" {
            return Err(fail(
                at,
                format!("`{open}` is outside a suppression; each is `{{`, a name, `Tool:Kind`, frames and `}}`, each on its own line"),
            ));
        }
        let unclosed = || fail(at, "the suppression opened here has no `}`; close it".to_string());
        let (_, name) = lines.next().ok_or_else(unclosed)?;
        if name == "}" {
            return Err(fail(at, "the suppression opened here is empty; give a name, `Tool:Kind` and frames".into()));
        }
        let (kind_at, kind_line) = lines.next().ok_or_else(unclosed)?;
        let (tools, kind) =
            kind_line.split_once(':').filter(|(t, k)| !t.is_empty() && !k.is_empty()).ok_or_else(|| {
                fail(
                    kind_at,
                    format!("`{kind_line}` is not `Tool:Kind`; give the tool and the kind, e.g. `Memcheck:Leak`"),
                )
            })?;
        let ours = tools.split(',').any(|t| t == "Memcheck" || t == "*") && kind == "Leak";
        let mut kinds = None;
        let mut locations = Vec::new();
        loop {
            let (line_at, line) = lines.next().ok_or_else(unclosed)?;
            if line == "}" {
                break;
            }
            if let Some(list) = line.strip_prefix("match-leak-kinds:").filter(|_| locations.is_empty()) {
                kinds = Some(leak_kinds(list).map_err(|problem| fail(line_at, problem))?);
                continue;
            }
            if !ours && locations.is_empty() && !is_location(line) {
                // Another kind's extra line (Memcheck:Param's parameter, say).
                continue;
            }
            locations.push(location(line).map_err(|problem| fail(line_at, problem))?);
            if locations.len() > MAX_LOCATIONS {
                return Err(fail(line_at, format!("`{name}` has more than {MAX_LOCATIONS} frames, more than valgrind takes; remove frames or end with `...`")));
            }
        }
        if locations.is_empty() {
            return Err(fail(at, format!("`{name}` has no frames; give at least one fun:, obj:, src: or ... line")));
        }
        if ours {
            rules.push(Rule { name: name.to_string(), at: format!("{}:{at}", path.display()), kinds, locations });
        }
    }
    Ok(rules)
}

fn is_location(line: &str) -> bool {
    line == "..." || ["fun:", "obj:", "src:"].iter().any(|p| line.starts_with(p))
}

fn location(line: &str) -> Result<Location, String> {
    let not_one = || format!("`{line}` is not a frame; give fun:NAME, obj:PATH, src:FILE[:LINE] or ...");
    if line == "..." {
        return Ok(Location::Any);
    }
    let (prefix, pattern) = line.split_at_checked(4).ok_or_else(not_one)?;
    if pattern.is_empty() {
        return Err(not_one());
    }
    match prefix {
        "fun:" => Ok(Location::Fun(pattern.to_string())),
        "obj:" => Ok(Location::Obj(pattern.to_string())),
        "src:" => match pattern.rsplit_once(':') {
            Some((file, line)) if !file.is_empty() => {
                let line = line.parse().map_err(|_| {
                    format!("`{line}` in `src:{pattern}` is not a line number; give src:FILE or src:FILE:LINE")
                })?;
                Ok(Location::Src(file.to_string(), Some(line)))
            }
            _ => Ok(Location::Src(pattern.to_string(), None)),
        },
        _ => Err(not_one()),
    }
}

/// `match-leak-kinds:`'s list: definite, indirect, possible, reachable, or all or none.
fn leak_kinds(list: &str) -> Result<Kinds, String> {
    let mut kinds = Kinds::default();
    for word in list.split(',').map(str::trim) {
        match word {
            "definite" => kinds.definite = true,
            "indirect" => kinds.indirect = true,
            "possible" => kinds.possible = true,
            "reachable" => kinds.reachable = true,
            "all" => kinds = Kinds { definite: true, indirect: true, possible: true, reachable: true },
            "none" => kinds = Kinds::default(),
            other => {
                return Err(format!(
                    "`{other}` is not a leak kind; give a comma list of definite, indirect, possible and reachable, or all or none"
                ))
            }
        }
    }
    Ok(kinds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(text: &str) -> Result<Vec<Rule>, String> {
        parse(Path::new("team.supp"), text).map_err(|e| e.to_string())
    }

    #[test]
    fn a_valgrind_file_is_read_and_other_kinds_left_out() {
        let text = "# accepted\n{\n   cache\n   Memcheck:Leak\n   match-leak-kinds: definite,possible\n   fun:malloc\n   fun:cache_*\n   ...\n   obj:/usr/lib/lib?.so\n   src:cache.c:12\n}\n\n{\n  uninit\n  Memcheck:Param\n  write(buf)\n  fun:write\n}\n{\n  race\n  Helgrind:Race\n  fun:x\n}\n";
        let read = rules(text).unwrap();
        assert_eq!(read.len(), 1);
        let rule = &read[0];
        assert_eq!((rule.name.as_str(), rule.at.as_str()), ("cache", "team.supp:2"));
        assert_eq!(rule.kinds, Some(Kinds { definite: true, possible: true, ..Kinds::default() }));
        assert_eq!(
            rule.locations,
            [
                Location::Fun("malloc".into()),
                Location::Fun("cache_*".into()),
                Location::Any,
                Location::Obj("/usr/lib/lib?.so".into()),
                Location::Src("cache.c".into(), Some(12)),
            ]
        );
    }

    #[test]
    fn a_mistake_is_said_with_its_line_and_fix() {
        let cases = [
            ("fun:x\n", "team.supp:1: `fun:x` is outside a suppression"),
            ("{\n a\n Memcheck:Leak\n fun:x\n", "team.supp:1: the suppression opened here has no `}`"),
            ("{\n a\n Leak\n fun:x\n}\n", "team.supp:3: `Leak` is not `Tool:Kind`"),
            ("{\n a\n Memcheck:Leak\n func:x\n}\n", "team.supp:4: `func:x` is not a frame"),
            ("{\n a\n Memcheck:Leak\n}\n", "team.supp:1: `a` has no frames"),
            ("{\n a\n Memcheck:Leak\n match-leak-kinds: lost\n fun:x\n}\n", "team.supp:4: `lost` is not a leak kind"),
            ("{\n a\n Memcheck:Leak\n src:a.c:x\n}\n", "team.supp:4: `x` in `src:a.c:x` is not a line number"),
        ];
        for (text, said) in cases {
            let err = rules(text).unwrap_err();
            assert!(err.starts_with(said), "{err}");
            assert_eq!(err.lines().count(), 1);
        }
        let deep = format!("{{\n a\n Memcheck:Leak\n{}}}\n", " fun:f\n".repeat(25));
        assert!(rules(&deep).unwrap_err().contains("more than 24 frames"));
    }
}
