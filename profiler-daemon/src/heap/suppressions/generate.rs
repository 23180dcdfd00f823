//! `--gen-suppressions`: a rule per stack worth accepting, in valgrind's format, that both
//! memprof and valgrind match: the allocator's frame as `fun:*` (a stack does not say which
//! entry point was called), the folded wrappers valgrind does not replace, then the stack's
//! frames to `main` by the names their object files give them (valgrind matches C++ functions
//! by their mangled names; `obj:` for a frame without a name), at most valgrind's 24 locations.

use std::fmt::Write as _;

use super::{matching, parse::MAX_LOCATIONS};
use crate::heap::report::{Report, StackReport};

/// A stack a rule is written for: a leak candidate, or one with lost blocks.
fn wanted(stack: &StackReport) -> bool {
    stack.suppressed.is_none()
        && (stack.leak.candidate
            || stack.reachability.is_some_and(|r| r.definitely_lost_blocks + r.possibly_lost_blocks > 0))
}

/// The rules for the wanted stacks of `report` and its children.
pub fn generate(report: &Report) -> String {
    let mut out = String::new();
    for process in std::iter::once(report).chain(&report.children) {
        for stack in process.stacks.iter().filter(|s| wanted(s)) {
            rule(&mut out, stack);
        }
    }
    out
}

fn rule(out: &mut String, stack: &StackReport) {
    let site = stack.frames.first().map_or("no frames", |f| f.function.as_str());
    let _ = writeln!(out, "{{\n   {site} (memprof stack {})\n   Memcheck:Leak", stack.stack_id);
    if let Some(r) = &stack.reachability {
        let kinds: Vec<&str> = [
            (r.definitely_lost_blocks, "definite"),
            (r.indirectly_lost_blocks, "indirect"),
            (r.possibly_lost_blocks, "possible"),
            (r.reachable_blocks, "reachable"),
        ]
        .into_iter()
        .filter(|(blocks, _)| *blocks > 0)
        .map(|(_, kind)| kind)
        .collect();
        if !kinds.is_empty() {
            let _ = writeln!(out, "   match-leak-kinds: {}", kinds.join(","));
        }
    }
    // Up to `main`: valgrind names what is past it `(below main)`, and a rule needs no more.
    let to_main = stack.frames.iter().position(|f| f.function == "main").map_or(stack.frames.len(), |m| m + 1);
    let wrappers = stack.via.iter().skip_while(|name| matching::replaced_by_valgrind(name));
    let lines = std::iter::once("fun:*".to_string()).chain(wrappers.map(|name| format!("fun:{name}"))).chain(
        stack.frames[..to_main].iter().map(|f| {
            if matching::unnamed(f) {
                format!("obj:{}", f.module)
            } else {
                format!("fun:{}", f.mangled.as_deref().unwrap_or(&f.function))
            }
        }),
    );
    for line in lines.take(MAX_LOCATIONS) {
        let _ = writeln!(out, "   {line}");
    }
    out.push_str("}\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::{
        report::samples::{frame, report},
        suppressions::{parse::parse, Suppressions},
    };

    #[test]
    fn a_generated_rule_suppresses_its_stack() {
        let mut r = report();
        r.stacks[0].leak.candidate = true;
        r.stacks[0].via = vec!["xmalloc".into()];
        r.stacks[0].frames =
            vec![frame("leak_here", None, None), frame("main", None, None), frame("__libc_start_main", None, None)]
                .into();
        let text = generate(&r);
        assert_eq!(
            text,
            "{\n   leak_here (memprof stack 00)\n   Memcheck:Leak\n   fun:*\n   fun:xmalloc\n   fun:leak_here\n   fun:main\n}\n"
        );
        let supp = Suppressions::new(parse(std::path::Path::new("gen.supp"), &text).unwrap());
        supp.apply(&mut r);
        assert_eq!(r.stacks[0].suppressed.as_deref(), Some("leak_here (memprof stack 00)"));
        assert_eq!(generate(&r), "", "a suppressed stack needs no rule");
    }

    /// valgrind's stacks start at the operator new it replaces, and name C++ functions mangled.
    #[test]
    fn a_cpp_rule_names_functions_mangled_and_leaves_operator_new_to_the_allocators_frame() {
        let mut r = report();
        r.stacks[0].leak.candidate = true;
        r.stacks[0].via = vec!["operator new(unsigned long)".into(), "xnew".into()];
        let mut grow = frame("app::grow(int)", None, None);
        grow.mangled = Some("_ZN3app4growEi".into());
        r.stacks[0].frames = vec![grow, frame("main", None, None)].into();
        let text = generate(&r);
        assert!(text.ends_with("   fun:*\n   fun:xnew\n   fun:_ZN3app4growEi\n   fun:main\n}\n"), "{text}");
        let supp = Suppressions::new(parse(std::path::Path::new("gen.supp"), &text).unwrap());
        supp.apply(&mut r);
        assert!(r.stacks[0].suppressed.is_some(), "memprof matches its own rule");
    }
}
