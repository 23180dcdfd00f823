//! A rule's locations against a stack, as valgrind matches them: from the innermost frame out,
//! `...` standing for any number of frames, names compared as globs (`*`, `?`, `\` escaping).

use super::Location;
use crate::symbolize::{names_no_function, Frame};

/// One frame as a rule sees it.
#[derive(Debug, Clone, Copy)]
pub enum Seen<'a> {
    /// The allocator's entry point, which memprof's stacks leave out: any allocator name
    /// matches it, since a stack does not say which entry point was called.
    Allocator(&'a [String]),
    /// A wrapper folded into the allocator (`via`): a function name, or a function without a
    /// name as its module's path and offset (see `Wrappers::fold`).
    Wrapper(&'a str),
    Frame(&'a Frame),
    /// A frame past `main`, which valgrind names `(below main)`.
    BelowMain(&'a Frame),
}

impl Seen<'_> {
    fn matches(&self, location: &Location) -> bool {
        match (self, location) {
            (_, Location::Any) => true,
            (Seen::Allocator(names), Location::Fun(pattern)) => names.iter().any(|n| glob(pattern, n)),
            (Seen::Wrapper(name), Location::Fun(pattern)) if names_no_function(name) => glob(pattern, UNNAMED),
            (Seen::Wrapper(name), Location::Fun(pattern)) => fun(pattern, name),
            (Seen::Wrapper(name), Location::Obj(pattern)) => {
                name.rsplit_once("+0x").is_some_and(|(module, _)| names_no_function(name) && glob(pattern, module))
            }
            (Seen::Frame(frame), Location::Fun(pattern)) if frame.is_unnamed() => glob(pattern, UNNAMED),
            (Seen::Frame(frame), Location::Fun(pattern)) => {
                fun(pattern, &frame.function) || frame.mangled.as_deref().is_some_and(|m| glob(pattern, m))
            }
            (Seen::BelowMain(frame), Location::Fun(pattern)) => {
                glob(pattern, BELOW_MAIN) || Seen::Frame(frame).matches(location)
            }
            (Seen::Frame(frame) | Seen::BelowMain(frame), Location::Obj(pattern)) => glob(pattern, &frame.module),
            (Seen::Frame(frame) | Seen::BelowMain(frame), Location::Src(pattern, line)) => {
                let file = frame.file.as_deref().map(|f| f.rsplit('/').next().unwrap_or(f));
                file.is_some_and(|f| glob(pattern, f)) && line.is_none_or(|l| frame.line == Some(l))
            }
            _ => false,
        }
    }
}

/// Whether valgrind replaces the function `name` (mangled or demangled), so that its stacks
/// start there: the C library's malloc family and C++'s operator new. memprof may fold such a
/// function as a wrapper of the allocator it probes (libstdc++'s operator new calls malloc): the
/// allocator's frame stands for it, in a rule as in valgrind's stacks.
pub fn replaced_by_valgrind(name: &str) -> bool {
    matches!(
        name,
        "malloc"
            | "calloc"
            | "realloc"
            | "reallocarray"
            | "memalign"
            | "aligned_alloc"
            | "posix_memalign"
            | "valloc"
            | "pvalloc"
    ) || name.starts_with("_Znw")
        || name.starts_with("_Zna")
        || name.starts_with("operator new")
}

/// The name valgrind matches a `fun:` line against where it knows no function: `fun:*` and
/// `fun:???` match a frame without a name, `fun:main` does not.
const UNNAMED: &str = "???";

/// valgrind's name for every frame past `main` (the C library's start-up code).
const BELOW_MAIN: &str = "(below main)";

/// `frames` as rules see them: those past `main` are also `(below main)`.
pub fn frames(frames: &[Frame]) -> impl Iterator<Item = Seen<'_>> {
    let main = frames.iter().position(|f| f.function == "main");
    frames
        .iter()
        .enumerate()
        .map(move |(i, f)| if main.is_some_and(|m| i > m) { Seen::BelowMain(f) } else { Seen::Frame(f) })
}

/// `fun:`: memprof's names are demangled, so a mangled C++ name without wildcards is demangled
/// before it is compared (a frame's own mangled name, when it has one, is compared as well).
fn fun(pattern: &str, name: &str) -> bool {
    if glob(pattern, name) {
        return true;
    }
    pattern.starts_with("_Z")
        && !pattern.contains(['*', '?', '\\'])
        && crate::demangle::cpp(pattern).is_some_and(|demangled| demangled == name)
}

/// Whether `locations` match `stack` from its start (its innermost frame); frames past the
/// last location do not matter.
pub fn sequence(locations: &[Location], stack: &[Seen]) -> bool {
    if !locations.iter().any(|location| matches!(location, Location::Any)) {
        return locations.len() <= stack.len()
            && locations.iter().zip(stack).all(|(location, frame)| frame.matches(location));
    }
    // `...` skips any number of frames. Each (location, frame) pair is tried once: trying it once
    // for each way of reaching it takes time exponential in the `...` lines of a rule.
    let mut known = vec![None; (locations.len() + 1) * (stack.len() + 1)];
    sequence_from(locations, stack, (0, 0), &mut known)
}

/// Whether `locations[i..]` match `stack[j..]` (`at` is `(i, j)`); `known` holds each answer
/// found, at `i * (stack.len() + 1) + j`.
fn sequence_from(locations: &[Location], stack: &[Seen], at: (usize, usize), known: &mut [Option<bool>]) -> bool {
    let (i, j) = at;
    let Some(location) = locations.get(i) else { return true };
    let slot = i * (stack.len() + 1) + j;
    if let Some(answer) = known[slot] {
        return answer;
    }
    let answer = match location {
        Location::Any => (j..=stack.len()).any(|skip_to| sequence_from(locations, stack, (i + 1, skip_to), known)),
        _ => {
            stack.get(j).is_some_and(|frame| frame.matches(location))
                && sequence_from(locations, stack, (i + 1, j + 1), known)
        }
    };
    known[slot] = Some(answer);
    answer
}

/// valgrind's `VG_(string_match)`: `*` any run of characters, `?` one, `\` makes the next literal.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // The last `*` seen and the text position it was tried at: backtracking to it alone is enough.
    let (mut pi, mut ti, mut star) = (0, 0, None);
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
                continue;
            }
            Some('?') => {
                pi += 1;
                ti += 1;
                continue;
            }
            Some('\\') if p.get(pi + 1) == Some(&t[ti]) => {
                pi += 2;
                ti += 1;
                continue;
            }
            Some(&c) if c != '\\' && c == t[ti] => {
                pi += 1;
                ti += 1;
                continue;
            }
            _ => {}
        }
        match star {
            Some((at, from)) => {
                pi = at + 1;
                ti = from + 1;
                star = Some((at, from + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples::frame;

    #[test]
    fn globs_match_as_valgrinds() {
        assert!(glob("cache_*", "cache_fill"));
        assert!(glob("*", ""));
        assert!(glob("__mbr*toc", "__mbrlentoc") && glob("__mbr*toc", "__mbrtoc") && !glob("__mbr*toc", "__mbrtowc"));
        assert!(glob("lib?.so", "libc.so") && !glob("lib?.so", "lib.so"));
        assert!(glob("a\\*b", "a*b") && !glob("a\\*b", "axb"));
        assert!(glob("*a*b", "xaxab") && !glob("*a*b", "xaxa"));
        assert!(!glob("malloc", "malloc2"));
    }

    #[test]
    fn frames_match_from_the_innermost_with_frame_wildcards() {
        let frames = [frame("leaf", Some("/src/a.c"), Some(3)), frame("mid", None, None), frame("main", None, None)];
        let stack: Vec<Seen> = frames.iter().map(Seen::Frame).collect();
        let fun = |n: &str| Location::Fun(n.to_string());
        assert!(sequence(&[fun("leaf"), fun("mid")], &stack));
        assert!(!sequence(&[fun("mid")], &stack), "anchored at the innermost frame");
        assert!(sequence(&[Location::Any, fun("main")], &stack));
        assert!(sequence(&[fun("leaf"), Location::Any, fun("main"), Location::Any], &stack));
        assert!(!sequence(&[fun("leaf"), fun("main")], &stack));
        assert!(!sequence(&[fun("leaf"), fun("mid"), fun("main"), fun("start")], &stack), "longer than the stack");
        assert!(sequence(&[Location::Src("a.c".into(), Some(3))], &stack));
        assert!(!sequence(&[Location::Src("a.c".into(), Some(4))], &stack));
        assert!(sequence(&[Location::Obj("/usr/bin/leak*".into())], &stack));
    }

    /// Twelve `...` lines each before a `deep` that every frame is, then a function no frame is,
    /// against 65 frames: tried pair by pair, not way by way (about 65^12 ways).
    #[test]
    fn many_frame_wildcards_take_time_in_proportion_to_the_stack() {
        let frames: Vec<Frame> = (0..65).map(|_| frame("deep", None, None)).collect();
        let stack: Vec<Seen> = frames.iter().map(Seen::Frame).collect();
        let mut rule: Vec<Location> = (0..12).flat_map(|_| [Location::Any, Location::Fun("deep".into())]).collect();
        rule.push(Location::Fun("nomatch".into()));
        assert!(!sequence(&rule, &stack));
        rule.pop();
        assert!(sequence(&rule, &stack));
    }

    #[test]
    fn frames_past_main_are_below_main() {
        let frames =
            [frame("leaf", None, None), frame("main", None, None), frame("__libc_start_call_main", None, None)];
        let stack: Vec<Seen> = super::frames(&frames).collect();
        let fun = |n: &str| Location::Fun(n.to_string());
        assert!(sequence(&[fun("leaf"), fun("main"), fun("(below main)")], &stack));
        assert!(sequence(&[fun("leaf"), fun("main"), fun("__libc_start_call_main")], &stack));
        assert!(!sequence(&[fun("(below main)")], &stack));
    }

    #[test]
    fn mangled_patterns_match_a_frames_mangled_name_wildcards_included() {
        let mut frame = frame("app::Cache::insert", None, None);
        frame.mangled = Some("_ZN3app5Cache6insert17h0123456789abcdefE".into());
        assert!(Seen::Frame(&frame).matches(&Location::Fun("_ZN3app5Cache6insert17h0123456789abcdefE".into())));
        assert!(Seen::Frame(&frame).matches(&Location::Fun("_ZN3app5Cache*".into())));
        assert!(!Seen::Frame(&frame).matches(&Location::Fun("_ZN3app5Cache6remove*".into())));
    }

    #[test]
    fn mangled_names_match_demangled_frames() {
        let frame = frame("QListView::show()", None, None);
        assert!(Seen::Frame(&frame).matches(&Location::Fun("_ZN9QListView4showEv".into())));
        assert!(!Seen::Frame(&frame).matches(&Location::Fun("_ZN9QListView4hideEv".into())));
    }
}
