//! An SVG flame graph of the bytes in use, drawn by inferno from the folded stacks: each frame is
//! as wide as the memory held below it, the callers at the bottom.

use inferno::flamegraph::{
    self,
    color::{BasicPalette, Color, PaletteMap},
    Options, Palette,
};

use super::{folded, html::escape};
use crate::heap::report::Report;

pub fn render(report: &Report) -> Vec<u8> {
    let title = format!("pid {} ({}): in-use bytes after {:.1} s", report.pid, report.comm, report.duration_s);
    let paths = folded::paths(report);
    if paths.is_empty() {
        // inferno refuses an empty graph; say plainly that nothing was held.
        return nothing_in_use(&title);
    }
    let lines: Vec<String> = paths.iter().map(|(path, bytes)| format!("{path} {bytes}")).collect();
    let mut options = Options::default();
    options.title = title;
    let (bytes, allocations) = shown(report);
    options.subtitle = Some(if report.growth.is_some() {
        format!("{bytes} bytes in {allocations} pages, by the stack that first touched each")
    } else if let Some(samples) = report.usdt_samples {
        format!(
            "about {bytes} bytes in {allocations} allocations, estimated from {samples} samples the allocator reported"
        )
    } else if report.sample_bytes == 0 {
        format!("{bytes} bytes in {allocations} allocations")
    } else {
        format!(
            "about {bytes} bytes in {allocations} allocations, estimated from one allocation in every {} bytes",
            report.sample_bytes
        )
    });
    if report.stacks_not_shown > 0 {
        let subtitle = options.subtitle.get_or_insert_with(String::new);
        subtitle.push_str(&format!("; {} smaller stacks left out", report.stacks_not_shown));
    }
    // Leak candidates' allocation sites in red, apart from the memory palette's greens.
    let mut palette = leak_sites(report);
    if palette.iter().next().is_some() {
        let subtitle = options.subtitle.get_or_insert_with(String::new);
        subtitle.push_str("; in red: the allocation sites of leak candidates");
    }
    options.palette_map = Some(&mut palette);
    options.colors = Palette::Basic(BasicPalette::Mem);
    options.count_name = "bytes".to_string();
    // Colours from the function names: the same function has the same colour in every graph.
    options.hash = true;
    let mut svg = Vec::new();
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)
        .expect("inferno draws any non-empty set of folded lines into memory");
    svg
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

/// The bytes and allocations the graph shows: the report's stacks' in-use ones (only those aged
/// enough with `--min-age`, unlike the totals).
fn shown(report: &Report) -> (u64, u64) {
    report.stacks.iter().fold((0, 0), |(b, a), s| (b + s.outstanding_bytes, a + s.outstanding_allocations))
}

fn nothing_in_use(title: &str) -> Vec<u8> {
    format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n\
         <svg version=\"1.1\" width=\"1200\" height=\"60\" xmlns=\"http://www.w3.org/2000/svg\">\
         <text x=\"600\" y=\"24\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"17\">{}</text>\
         <text x=\"600\" y=\"48\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"12\">no bytes in use</text>\
         </svg>\n",
        escape(title)
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples;

    fn text(report: &Report) -> String {
        String::from_utf8(render(report)).unwrap()
    }

    #[test]
    fn frames_carry_their_bytes_and_the_title_names_the_process() {
        let svg = text(&samples::report());
        assert!(svg.contains("pid 1 (leaky): in-use bytes"), "{svg}");
        assert!(svg.contains("<title>leak_here (48 bytes, 100.00%)</title>"), "{svg}");
        assert!(svg.contains(">48 bytes in 1 allocations<"), "{svg}");
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
