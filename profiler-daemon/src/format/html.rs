//! One self-contained HTML page: the report as JSON inside it, drawn by the inline scripts in
//! `html/` (heap over time, leak candidates, what `--inspect` found, a filterable call tree, size
//! and lifetime histograms, totals and drops). The page fetches nothing, so it can be mailed or attached to a
//! ticket.

use crate::heap::report::Report;

const TEMPLATE: &str = include_str!("html/report.html");

/// The parts the template names `{{like_this}}`.
fn part(name: &str) -> Option<&'static str> {
    Some(match name {
        "style" => include_str!("html/report.css"),
        "common" => include_str!("html/common.js"),
        "chart" => include_str!("html/chart.js"),
        "tree" => include_str!("html/tree.js"),
        "inspection" => include_str!("html/inspection.js"),
        "report" => include_str!("html/report.js"),
        _ => return None,
    })
}

pub fn render(report: &Report) -> String {
    let title = escape(&format!("memprof: pid {} ({})", report.pid, report.comm));
    let data = script_json(report);
    // One pass over the template: what is put in is never searched for placeholders again.
    let mut page = String::with_capacity(TEMPLATE.len() + data.len() + 64 * 1024);
    let mut rest = TEMPLATE;
    while let Some(start) = rest.find("{{") {
        let end = start + rest[start..].find("}}").expect("the template closes every placeholder");
        page.push_str(&rest[..start]);
        match &rest[start + 2..end] {
            "title" => page.push_str(&title),
            "data" => page.push_str(&data),
            name => page.push_str(part(name).unwrap_or_else(|| panic!("the template names no part `{name}`"))),
        }
        rest = &rest[end + 2..];
    }
    page.push_str(rest);
    page
}

/// The report as JSON that cannot end its `<script>` element early: `<`, `>` and `&` (which
/// only occur inside JSON strings) become `\u` escapes, which JSON.parse turns back.
fn script_json(report: &Report) -> String {
    serde_json::to_string(report)
        .expect("a report always serializes")
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
}

/// Text made safe for HTML and XML, in element content and quoted attributes.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples;

    #[test]
    fn the_page_is_self_contained() {
        let page = render(&samples::report());
        assert!(!page.contains("{{"), "a placeholder was left");
        // The SVG namespace is a name, not a fetch.
        let without_namespace = page.replace("http://www.w3.org/2000/svg", "");
        for fetch in ["src=", "href=", "http://", "https://", "@import", "url("] {
            assert!(!without_namespace.contains(fetch), "the page would fetch `{fetch}`");
        }
        assert!(page.contains("\"function\":\"leak_here\""));
    }

    #[test]
    fn names_cannot_break_out_of_the_page() {
        let mut report = samples::report();
        report.comm = "</title><b>".into();
        std::sync::Arc::make_mut(&mut report.stacks[0].frames)[0].function =
            "f</script><script>alert(1)</script>&amp;".into();
        let page = render(&report);
        assert!(page.contains("<title>memprof: pid 1 (&lt;/title&gt;&lt;b&gt;)</title>"));
        let data = page.split("id=\"report-data\">").nth(1).unwrap().split("</script>").next().unwrap();
        let value: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(value["stacks"][0]["frames"][0]["function"], "f</script><script>alert(1)</script>&amp;");
        assert_eq!(page.matches("<script").count(), 6, "only the page's own scripts");
    }
}
