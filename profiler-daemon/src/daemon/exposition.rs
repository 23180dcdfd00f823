//! The two text formats /metrics answers in, chosen by the scraper's `Accept` header: Prometheus's
//! text format 0.0.4, unless OpenMetrics is preferred (as Prometheus itself asks). prometheus-client
//! writes OpenMetrics text and protobuf only (protobuf needs protoc to build), so the 0.0.4 text
//! is derived from its OpenMetrics text.

use std::fmt::Write as _;

use prometheus_client::{encoding::text, registry::Registry};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `text/plain; version=0.0.4`: for curl, promtool and any client that does not ask.
    Text,
    OpenMetrics,
}

const OPENMETRICS: &str = "application/openmetrics-text";
const TEXT: &str = "text/plain";

impl Format {
    /// OpenMetrics when `accept` ranks it above plain text, else text.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let accept = accept.unwrap_or("");
        if quality(accept, OPENMETRICS) > quality(accept, TEXT) {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// The `q` an `Accept` header gives `media_type` (RFC 9110: the most specific range that
/// matches it decides; none: 0).
fn quality(accept: &str, media_type: &str) -> f64 {
    let (kind, _) = media_type.split_once('/').unwrap_or((media_type, ""));
    let mut best: Option<(u8, f64)> = None;
    for range in accept.split(',') {
        let mut parts = range.split(';').map(str::trim);
        let name = parts.next().unwrap_or("").to_ascii_lowercase();
        let specificity = if name == media_type {
            3
        } else if name.strip_suffix("/*") == Some(kind) {
            2
        } else if name == "*/*" {
            1
        } else {
            continue;
        };
        let q = parts
            .filter_map(|param| param.split_once('='))
            .find(|(key, _)| key.trim().eq_ignore_ascii_case("q"))
            .map_or(1.0, |(_, value)| value.trim().parse().unwrap_or(0.0));
        if best.is_none_or(|(known, _)| specificity > known) {
            best = Some((specificity, q));
        }
    }
    best.map_or(0.0, |(_, q)| q)
}

/// The registry's metrics in `format`.
pub fn encode(registry: &Registry, format: Format) -> Result<String, std::fmt::Error> {
    let mut openmetrics = String::new();
    match format {
        Format::OpenMetrics => text::encode(&mut openmetrics, registry).map(|()| openmetrics),
        Format::Text => text::encode_registry(&mut openmetrics, registry).map(|()| prometheus_text(&openmetrics)),
    }
}

/// Text format 0.0.4 from OpenMetrics text without its `# EOF`. For the types memprof writes
/// (counter, gauge, histogram; no units, exemplars or created timestamps), the two differ only in a
/// counter's HELP and TYPE lines: OpenMetrics names the family (`x`), 0.0.4 the samples
/// (`x_total`), and a 0.0.4 parser finds no help for samples no HELP line names.
fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len() + 4096);
    let mut lines = openmetrics.lines().peekable();
    while let Some(line) = lines.next() {
        // prometheus-client writes each family's HELP line, then its TYPE line.
        let counter = line.strip_prefix("# HELP ").and_then(|help| {
            let (name, text) = help.split_once(' ').unwrap_or((help, ""));
            (lines.peek() == Some(&format!("# TYPE {name} counter").as_str())).then_some((name, text))
        });
        match counter {
            Some((name, help)) => {
                lines.next();
                let _ = write!(out, "# HELP {name}_total {help}\n# TYPE {name}_total counter\n");
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_only_when_ranked_above_text() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prometheus)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(Some("application/openmetrics-text")), Format::OpenMetrics);
        for text in [None, Some("*/*"), Some("text/plain; version=0.0.4"), Some("application/json")] {
            assert_eq!(Format::negotiate(text), Format::Text, "{text:?}");
        }
        let text_first = "text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.5";
        assert_eq!(Format::negotiate(Some(text_first)), Format::Text);
        assert_eq!(Format::negotiate(Some("application/*, text/plain;q=0.2")), Format::OpenMetrics);
    }

    #[test]
    fn counters_are_named_by_their_samples_in_text() {
        let openmetrics = "# HELP a_bytes In use.\n# TYPE a_bytes gauge\na_bytes 1\n\
                           # HELP b Calls.\n# TYPE b counter\nb_total{x=\"y\"} 2\n";
        assert_eq!(
            prometheus_text(openmetrics),
            "# HELP a_bytes In use.\n# TYPE a_bytes gauge\na_bytes 1\n\
             # HELP b_total Calls.\n# TYPE b_total counter\nb_total{x=\"y\"} 2\n"
        );
    }
}
