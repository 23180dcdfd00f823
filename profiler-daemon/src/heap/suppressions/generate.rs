//! `--gen-suppressions`: a rule per stack worth accepting, in valgrind's format, that both
//! memprof and valgrind match: the allocator's frame as `fun:*` (a stack does not say which
//! entry point was called), the folded wrappers valgrind does not replace, then the stack's
//! frames to `main` by the names their object files give them (valgrind matches C++ functions
//! by their mangled names; `obj:` for a frame without a name), at most valgrind's 24 locations.

use std::fmt::Write as _;

use super::{matching, parse::MAX_LOCATIONS};
use crate::{
    heap::report::{Report, StackReport},
    symbolize::names_no_function,
};

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
    let mut wrappers: Vec<String> = Vec::new();
    for name in stack.via.iter().skip_while(|name| matching::replaced_by_valgrind(name)) {
        // A folded function without a symbol, which valgrind may name otherwise or not at all:
        // any frames.
        let line = if names_no_function(name) { "...".to_string() } else { format!("fun:{name}") };
        if wrappers.last() != Some(&line) {
            wrappers.push(line);
        }
    }
    let lines = std::iter::once("fun:*".to_string()).chain(wrappers).chain(stack.frames[..to_main].iter().map(|f| {
        if f.is_unnamed() {
            format!("obj:{}", f.module)
        } else {
            format!("fun:{}", f.mangled.as_deref().unwrap_or(&f.function))
        }
    }));
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

    /// A stripped program's static allocator function, folded under its wrapper: valgrind
    /// names it otherwise or not at all, so the rule takes any frames for it. Its frames
    /// without a name are their modules, as valgrind's `obj:` names them.
    #[test]
    fn a_folded_function_without_a_name_is_any_frames() {
        let mut r = report();
        r.stacks[0].leak.candidate = true;
        r.stacks[0].via = vec!["postgres+0x5c7860".into(), "postgres+0x5c7a00".into(), "palloc".into()];
        let mut caller = frame("postgres+0x362167", None, None);
        caller.module = "/usr/lib/postgresql/15/bin/postgres".into();
        r.stacks[0].frames = vec![caller, frame("main", None, None)].into();
        let text = generate(&r);
        assert!(
            text.ends_with(
                "   fun:*\n   ...\n   fun:palloc\n   obj:/usr/lib/postgresql/15/bin/postgres\n   fun:main\n}\n"
            ),
            "{text}"
        );
        let supp = Suppressions::new(parse(std::path::Path::new("gen.supp"), &text).unwrap());
        supp.apply(&mut r);
        assert!(r.stacks[0].suppressed.is_some(), "memprof matches its own rule");
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
