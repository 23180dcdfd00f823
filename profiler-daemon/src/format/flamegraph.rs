//! An SVG flame graph drawn by inferno from the folded stacks: each frame is as wide as the
//! memory held below it (or the allocations made there: `Flame`), the callers at the bottom.

use inferno::flamegraph::{
    self,
    color::{BasicPalette, Color, PaletteMap},
    Options, Palette,
};

use super::{folded, html::escape, Flame};
use crate::heap::report::Report;

pub fn render(report: &Report, flame: Flame) -> Vec<u8> {
    let measured = match flame {
        Flame::Bytes | Flame::Peak if report.at_peak => "in-use bytes at the peak,",
        Flame::Bytes | Flame::Peak => "in-use bytes after",
        Flame::Allocations => "allocations made in",
        Flame::Temporary => "temporary allocations in",
    };
    let title = format!("pid {} ({}): {measured} {:.1} s", report.pid, report.comm, report.duration_s);
    let paths = folded::paths(report, flame);
    if paths.is_empty() {
        // inferno refuses an empty graph; say plainly that there is nothing to draw.
        let nothing = match flame {
            Flame::Bytes | Flame::Peak => "no bytes in use",
            Flame::Allocations => "no allocations",
            Flame::Temporary => "no temporary allocations",
        };
        return nothing_to_draw(&title, nothing);
    }
    if paths.iter().try_fold(0u64, |sum, (_, value)| sum.checked_add(*value)).is_none() {
        // Only an edited recording says so; inferno's sums would wrap.
        return nothing_to_draw(
            &title,
            "its figures add up past 2^64, more than any process holds: the file was edited",
        );
    }
    let lines: Vec<String> = paths.iter().map(|(path, value)| format!("{path} {value}")).collect();
    let mut options = Options::default();
    options.title = title;
    options.subtitle = Some(subtitle(report, flame));
    if report.stacks_not_shown > 0 {
        let subtitle = options.subtitle.get_or_insert_with(String::new);
        subtitle.push_str(&format!("; {} smaller stacks left out", report.stacks_not_shown));
    }
    for unsaid in super::unseen_and_dropped(report) {
        let subtitle = options.subtitle.get_or_insert_with(String::new);
        subtitle.push_str(&format!("; {unsaid}"));
    }
    // Leak candidates' allocation sites in red, apart from the memory palette's greens.
    let mut palette = leak_sites(report);
    if palette.iter().next().is_some() {
        let subtitle = options.subtitle.get_or_insert_with(String::new);
        subtitle.push_str("; in red: the allocation sites of leak candidates");
    }
    options.palette_map = Some(&mut palette);
    options.colors = Palette::Basic(BasicPalette::Mem);
    options.count_name = if flame.counts_freed() { "allocations" } else { "bytes" }.to_string();
    // Colours from the function names: the same function has the same colour in every graph.
    options.hash = true;
    let mut svg = Vec::new();
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)
        .expect("inferno draws any non-empty set of folded lines into memory");
    svg
}

/// What the graph shows in all, and how far its figures are estimates.
fn subtitle(report: &Report, flame: Flame) -> String {
    let (bytes, allocations, temporary) = shown(report);
    let made = report.stacks.iter().fold(0u64, |sum, s| sum.saturating_add(s.allocations));
    let estimated = report.growth.is_none() && (report.sample_bytes != 0 || report.usdt_samples.is_some());
    let about = if estimated { "about " } else { "" };
    // Growth mode counts pages, not allocator calls.
    let unit = if report.growth.is_some() { "pages" } else { "allocations" };
    let shown = match flame {
        Flame::Bytes | Flame::Peak if report.at_peak => format!("{about}{bytes} bytes (the peak keeps no counts)"),
        Flame::Bytes | Flame::Peak => format!("{about}{bytes} bytes in {allocations} {unit}"),
        Flame::Allocations => {
            let made_bytes: u64 = report.stacks.iter().map(|s| s.allocated_bytes).sum();
            format!("{about}{made} {unit} of {made_bytes} bytes")
        }
        Flame::Temporary => {
            format!(
                "{temporary} of {made} allocations freed by their thread before it allocated or freed anything else"
            )
        }
    };
    if report.growth.is_some() {
        format!("{shown}, by the stack that first touched each")
    } else if let Some(samples) = report.usdt_samples.filter(|_| report.usdt_beside_calls) {
        format!("{shown}, Go's heap estimated from {samples} samples its runtime reported")
    } else if let Some(samples) = report.usdt_samples {
        format!("{shown}, estimated from {samples} samples the allocator reported")
    } else if report.sample_bytes == 0 {
        shown
    } else {
        format!("{shown}, estimated from one allocation in every {} bytes", report.sample_bytes)
    }
}

/// The colour of leaks (the HTML report's red).
const LEAK: Color = Color { r: 0xd6, g: 0x27, b: 0x28 };

/// The functions of the leak candidates' allocation sites, in `LEAK`.
fn leak_sites(report: &Report) -> PaletteMap {
    let mut palette = PaletteMap::default();
    for stack in report.stacks.iter().filter(|s| s.leak.candidate) {
        if let Some(site) = stack.frames.first() {
            palette.insert(folded::frame_name(&site.function), LEAK);
        }
    }
    palette
}

/// The bytes and allocations in use and the temporary allocations of the report's stacks (only
/// those aged enough with `--min-age`, unlike the totals).
fn shown(report: &Report) -> (u64, u64, u64) {
    report.stacks.iter().fold((0, 0, 0), |(b, a, t), s| {
        // Saturating: only an edited recording's figures come near 2^64.
        (
            b.saturating_add(s.outstanding_bytes),
            a.saturating_add(s.outstanding_allocations),
            t.saturating_add(s.temporary_allocations),
        )
    })
}

/// A page with the graph's title and why there is no graph.
fn nothing_to_draw(title: &str, why: &str) -> Vec<u8> {
    format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n\
         <svg version=\"1.1\" width=\"1200\" height=\"60\" xmlns=\"http://www.w3.org/2000/svg\">\
         <text x=\"600\" y=\"24\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"17\">{}</text>\
         <text x=\"600\" y=\"48\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"12\">{}</text>\
         </svg>\n",
        escape(title),
        escape(why)
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples;

    fn text(report: &Report) -> String {
        String::from_utf8(render(report, Flame::Bytes)).unwrap()
    }

    #[test]
    fn frames_carry_their_bytes_and_the_title_names_the_process() {
        let svg = text(&samples::report());
        assert!(svg.contains("pid 1 (leaky): in-use bytes"), "{svg}");
        assert!(svg.contains("<title>leak_here (48 bytes, 100.00%)</title>"), "{svg}");
        assert!(svg.contains(">48 bytes in 1 allocations<"), "{svg}");
    }

    /// An edited recording's figures that wrap past 2^64: said, not a panic.
    #[test]
    fn figures_past_two_to_the_64_are_said_not_drawn() {
        let mut report = samples::report();
        let mut other = report.stacks[0].clone();
        std::sync::Arc::make_mut(&mut other.frames)[0].function = "other".into();
        report.stacks.push(other);
        for stack in &mut report.stacks {
            stack.outstanding_bytes = 1 << 63;
        }
        assert!(text(&report).contains("its figures add up past 2^64"));
        report.stacks.pop();
        report.stacks.push(report.stacks[0].clone());
        // One path of two such stacks: saturated, not wrapped to nothing.
        let svg = text(&report);
        assert!(svg.contains("<title>leak_here (18,446,744,073,709,551,615 bytes, 100.00%)</title>"), "{svg}");
    }

    #[test]
    fn leak_sites_are_red_and_the_subtitle_says_so() {
        let mut report = samples::report();
        assert!(!text(&report).contains("in red"));
        report.stacks[0].leak.candidate = true;
        let svg = text(&report);
        assert!(svg.contains("; in red: the allocation sites of leak candidates<"), "{svg}");
        let frame = svg.split("<title>leak_here (").nth(1).unwrap();
        assert!(frame.contains("fill=\"rgb(214,39,40)\""), "{frame}");
    }

    #[test]
    fn a_sampled_graph_says_its_bytes_are_estimates() {
        let mut report = samples::report();
        report.sample_bytes = 4096;
        let svg = text(&report);
        assert!(svg.contains(">about 48 bytes in 1 allocations, estimated from one allocation in every 4096 bytes<"));
    }

    #[test]
    fn names_are_escaped() {
        let mut report = samples::report();
        report.comm = "a<b>&c".into();
        std::sync::Arc::make_mut(&mut report.stacks[0].frames)[0].function = "f<int>".into();
        let svg = text(&report);
        assert!(svg.contains("a&lt;b&gt;&amp;c"), "{svg}");
        assert!(svg.contains("f&lt;int&gt;"), "{svg}");
        report.stacks.clear();
        assert!(text(&report).contains("a&lt;b&gt;&amp;c"));
    }

    #[test]
    fn an_empty_report_draws_a_notice() {
        let mut report = samples::report();
        report.stacks.clear();
        assert!(text(&report).contains("no bytes in use"));
    }
}
