//! Mangled names demangled: Rust's by rustc-demangle, C++'s by cpp_demangle, whose text is
//! mended where it reads otherwise than c++filt's in substance:
//! - an empty parameter pack at the end of a template's arguments leaves `, ` before the `>`:
//!   `std::make_unique<Foo, >`;
//! - an empty pack of reference parameters leaves its `&&` among the function's parameters:
//!   `std::make_unique<Foo>(&&)`, as every `make_unique`, `make_shared` or `emplace_back`
//!   called with no arguments, which are allocation sites;
//! - a literal operator reads `operator_x::operator ""` for `operator"" _x`.

/// `name` demangled when it is a mangled name: Rust's (`_R`, or legacy `_ZN…17h<hash>E`) or C++'s
/// (`_Z`). Anything else is a C name, kept as it is: a C++ demangler reads a lone `w` or `x` as
/// the type `wchar_t` or `long long`.
pub fn demangled(name: &str) -> String {
    if name.starts_with("_R") || name.starts_with("_ZN") {
        if let Ok(rust) = rustc_demangle::try_demangle(name) {
            return format!("{rust:#}");
        }
    }
    if name.starts_with("_Z") {
        if let Some(cpp) = cpp(name) {
            return cpp;
        }
    }
    name.to_string()
}

/// The C++ name `mangled` demangled, or None when it is not one.
pub fn cpp(mangled: &str) -> Option<String> {
    let text = cpp_demangle::Symbol::new(mangled).ok()?.demangle().ok()?;
    Some(without_empty_packs(&literal_operators(text)))
}

/// `operator_x::operator ""` written `operator"" _x`.
fn literal_operators(mut text: String) -> String {
    const MISREAD: &str = "::operator \"\"";
    let mut from = 0;
    while let Some(found) = text[from..].find(MISREAD).map(|at| from + at) {
        let before = &text[..found];
        let word_start = before.trim_end_matches(|c: char| c.is_alphanumeric() || c == '_').len();
        match before[word_start..].strip_prefix("operator") {
            Some(suffix) => {
                let written = format!("operator\"\" {suffix}");
                text.replace_range(word_start..found + MISREAD.len(), &written);
                from = word_start + written.len();
            }
            None => from = found + MISREAD.len(),
        }
    }
    text
}

/// The traces of empty parameter packs taken out: a reference declarator standing alone as a
/// parameter, and the separator left before a closing `>` or `)`. A pack emptied in the middle
/// keeps its separators, as c++filt writes it (`f(int, , int)`).
fn without_empty_packs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(['(', ',']) {
        let (head, tail) = rest.split_at(at + 1);
        out.push_str(head);
        // A parameter list opens right after a name or a `>`; `void (&)[4]` has a space before.
        let opens_parameters = head.ends_with(',') || head.len() >= 2 && !head[..head.len() - 1].ends_with(' ');
        let end = tail.find([',', ')']).unwrap_or(tail.len());
        rest = tail;
        if opens_parameters && lone_reference(&tail[..end]) {
            // The separator's space stays: `f(int, , int)`.
            out.push_str(if head.ends_with(',') { " " } else { "" });
            rest = &tail[end..];
        }
    }
    out.push_str(rest);
    out.replace(", >", ">").replace(", )", ")")
}

/// Whether a parameter's text is a reference declarator without a type: `&&`, ` const&`.
fn lone_reference(parameter: &str) -> bool {
    let Some(qualifiers) = parameter.strip_suffix("&&").or_else(|| parameter.strip_suffix('&')) else {
        return false;
    };
    qualifiers.split_whitespace().all(|word| word == "const" || word == "volatile")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each name beside what c++filt writes for it.
    fn assert_reads_as_cxxfilt(cases: &[(&str, &str)]) {
        for (mangled, cxxfilt) in cases {
            assert_eq!(cpp(mangled).as_deref(), Some(*cxxfilt), "{mangled}");
        }
    }

    #[test]
    fn empty_packs_leave_no_trace() {
        assert_reads_as_cxxfilt(&[
            (
                "_ZSt11make_uniqueI3FooJEENSt8__detail9_MakeUniqIT_E15__single_objectEDpOT0_",
                "std::__detail::_MakeUniq<Foo>::__single_object std::make_unique<Foo>()",
            ),
            ("_ZSt11make_sharedI3FooJEESt10shared_ptrIT_EDpOT0_", "std::shared_ptr<Foo> std::make_shared<Foo>()"),
            (
                "_ZNSt6vectorIiSaIiEE12emplace_backIJEEERiDpOT_",
                "int& std::vector<int, std::allocator<int> >::emplace_back<>()",
            ),
            ("_ZN3fooIJEJEE3barEv", "foo<>::bar()"),
            ("_ZN3fooIiJEEclEv", "foo<int>::operator()()"),
            ("_Z1fIJEEviDpRKT_", "void f<>(int)"),
            ("_Z1fIJEEvDpRT_", "void f<>()"),
            // Emptied in the middle: c++filt keeps the separators.
            ("_ZN3fooIiJEiE3barEv", "foo<int, , int>::bar()"),
            ("_Z1fIJEEviDpOT_i", "void f<>(int, , int)"),
            ("_Z1fIJEEvDpOT_i", "void f<>(, int)"),
        ]);
    }

    #[test]
    fn reference_declarators_with_a_type_stay() {
        assert_reads_as_cxxfilt(&[
            ("_Z1fRA4_i", "f(int (&) [4])"),
            ("_Z1fRFviE", "f(void (&)(int))"),
            ("_Z1fPFviE", "f(void (*)(int))"),
            ("_ZN1AaaERKS_", "A::operator&&(A const&)"),
            ("_ZN1AanEOS_", "A::operator&(A&&)"),
        ]);
    }

    #[test]
    fn literal_operators_read_as_written() {
        assert_reads_as_cxxfilt(&[
            ("_Zli5_leakB5cxx11PKcm", "operator\"\" _leak[abi:cxx11](char const*, unsigned long)"),
            ("_ZN3fooli2_xEy", "foo::operator\"\" _x(unsigned long long)"),
        ]);
    }

    #[test]
    fn names_that_are_not_mangled_stay() {
        assert_eq!(demangled("malloc"), "malloc");
        assert_eq!(demangled("x"), "x");
        assert_eq!(cpp("malloc"), None);
    }
}
