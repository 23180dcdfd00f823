//! Suppressions: stacks a team has accepted, named in valgrind's suppression file format
//! (`parse`) and matched by their frames (`matching`). A suppressed stack stays in the report
//! with its bytes, but is no leak candidate and its blocks leave the inspection's classes; the
//! report counts what was suppressed, by rule (`Suppressed`). `generate` writes a rule for a
//! stack, as memcheck's `--gen-suppressions`.

mod generate;
mod matching;
mod parse;

use std::path::PathBuf;

use clap::Args;
use serde::{Deserialize, Serialize};

pub use generate::generate;
pub use parse::{ParseError, ReadError};

use crate::{
    heap::{
        inspect::Reachability,
        report::{Report, StackReport},
    },
    process::families::{self, Role},
};
use matching::Seen;

/// `--suppressions` and `--gen-suppressions`, the same for `attach`, `run` and `report`.
#[derive(Debug, Args, Clone, Default)]
pub struct SuppressionArgs {
    /// Stacks accepted, in valgrind's suppression file format (Memcheck:Leak rules): they are no
    /// leak candidates, and each report counts them by rule. Repeatable.
    #[arg(long = "suppressions", value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// After the final report, print a suppression for each leak candidate's stack and each
    /// stack with lost blocks, ready for a --suppressions file (valgrind's format).
    #[arg(long)]
    pub gen_suppressions: bool,
}

/// One rule: Memcheck:Leak, its leak kinds and its locations.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    /// `FILE:LINE` of its `{`.
    pub at: String,
    /// `match-leak-kinds:`; none matches every kind.
    pub kinds: Option<Kinds>,
    pub locations: Vec<Location>,
}

/// A suppression's location line.
#[derive(Debug, Clone, PartialEq)]
pub enum Location {
    Fun(String),
    Obj(String),
    /// A source file's name and maybe its line.
    Src(String, Option<u32>),
    /// `...`: any number of frames.
    Any,
}

/// memcheck's leak kinds a rule matches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Kinds {
    pub definite: bool,
    pub indirect: bool,
    pub possible: bool,
    pub reachable: bool,
}

impl Kinds {
    /// Every class `reachability` has blocks in is one of these kinds.
    fn cover(&self, r: &Reachability) -> bool {
        (r.definitely_lost_blocks == 0 || self.definite)
            && (r.indirectly_lost_blocks == 0 || self.indirect)
            && (r.possibly_lost_blocks == 0 || self.possible)
            && (r.reachable_blocks == 0 || self.reachable)
    }
}

/// What a report's suppressions took out (JSON `"suppressed"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Suppressed {
    pub stacks: u64,
    /// Their bytes in use.
    pub bytes: u64,
    /// Per rule, most bytes first.
    pub by_rule: Vec<RuleCount>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RuleCount {
    pub rule: String,
    pub stacks: u64,
    pub bytes: u64,
}

impl Suppressed {
    /// The count of `stacks` marked suppressed; none when none is.
    fn of(stacks: &[StackReport]) -> Option<Suppressed> {
        let mut summary = Suppressed::default();
        for stack in stacks {
            let Some(rule) = &stack.suppressed else { continue };
            summary.stacks += 1;
            summary.bytes += stack.outstanding_bytes;
            match summary.by_rule.iter_mut().find(|r| &r.rule == rule) {
                Some(count) => {
                    count.stacks += 1;
                    count.bytes += stack.outstanding_bytes;
                }
                None => {
                    summary.by_rule.push(RuleCount { rule: rule.clone(), stacks: 1, bytes: stack.outstanding_bytes })
                }
            }
        }
        summary.by_rule.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.rule.cmp(&b.rule)));
        (summary.stacks > 0).then_some(summary)
    }

    /// `2 stacks, 11,144 bytes, by rule cache (1), init (1)`.
    pub fn line(&self) -> String {
        let rules: Vec<String> = self.by_rule.iter().map(|r| format!("{} ({})", r.rule, r.stacks)).collect();
        format!("{} stacks, {} bytes, by rule {}", self.stacks, self.bytes, rules.join(", "))
    }
}

/// The rules of every suppressions file given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Suppressions {
    rules: Vec<Rule>,
    /// Every allocator entry point's name, for the frame memprof's stacks leave out.
    allocators: Vec<String>,
}

/// A file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Parse(#[from] ParseError),
}

/// The largest suppressions file read: valgrind's own for a large program are a few MiB.
const RULES_BYTES: u64 = 64 << 20;

impl Suppressions {
    /// The rules of `files`, in order.
    pub fn load(files: &[PathBuf]) -> Result<Self, LoadError> {
        let mut rules = Vec::new();
        for path in files {
            let text =
                crate::input::read_text(path, RULES_BYTES).map_err(|cause| ReadError { path: path.clone(), cause })?;
            rules.extend(parse::parse(path, &text)?);
        }
        Ok(Self::new(rules))
    }

    fn new(rules: Vec<Rule>) -> Self {
        let allocators = families::all()
            .into_iter()
            .flat_map(|f| f.entries)
            .filter(|(_, role)| matches!(role, Role::Alloc(_)))
            .map(|(name, _)| name)
            .collect();
        Self { rules, allocators }
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Marks the stacks of `report` its rules match (a stack marked already stays so): no leak
    /// candidate, no blocks in the inspection's classes; then counts every marked stack.
    pub fn apply(&self, report: &mut Report) {
        for stack in &mut report.stacks {
            if stack.suppressed.is_none() {
                stack.suppressed = self.matching(stack).map(|rule| rule.name.clone());
            }
            if stack.suppressed.is_none() {
                continue;
            }
            stack.leak.candidate = false;
            if let (Some(reachability), Some(inspection)) = (stack.reachability.take(), &mut report.inspection) {
                inspection.totals.remove(&reachability);
            }
        }
        let suppressed: std::collections::HashSet<&str> =
            report.stacks.iter().filter(|s| s.suppressed.is_some()).map(|s| s.stack_id.as_str()).collect();
        report.timeline.stacks.retain(|s| !suppressed.contains(s.stack_id.as_str()));
        report.suppressed = Suppressed::of(&report.stacks);
    }

    /// The first rule that matches `stack`.
    fn matching(&self, stack: &StackReport) -> Option<&Rule> {
        let inner = std::iter::once(Seen::Allocator(&self.allocators))
            .chain(
                stack
                    .via
                    .iter()
                    .skip_while(|name| matching::replaced_by_valgrind(name))
                    .map(|name| Seen::Wrapper(name)),
            )
            .chain(matching::frames(&stack.frames));
        let whole: Vec<Seen> = inner.collect();
        self.rules.iter().find(|rule| {
            let kinds_ok = match (rule.kinds, &stack.reachability) {
                (Some(kinds), Some(reachability)) => kinds.cover(reachability),
                // memprof's leak rule has no kinds: without an inspection a rule's kinds do not narrow it.
                _ => true,
            };
            // valgrind's stacks start at the allocator, memprof's at its caller: a rule whose
            // first frame names an allocator is matched from the allocator, others from the caller.
            let from_allocator = match rule.locations.first() {
                Some(Location::Fun(pattern)) => self.allocators.iter().any(|n| matching::glob(pattern, n)),
                _ => false,
            };
            kinds_ok && matching::sequence(&rule.locations, if from_allocator { &whole } else { &whole[1..] })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples::{frame, report};

    fn rules(text: &str) -> Suppressions {
        Suppressions::new(parse::parse(std::path::Path::new("t.supp"), text).unwrap())
    }

    fn stack(bytes: u64, functions: &[&str]) -> StackReport {
        let mut stack = report().stacks.remove(0);
        stack.outstanding_bytes = bytes;
        stack.leak.candidate = true;
        stack.frames = functions.iter().map(|f| frame(f, None, None)).collect();
        stack
    }

    #[test]
    fn matched_stacks_are_no_leak_candidates_and_are_counted_by_rule() {
        let supp = rules(
            "{\n vg\n Memcheck:Leak\n fun:malloc\n fun:cache_fill\n}\n{\n ours\n Memcheck:Leak\n fun:init_*\n ...\n fun:main\n}\n",
        );
        let mut r = report();
        r.stacks = vec![
            stack(5000, &["cache_fill", "main"]),
            stack(700, &["init_a", "setup", "main"]),
            stack(300, &["init_b", "main"]),
            stack(64, &["real_leak", "main"]),
            stack(10, &["main"]),
        ];
        supp.apply(&mut r);
        let marks: Vec<_> = r.stacks.iter().map(|s| (s.suppressed.as_deref(), s.leak.candidate)).collect();
        assert_eq!(
            marks,
            [(Some("vg"), false), (Some("ours"), false), (Some("ours"), false), (None, true), (None, true)]
        );
        let summary = r.suppressed.clone().unwrap();
        assert_eq!((summary.stacks, summary.bytes), (3, 6000));
        assert_eq!(summary.line(), "3 stacks, 6000 bytes, by rule vg (1), ours (2)");
        // Applied again (a recording rendered with the same file): the same count.
        supp.apply(&mut r);
        assert_eq!(r.suppressed, Some(summary));
    }

    #[test]
    fn a_suppressed_stacks_blocks_leave_the_inspections_classes() {
        let supp = rules("{\n lost\n Memcheck:Leak\n match-leak-kinds: definite\n fun:cache_fill\n}\n");
        let mut r = report();
        r.stacks = vec![stack(5000, &["cache_fill", "main"]), stack(64, &["real_leak", "main"])];
        let lost = |bytes, blocks| Reachability {
            definitely_lost_bytes: bytes,
            definitely_lost_blocks: blocks,
            ..Reachability::default()
        };
        r.stacks[0].reachability = Some(lost(5000, 5));
        r.stacks[1].reachability = Some(lost(64, 1));
        r.inspection = Some(crate::heap::inspect::Inspection { totals: lost(5064, 6), ..Default::default() });
        supp.apply(&mut r);
        assert_eq!(r.stacks[0].reachability, None);
        assert_eq!(r.inspection.unwrap().totals, lost(64, 1));
    }

    #[test]
    fn leak_kinds_narrow_a_rule_only_where_blocks_were_classed() {
        let supp = rules("{\n lost\n Memcheck:Leak\n match-leak-kinds: definite\n fun:cache_fill\n}\n");
        let mut r = report();
        r.stacks = vec![stack(5000, &["cache_fill", "main"])];
        let reachable = Reachability { reachable_blocks: 1, reachable_bytes: 5000, ..Reachability::default() };
        r.stacks[0].reachability = Some(reachable);
        supp.apply(&mut r);
        assert_eq!(r.stacks[0].suppressed, None, "reachable blocks are not definitely lost");
        r.stacks[0].reachability = None;
        supp.apply(&mut r);
        assert_eq!(r.stacks[0].suppressed.as_deref(), Some("lost"));
    }

    /// Debian's stripped postgres: valgrind names the static `AllocSetAlloc` under `palloc` by
    /// its object, and matches `fun:` against `???` where it knows no name. memprof folds that
    /// frame into `via` and the rule matches as valgrind's does.
    #[test]
    fn frames_without_a_name_match_as_valgrind_sees_them() {
        let postgres = "/usr/lib/postgresql/15/bin/postgres";
        let mut r = report();
        r.stacks = vec![stack(4096, &["postgres+0x362167", "list_copy_deep", "main"])];
        let frames = r.stacks[0].frames.iter().map(|f| {
            let mut f = f.clone();
            f.module = postgres.into();
            f
        });
        r.stacks[0].frames = frames.collect();
        r.stacks[0].via = vec![format!("{postgres}+0x5c7860"), "palloc".into()];
        let matched = |rule: &str| {
            let mut r = r.clone();
            rules(&format!("{{\n pg\n Memcheck:Leak\n{rule}}}\n")).apply(&mut r);
            r.stacks[0].suppressed.is_some()
        };
        assert!(matched(&format!(" fun:malloc\n obj:{postgres}\n fun:palloc\n obj:{postgres}\n fun:list_copy_deep\n")));
        assert!(matched(" fun:malloc\n fun:???\n fun:palloc\n fun:*\n fun:list_copy_deep\n"));
        assert!(!matched(" fun:malloc\n fun:AllocSetAlloc\n fun:palloc\n"));
        assert!(!matched(" fun:malloc\n obj:*/libc.so.6\n fun:palloc\n"));
    }
}
