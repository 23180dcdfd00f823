//! The formats written once at the end: folded stacks, the SVG flame graph, and the HTML report
//! opened in headless Chromium; the same rendered from a recording; and the daemon's flame graph
//! and report pages.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
};

use memprof_tests::chromium::{chromium, chromium_profile, dom, section, CHROMIUM};
use memprof_tests::{
    fixture, fixture_cpp, fixture_with, memprof, memprof_bin, released, site, wait_for, Daemon, Waiting,
};
use serde_json::{json, Value};

#[path = "reports/cdp.rs"]
mod cdp;

/// The fixture's sites at exit: (function, bytes in use, allocations in use); `churn_site`
/// frees all it allocates.
const GROW: (&str, u64, u64) = ("grow_site", 98_304, 24);
const HOLD: (&str, u64, u64) = ("hold_site", 10_000, 10);
const IN_USE: u64 = GROW.1 + HOLD.1;

/// The fixture runs under a name that HTML and XML must escape.
const COMM: &str = "reports<&>";

fn reports_fixture() -> &'static Path {
    static PROGRAM: OnceLock<PathBuf> = OnceLock::new();
    PROGRAM.get_or_init(|| fixture_with("reports.c", COMM, &["-g", "-O0", "-fno-omit-frame-pointer"]))
}

/// A path in the temp directory private to this test process.
fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memprof-reports-{}-{name}", std::process::id()))
}

/// `memprof run --format FORMAT --output FILE --interval 0.2` on the fixture: what it wrote.
fn run_format(format: &str) -> Vec<u8> {
    run_format_with(format, &[])
}

/// The same with more flags.
fn run_format_with(format: &str, flags: &[&str]) -> Vec<u8> {
    let output = temp_path(&format!("out.{format}{}", flags.join("").replace('/', "_")));
    let program = reports_fixture().to_str().unwrap();
    let args = ["run", "--format", format, "--output", output.to_str().unwrap(), "--interval", "0.2"];
    let all: Vec<&str> = args.iter().chain(flags).chain(&["--", program]).copied().collect();
    let outcome = memprof(&all);
    assert!(outcome.status.success(), "{outcome:?}");
    assert!(outcome.stderr.contains(&format!("({COMM})")), "{}", outcome.stderr);
    let wrote = format!("memprof: wrote {}\n", output.display());
    assert_eq!(
        outcome.stderr.contains(&wrote),
        format != "json",
        "said only for a file written once: {}",
        outcome.stderr
    );
    let written = std::fs::read(&output).unwrap_or_else(|e| panic!("reading {}: {e}", output.display()));
    let _ = std::fs::remove_file(&output);
    written
}

/// `memprof report RECORDING --format FORMAT --output FILE`: what it wrote.
fn render(recording: &Path, format: &str) -> Vec<u8> {
    let output = temp_path(&format!("rendered.{format}"));
    let outcome =
        memprof(&["report", recording.to_str().unwrap(), "--format", format, "--output", output.to_str().unwrap()]);
    assert!(outcome.status.success(), "{outcome:?}");
    let written = std::fs::read(&output).unwrap_or_else(|e| panic!("reading {}: {e}", output.display()));
    let _ = std::fs::remove_file(&output);
    written
}

fn json_lines(bytes: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(bytes).lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

#[test]
fn a_recording_renders_every_format_from_the_data_the_live_run_wrote() {
    let recording = temp_path("session.rec");
    let live = json_lines(&run_format_with("json", &["--record", recording.to_str().unwrap()]));
    let size = std::fs::metadata(&recording).unwrap().len();
    let live_size: usize = live.iter().map(|r| r.to_string().len()).sum();
    assert!(size * 2 < live_size as u64, "compact: {size} bytes for {live_size} bytes of JSON");

    // Every interval's report and the final one, equal to the byte.
    let rendered = json_lines(&render(&recording, "json"));
    assert_eq!(rendered, live);
    let last = live.last().unwrap();
    assert_eq!(last["final"], true);
    let context = &last["context"];
    assert!(context["started"].as_str().unwrap().ends_with('Z'), "{context}");
    assert_eq!(context["memprof_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(context["host"].as_str().unwrap(), std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim());
    assert_eq!(context["command_line"][1], "run", "{context}");

    // The leak rule warms up before it judges, and the last interval and the final report agree.
    let grow = |report: &Value| {
        let stacks = report["stacks"].as_array().unwrap();
        stacks.iter().find(|s| s["frames"][0]["function"] == GROW.0).cloned().unwrap_or_else(|| panic!("{report}"))
    };
    assert_eq!(grow(&live[0])["leak"]["warming_up"]["window"], 6, "{}", live[0]);
    assert_eq!(grow(&live[0])["leak"]["candidate"], false);
    let before_last = &live[live.len() - 2];
    assert_eq!(grow(before_last)["leak"]["candidate"], true, "{before_last}");
    assert_eq!(grow(last)["leak"]["candidate"], true, "{last}");
    let table = String::from_utf8(render(&recording, "table")).unwrap();
    let first = table.split("memprof: pid").nth(1).unwrap();
    assert!(first.contains("[leak rule warming up ("), "{first}");
    assert!(!first.contains(" 0.00 "), "no score before a verdict: {first}");
    let final_table = table.rsplit("memprof: pid").next().unwrap();
    assert!(final_table.contains("final report"), "{final_table}");
    assert!(final_table.contains("[leak candidate: grew in"), "{final_table}");

    // The formats written once, from the final report.
    let page = temp_path("rendered-page.html");
    std::fs::write(&page, render(&recording, "html")).unwrap();
    let dom = dom(&format!("file://{}", page.display()));
    let _ = std::fs::remove_file(&page);
    assert_eq!(&embedded_report(&dom), last);
    let folded = String::from_utf8(render(&recording, "folded")).unwrap();
    assert_eq!(folded.lines().count(), 2, "{folded}");
    assert!(folded.contains(&format!(";main;{} {}\n", GROW.0, GROW.1)), "{folded}");
    assert!(folded.contains(&format!(";main;{} {}\n", HOLD.0, HOLD.1)), "{folded}");
    let svg = String::from_utf8(render(&recording, "flamegraph")).unwrap();
    assert_eq!(frame_bytes(&parse_svg(&svg), "all"), Some(IN_USE));
    let profile = render(&recording, "pprof");
    assert!(profile.starts_with(&[0x1f, 0x8b]), "gzip: pprof.rs reads it with go tool pprof");
    let _ = std::fs::remove_file(&recording);
}

#[test]
fn folded_stacks_give_each_site_its_exact_bytes() {
    let text = String::from_utf8(run_format("folded")).unwrap();
    let lines: Vec<(&str, u64)> = text
        .lines()
        .map(|line| {
            let (path, bytes) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not `path bytes`: {line}"));
            (path, bytes.parse().unwrap_or_else(|_| panic!("not a number of bytes: {line}")))
        })
        .collect();
    // Every byte in use is the fixture's: its two sites, each one path from _start down.
    assert_eq!(lines.len(), 2, "{text}");
    for (function, bytes, _) in [GROW, HOLD] {
        let (path, value) = lines.iter().find(|(path, _)| path.ends_with(&format!(";main;{function}"))).unwrap();
        assert!(path.starts_with("_start;"), "outermost frame first: {path}");
        assert_eq!(*value, bytes, "{text}");
    }
    assert!(!text.contains("churn_site"), "a site that freed everything holds nothing: {text}");
}

#[test]
fn the_flame_graph_names_each_site_with_its_bytes() {
    let svg = String::from_utf8(run_format("flamegraph")).unwrap();
    let document = parse_svg(&svg);
    let title = document.descendants().find(|n| n.attribute("id") == Some("title")).expect("a title");
    assert!(title.text().unwrap().contains(&format!("({COMM}): in-use bytes")), "{:?}", title.text());
    assert_eq!(frame_bytes(&document, "all"), Some(IN_USE));
    assert_eq!(frame_bytes(&document, GROW.0), Some(GROW.1));
    assert_eq!(frame_bytes(&document, HOLD.0), Some(HOLD.1));
    assert_eq!(frame_bytes(&document, "churn_site"), None);
    assert!(svg.contains("<title>grow_site (98,304 bytes, "), "the tooltip says bytes");
    // The leak in red, said in the subtitle; the rest in the memory palette's colours.
    let subtitle = document.descendants().find(|n| n.attribute("id") == Some("subtitle")).and_then(|n| n.text());
    assert!(subtitle.unwrap().ends_with("; in red: the allocation sites of leak candidates"), "{subtitle:?}");
    assert_eq!(frame_fill(&document, GROW.0), "rgb(214,39,40)");
    assert_ne!(frame_fill(&document, HOLD.0), "rgb(214,39,40)");
}

/// The fill colour of the frame named `function`.
fn frame_fill(document: &roxmltree::Document, function: &str) -> String {
    let frame = document
        .descendants()
        .find(|n| {
            n.has_tag_name("g")
                && n.children().any(|c| {
                    c.has_tag_name("title") && c.text().is_some_and(|t| t.starts_with(&format!("{function} (")))
                })
        })
        .unwrap_or_else(|| panic!("no frame {function}"));
    let rect = frame.children().find(|c| c.has_tag_name("rect")).expect("a frame has a rectangle");
    rect.attribute("fill").expect("a fill").to_string()
}

/// The SVG as an XML tree (inferno's SVG names the SVG 1.1 DTD).
fn parse_svg(svg: &str) -> roxmltree::Document<'_> {
    let options = roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() };
    roxmltree::Document::parse_with_options(svg, options).unwrap_or_else(|e| panic!("not XML ({e}): {svg}"))
}

/// The width in bytes (inferno's `fg:w`) of the frame named `function`.
fn frame_bytes(document: &roxmltree::Document, function: &str) -> Option<u64> {
    let frame = document.descendants().find(|n| {
        n.has_tag_name("g")
            && n.children()
                .any(|c| c.has_tag_name("title") && c.text().is_some_and(|t| t.starts_with(&format!("{function} ("))))
    })?;
    let rect = frame.children().find(|c| c.has_tag_name("rect")).expect("a frame has a rectangle");
    Some(rect.attribute(("http://github.com/jonhoo/inferno", "w")).expect("fg:w").parse().unwrap())
}

/// The table row of `html` whose text contains `needle`.
fn row<'a>(html: &'a str, needle: &str) -> &'a str {
    html.split("<tr").find(|row| row.contains(needle)).unwrap_or_else(|| panic!("no row with {needle}: {html}"))
}

/// The report embedded in the page, as the page's scripts read it.
/// `n` with a comma between thousands, as the HTML report writes numbers.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

fn embedded_report(dom: &str) -> Value {
    let json = dom.split("id=\"report-data\">").nth(1).and_then(|rest| rest.split("</script>").next()).unwrap();
    serde_json::from_str(json).unwrap()
}

#[test]
fn the_html_report_renders_in_chromium_with_the_exact_numbers() {
    let page = temp_path("report.html");
    std::fs::write(&page, run_format("html")).unwrap();
    let url = format!("file://{}", page.display());
    let dom = dom(&url);
    let report = embedded_report(&dom);
    assert_eq!(site(&report, GROW.0), (GROW.1, GROW.2));

    // Sections with nothing to show leave nothing behind (no inspection here).
    assert!(!dom.contains("</section>null") && !dom.contains(">null<"), "{dom}");
    assert!(dom.contains("final report after "), "{dom}");
    // The name is text, not markup.
    assert!(dom.contains(&format!("<h1>memprof: pid {} (reports&lt;&amp;&gt;)</h1>", report["pid"])), "{dom}");
    let context = &report["context"];
    let said = format!(
        "Started {} on {} by memprof {}: <code>",
        context["started"].as_str().unwrap(),
        context["host"].as_str().unwrap(),
        context["memprof_version"].as_str().unwrap()
    );
    assert!(dom.contains(&said), "{dom}");
    // The page opens on the leaks and the heap over time; the totals and counters follow.
    let at = |id: &str| dom.find(&format!("<section id=\"{id}\">")).unwrap();
    assert!(at("leaks") < at("timeline") && at("timeline") < at("summary") && at("summary") < at("tree"));
    let summary = section(&dom, "summary");
    assert!(
        summary.contains("<details id=\"drops\"><summary id=\"dropped-summary\""),
        "folded when all are 0: {summary}"
    );
    assert!(summary.contains("data-key=\"outstanding_bytes\">108,304 B (105.8 KiB)<"), "{summary}");
    assert!(summary.contains("data-key=\"outstanding_allocations\">34<"), "{summary}");
    assert!(summary.contains("data-key=\"allocations\">58<"), "{summary}");
    assert!(summary.contains("data-key=\"frees\">24<"), "{summary}");
    assert!(summary.contains("Nothing was dropped"), "{summary}");
    assert!(summary.contains("data-key=\"stack_too_deep\">0<"), "every drop counter is listed: {summary}");

    // One point per interval for the process, and a line for the leaking stack ending at its bytes.
    let chart = section(&dom, "timeline");
    let points = report["timeline"]["time_s"].as_array().unwrap().len();
    assert!(points >= 10, "2.4 s at 0.2 s intervals: {}", report["timeline"]);
    assert!(chart.contains(&format!("data-series=\"total\" data-points=\"{points}\"")), "{chart}");
    assert!(chart.contains(&format!("data-bytes=\"{IN_USE}\"")), "{chart}");
    // The time axis ends at most a quarter past the last point.
    let last_point = report["timeline"]["time_s"].as_array().unwrap().last().unwrap().as_f64().unwrap();
    let axis_end = chart
        .split(" s</text>")
        .filter_map(|before| before.rsplit('>').next()?.parse::<f64>().ok())
        .fold(0.0, f64::max);
    assert!(
        axis_end >= last_point && axis_end <= 1.25 * last_point,
        "axis to {axis_end} s, last point at {last_point} s"
    );
    let grow = &report["stacks"].as_array().unwrap().iter().find(|s| s["frames"][0]["function"] == GROW.0).unwrap();
    let grow_id = grow["stack_id"].as_str().unwrap();
    assert!(chart.contains(&format!("data-series=\"{grow_id}\"")), "the leak has its line: {chart}");
    assert!(chart.contains("leak: grow_site (reports.c:"), "{chart}");
    assert!(chart.contains("leak: grow_site (reports.c:11): 98,304 bytes at the last point"), "{chart}");
    // The peak, marked: the last churn_site block beside everything held then.
    assert_eq!(report["peak"]["bytes"], IN_USE + 512);
    assert!(chart.contains("<circle class=\"peak\""), "{chart}");
    assert!(chart.contains("Peak (marked): 108,816 bytes in use at "), "{chart}");

    // The growing site is the only leak candidate, with its score and reason.
    let leaks = section(&dom, "leaks");
    assert_eq!(leaks.matches("<tr class=\"leak\"").count(), 1, "{leaks}");
    let leak = row(leaks, "grow_site (reports.c:");
    assert!(leak.contains("data-key=\"outstanding_bytes\">98,304<"), "{leak}");
    let score: f64 = leak.split("class=\"num score\">").nth(1).unwrap().split('<').next().unwrap().parse().unwrap();
    assert!((score - grow["leak"]["score"].as_f64().unwrap()).abs() < 0.006, "{leak}");
    assert!(leak.contains("leak candidate: grew in"), "{leak}");

    let stacks = section(&dom, "stacks");
    assert!(row(stacks, "grow_site (reports.c:").contains("data-key=\"outstanding_bytes\">98,304<"), "{stacks}");
    assert!(row(stacks, "hold_site (reports.c:").contains("data-key=\"outstanding_bytes\">10,000<"), "{stacks}");
    assert!(!stacks.contains("churn_site"), "{stacks}");
    // The pages each stack pins and the process's, as its JSON says (docs: guide/resident-memory.md#resident-memory-against-the-heap;
    // exact counts are tested on resident.c in tests/tests/peaks.rs). The run ends with the
    // process: the figures are the last interval's.
    let hold = report["stacks"].as_array().unwrap().iter().find(|s| s["frames"][0]["function"] == "hold_site").unwrap();
    let pinned = hold["pinned_bytes"].as_u64().expect("pinned_bytes");
    assert!(row(stacks, "hold_site (reports.c:").contains(&format!("data-key=\"pinned_bytes\">{}<", grouped(pinned))));
    let pages = report["memory"]["pinned_pages"].as_u64().expect("memory read while the process ran");
    assert!(summary.contains(&format!(" in {} pages<", grouped(pages))), "{summary}");

    // The call tree opens on the heavy paths; the leaking one is marked.
    let tree = section(&dom, "tree");
    assert!(tree.contains("2 stacks holding 108,304 bytes in use"), "{tree}");
    assert!(tree.contains("<span class=\"swatch leak\"></span>on the path of a leak candidate"), "a legend: {tree}");
    assert!(tree.contains("<li class=\"node leak\" data-bytes=\"98304\">"), "{tree}");
    assert!(tree.contains("<li class=\"node\" data-bytes=\"10000\">"), "{tree}");

    let sizes = section(&dom, "sizes");
    for (range, count) in [("257 – 512 B", 24), ("513 – 1,024 B", 10), ("2,049 – 4,096 B", 24)] {
        assert!(row(sizes, range).contains(&format!("data-key=\"count\">{count}<")), "{sizes}");
    }
    let lifetimes: u64 = report["lifetimes"].as_array().unwrap().iter().map(|b| b["count"].as_u64().unwrap()).sum();
    assert_eq!(lifetimes, 24, "churn_site's frees");
    assert!(section(&dom, "lifetimes").contains("24 in all."));

    // The filter, as typed or given in the address, keeps the matching stacks and opens them.
    let filtered = dom_of_filter(&url, "hold");
    let tree = section(&filtered, "tree");
    assert!(tree.contains("1 of 2 stacks match, holding 10,000 of 108,304 bytes in use"), "{tree}");
    assert!(tree.contains("<li class=\"node match\" data-bytes=\"10000\">"), "{tree}");
    assert!(!tree.contains("grow_site"), "{tree}");
    let by_module = section(&dom_of_filter(&url, "LIBC.so"), "tree").to_string();
    assert!(by_module.contains("2 of 2 stacks match"), "module names match too: {by_module}");

    let screenshot = temp_path("report.png");
    chromium(&[&format!("--screenshot={}", screenshot.display()), "--window-size=1280,2000", &url]);
    let png = std::fs::read(&screenshot).expect("chromium wrote the screenshot");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 50_000, "a real picture: {} bytes", png.len());
    let _ = std::fs::remove_file(&screenshot);
    let _ = std::fs::remove_file(&page);
}

/// An inspected process's page (`reachability_types.cpp`, see tests/tests/inspect.rs): the stack
/// table's reachability column, and the section with the classes, the C++ types and the stacks
/// with lost blocks.
#[test]
fn the_html_report_shows_what_an_inspection_found() {
    let program = fixture_cpp("reachability_types.cpp", "reachability_types", &["-g", "-O2", "-fomit-frame-pointer"]);
    let page = temp_path("inspected.html");
    let mut target = Waiting::start(&program, &[]);
    let pid = target.pid().to_string();
    let mut memprof = Command::new(memprof_bin());
    memprof.args([
        "attach",
        "--pid",
        &pid,
        "--max-rate",
        "off",
        "--format",
        "html",
        "-o",
        page.to_str().unwrap(),
        "--inspect",
    ]);
    memprof.args(["--duration", "2", "--interval", "1"]).stdin(Stdio::null());
    let outcome = released(memprof, &[format!("memprof: tracing pid {pid} ")], |_| target.go());
    assert!(outcome.status.success(), "{outcome:?}");
    let dom = dom(&format!("file://{}", page.display()));
    let inspection = section(&dom, "inspection");
    // circles 2 x 16, widgets 1 x 40, mixed 16 + 40 + 24 lost; one of each class kept.
    assert!(inspection.contains("data-key=\"definitely_lost_bytes\">152<"), "{inspection}");
    assert!(inspection.contains("data-key=\"definitely_lost_blocks\">6<"), "{inspection}");
    assert!(inspection.contains("data-key=\"reachable_bytes\">56<"), "{inspection}");
    let widgets = row(inspection, "data-type=\"ns::Widget\"");
    assert!(widgets.contains(">120<") && widgets.contains(">3<"), "{widgets}");
    let mixed = row(section(&dom, "inspection"), "mixed(");
    assert!(mixed.contains("ns::Widget 40 B in 1, Circle 16 B in 1"), "{mixed}");
    let stacks = section(&dom, "stacks");
    assert!(stacks.contains("<th>reachability</th>"), "{stacks}");
    let circles = row(stacks, "circles()");
    assert!(circles.contains("definitely lost 32 B in 2 (retaining 32 B); reachable 16 B in 1"), "{circles}");
    assert!(circles.contains("types: Circle 48 B in 3"), "{circles}");
    let _ = std::fs::remove_file(&page);
}

#[test]
fn the_call_tree_filters_as_one_types_and_expands_on_click() {
    let page_file = temp_path("tree.html");
    std::fs::write(&page_file, run_format("html")).unwrap();
    let mut page = cdp::Page::open(&CHROMIUM, chromium_profile(), &format!("file://{}", page_file.display()));
    let status = "document.getElementById('tree-status').textContent";
    // The names of the tree's rows, outermost first as drawn.
    let rows = "[...document.querySelectorAll('#tree .function')].map(e => e.textContent).join(' ')";
    assert_eq!(page.eval(status), "2 stacks holding 108,304 bytes in use");
    assert_eq!(page.eval(rows), "_start __libc_start_main_impl __libc_start_call_main main grow_site hold_site");

    page.eval("document.getElementById('tree-filter').focus()");
    page.type_text("hold_s");
    assert_eq!(page.eval(status), "1 of 2 stacks match, holding 10,000 of 108,304 bytes in use");
    assert_eq!(page.eval(rows), "_start __libc_start_main_impl __libc_start_call_main main hold_site");
    assert_eq!(
        page.eval("[...document.querySelectorAll('#tree .match .function')].map(e => e.textContent)"),
        json!(["hold_site"])
    );
    assert_eq!(page.eval("location.hash"), "#filter=hold_s", "the filter is kept in the address");

    page.eval("document.getElementById('tree-filter').select()");
    page.type_text("no such function");
    assert_eq!(page.eval(status), "0 of 2 stacks match, holding 0 of 108,304 bytes in use");
    assert_eq!(page.eval("document.querySelectorAll('#tree li').length"), 0);

    // Allocation sites first: the sites are the roots, the leaking one in red.
    let filter = "document.getElementById('tree-filter')";
    page.eval(&format!("{filter}.value = ''; {filter}.dispatchEvent(new Event('input'))"));
    let order = "document.getElementById('tree-order')";
    page.eval(&format!("{order}.value = 'sites'; {order}.dispatchEvent(new Event('change'))"));
    let roots = "[...document.querySelectorAll('#tree > li')].map(li => [li.querySelector('.function').textContent, li.className, li.dataset.bytes])";
    assert_eq!(page.eval(roots), json!([["grow_site", "node leak open", "98304"], ["hold_site", "node", "10000"]]));

    // A click on a toggle opens or closes its node; the buttons open and close them all.
    let nodes = "document.querySelectorAll('#tree li').length";
    assert_eq!(page.eval(nodes), 6, "grow_site's path is open, hold_site's closed");
    page.eval("document.querySelectorAll('#tree > li')[1].querySelector('.toggle').click()");
    assert_eq!(page.eval(nodes), 7, "hold_site opened on its caller");
    page.eval("document.getElementById('tree-collapse').click()");
    assert_eq!(page.eval(nodes), 2);
    page.eval("document.getElementById('tree-expand').click()");
    assert_eq!(page.eval(nodes), 10, "two paths of five frames");
    let _ = std::fs::remove_file(&page_file);
}

#[test]
fn sampled_reports_say_their_numbers_are_estimates() {
    let svg = String::from_utf8(run_format_with("flamegraph", &["--sample-bytes", "4096"])).unwrap();
    let document = parse_svg(&svg);
    let subtitle = document.descendants().find(|n| n.attribute("id") == Some("subtitle")).and_then(|n| n.text());
    let subtitle = subtitle.expect("a subtitle");
    assert!(subtitle.starts_with("about ") && subtitle.contains("estimated from one allocation in every 4096 bytes"));

    let page = temp_path("sampled.html");
    std::fs::write(&page, run_format_with("html", &["--sample-bytes", "4096"])).unwrap();
    let dom = dom(&format!("file://{}", page.display()));
    let _ = std::fs::remove_file(&page);
    assert_eq!(embedded_report(&dom)["sample_bytes"], 4096);
    assert!(
        dom.contains("Sampled: one allocation in every 4,096 bytes is recorded; counts and bytes are estimates."),
        "{dom}"
    );
    let summary = section(&dom, "summary");
    assert!(summary.contains(">Nothing was dropped.<"), "not every call is recorded: {summary}");
}

fn dom_of_filter(url: &str, filter: &str) -> String {
    let dom = dom(&format!("{url}#filter={filter}"));
    assert!(dom
        .contains(&format!("id=\"tree-filter\" placeholder=\"filter by function or module name\" value=\"{filter}\"")));
    dom
}

#[test]
fn the_daemon_serves_the_flame_graph_and_the_report() {
    let mut target = Waiting::start(&fixture("daemon_target"), &[]);
    let pid = target.pid();
    let daemon = Daemon::start(&["--pid", &pid.to_string()]);
    daemon.wait_traced(pid);
    target.go();
    let leaks = format!("/api/v1/leaks?pid={pid}");
    wait_for(20, "the held blocks", || (site(&daemon.get_json(&leaks).1, "hold_site") == (50_000, 50)).then_some(()));

    let svg = daemon.answer(&format!("/api/v1/flamegraph?pid={pid}")).unwrap();
    assert_eq!(svg.status, 200);
    assert_eq!(svg.header("content-type"), Some("image/svg+xml"));
    let document = parse_svg(&svg.body);
    assert_eq!(frame_bytes(&document, "hold_site"), Some(50_000), "{}", svg.body);

    let page = daemon.answer(&format!("/report?pid={pid}")).unwrap();
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").unwrap().starts_with("text/html"));
    // The page as a browser shows what the daemon served (a browser reaches the port, which
    // serves reports only with a password: see http.rs).
    let served = std::env::temp_dir().join(format!("memprof-served-{}.html", std::process::id()));
    std::fs::write(&served, &page.body).unwrap();
    let dom = dom(&format!("file://{}", served.display()));
    let _ = std::fs::remove_file(&served);
    assert!(dom.contains("<h1>memprof: pid"), "{dom}");
    assert!(dom.contains("live report after "), "the process goes on: {dom}");
    assert!(row(section(&dom, "stacks"), "hold_site (daemon_target.c:").contains(">50,000<"), "{dom}");

    for path in ["/api/v1/flamegraph", "/report"] {
        let missing = daemon.answer(path).unwrap();
        assert_eq!(missing.status, 400);
        assert!(missing.body.contains(&format!("{path}?pid=N")), "{}", missing.body);
        assert_eq!(daemon.answer(&format!("{path}?pid=x")).unwrap().status, 400);
        let untraced = daemon.answer(&format!("{path}?pid=1")).unwrap();
        assert_eq!(untraced.status, 404);
        assert!(untraced.body.contains("\"error\""), "{}", untraced.body);
    }
    let index = daemon.answer("/").unwrap().body;
    assert!(index.contains(&format!("/report?pid={pid}")) && index.contains(&format!("/api/v1/flamegraph?pid={pid}")));
}
