//! Samples of the daemon's /metrics text.

use crate::http_get;

/// The value of the sample `series` (see `sample`) in the daemon's /metrics at `port`; None when
/// it is missing or the scrape fails.
pub fn metric(port: u16, series: &str) -> Option<u64> {
    sample(&http_get(port, "/metrics")?.1, series)
}

/// The value of the first sample in the text `metrics` that `series` names: `name{a="x",b="y"}`
/// matches the samples of `name` that have these labels, whatever others they have (a process's
/// exe and cgroup, say); a bare name matches any of its samples. A process's series carry no pid:
/// `pid="N"` stands for its identity, the comm and slot that `memprof_target_attached` gives pid N.
pub fn sample(metrics: &str, series: &str) -> Option<u64> {
    sample_as(metrics, series)
}

/// `metric` for a series whose value has a fraction (seconds, say).
pub fn metric_f64(port: u16, series: &str) -> Option<f64> {
    sample_as(&http_get(port, "/metrics")?.1, series)
}

fn sample_as<T: std::str::FromStr>(metrics: &str, series: &str) -> Option<T> {
    let (name, mut wanted) = parse_series(series)?;
    if name != "memprof_target_attached" {
        if let Some(at) = wanted.iter().position(|(key, _)| key == "pid") {
            let pid = wanted.remove(at);
            let identity = samples(metrics).find_map(|(found, labels, _)| {
                (found == "memprof_target_attached" && labels.contains(&pid))
                    .then(|| labels.into_iter().filter(|(key, _)| key == "comm" || key == "slot").collect::<Vec<_>>())
            })?;
            wanted.extend(identity);
        }
    }
    samples(metrics).find_map(|(found, labels, value)| {
        (found == name && wanted.iter().all(|label| labels.contains(label))).then(|| value.parse().ok())?
    })
}

/// The samples of the text `metrics`: name, labels and value.
fn samples(metrics: &str) -> impl Iterator<Item = (&str, Vec<(String, String)>, &str)> {
    metrics.lines().filter(|line| !line.starts_with('#')).filter_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (name, labels) = parse_series(series)?;
        Some((name, labels, value))
    })
}

/// A sample's name and labels, label values unescaped.
fn parse_series(series: &str) -> Option<(&str, Vec<(String, String)>)> {
    let Some((name, mut rest)) = series.split_once('{') else { return Some((series, Vec::new())) };
    let mut labels = Vec::new();
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => value.push(match chars.next()?.1 {
                    'n' => '\n',
                    escaped => escaped,
                }),
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.push((key.trim_start_matches(',').to_string(), value));
        rest = &after[end + 1..];
    }
    Some((name, labels))
}
