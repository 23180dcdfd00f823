//! Reports as a profile: one sample per stack of each process, one location per return address
//! (its inlined frames as extra lines), one mapping per module of each process. Each sample
//! carries labels for `-tagfocus` and `-tags`: its stack id, its leak state and its process's.

use std::{collections::HashMap, io::Write as _, time::SystemTime};

use flate2::{write::GzEncoder, Compression};

use super::{
    field, values, wire::Writer, DefaultType, Label, Part, CLASS_TYPES, LEAK_LABEL, MAPPED_BY_LABEL, MAPPED_SPACE,
    NO_STACK, SAMPLE_TYPES, STACK_ID_LABEL,
};
use crate::{
    heap::{
        context::RunContext,
        mappings::MappingStack,
        report::{Report, StackReport},
    },
    symbolize::Frame,
};

/// A session's report (with its children) as a gzip-compressed profile.proto whose default
/// sample type is `default`.
pub fn render(report: &Report, default: DefaultType) -> Vec<u8> {
    // When the report was taken: from the run's start for a session's, so that a recording
    // renders the same profile every time.
    let now = match &report.context {
        Some(context) => context.started_unix_ns + (report.duration_s * 1e9) as u64,
        None => unix_now(),
    };
    compressed(&encode(&Part::session(report), report.context.as_ref(), default, now))
}

/// Several processes' stacks as one gzip-compressed profile, each sample carrying its process's
/// labels (see `Part`).
pub fn render_parts(parts: &[Part], default: DefaultType) -> Vec<u8> {
    compressed(&encode(parts, None, default, unix_now()))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

fn compressed(profile: &[u8]) -> Vec<u8> {
    let mut gzip = GzEncoder::new(Vec::new(), Compression::default());
    gzip.write_all(profile).expect("writing to memory cannot fail");
    gzip.finish().expect("writing to memory cannot fail")
}

/// The leak rule's state of a stack, as its `leak` label says it.
fn leak_label(stack: &StackReport) -> &'static str {
    match (stack.leak.candidate, stack.leak.warming_up) {
        (true, _) => "candidate",
        (false, Some(_)) => "warming_up",
        (false, None) => "no",
    }
}

/// The uncompressed profile of `parts`, taken at `time_nanos` (since the Unix epoch); `context`
/// (a session's run) goes in its comments.
pub(super) fn encode(parts: &[Part], context: Option<&RunContext>, default: DefaultType, time_nanos: u64) -> Vec<u8> {
    let mut tables = Tables::default();
    tables.string("");
    let mut samples = Vec::new();
    let inspected = parts.iter().any(|part| part.report.inspection.is_some());
    for (index, part) in parts.iter().enumerate() {
        let labels: Vec<(u64, Value)> = part
            .labels
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    Label::Text(text) => Value::Text(tables.string(text)),
                    Label::Number(number) => Value::Number(*number),
                };
                (tables.string(key), value)
            })
            .collect();
        for stack in part.report.stacks.iter().chain(part.more_stacks) {
            let mut sample = tables.sample(index, stack, part.outermost.as_ref(), inspected);
            sample.labels.extend(labels.iter().copied());
            samples.push(sample);
        }
        for stack in &part.report.mappings.stacks {
            let mut sample = tables.mapping_sample(index, stack, part.outermost.as_ref(), inspected);
            sample.labels.extend(labels.iter().copied());
            samples.push(sample);
        }
    }
    let classes = if inspected { &CLASS_TYPES[..] } else { &[] };
    let sample_types: Vec<[u64; 2]> =
        SAMPLE_TYPES.iter().chain(classes).map(|(kind, unit)| [tables.string(kind), tables.string(unit)]).collect();
    let period_type = [tables.string("space"), tables.string("bytes")];
    let mut comments = match parts {
        [part] => vec![tables.string(&format!("memprof: pid {} ({})", part.report.pid, part.report.comm))],
        _ => vec![tables.string(&format!("memprof: {} processes", parts.len()))],
    };
    if let Some(context) = context {
        let about = format!(
            "started {} on {} by memprof {}: {}",
            context.started,
            context.host,
            context.memprof_version,
            context.command_line.join(" ")
        );
        comments.push(tables.string(&about));
    }
    // What each process's numbers are, and what they miss: as its table report says.
    let who = |part: &Part| if parts.len() > 1 { format!("pid {} ", part.report.pid) } else { String::new() };
    for part in parts {
        let report = &part.report;
        if report.sample_bytes > 0 {
            let sampled =
                format!("sampled: one allocation recorded per {} bytes; values are estimates", report.sample_bytes);
            comments.push(tables.string(&format!("{}{sampled}", who(part))));
        }
        if report.growth.is_some() {
            let growth = "growth: pages by the stack that first touched each; a count is a page";
            comments.push(tables.string(&format!("{}{growth}", who(part))));
        }
        if let Some(samples) = report.usdt_samples {
            let mode = crate::heap::sampling::usdt_mode(samples, report.usdt_beside_calls);
            comments.push(tables.string(&format!("{}{mode}", who(part))));
        }
        for spot in &report.blind_spots {
            comments.push(tables.string(&format!("{}not seen: {}; {}", who(part), spot.what, spot.advice)));
        }
        if let Some(dropped) = report.dropped_line() {
            let lost = format!("{dropped} (docs: reference/drop-reasons.md)");
            comments.push(tables.string(&format!("{}{lost}", who(part))));
        }
    }
    let default_type = tables.string(default.name());
    let mappings = tables.mappings(parts);
    // As Go does: the sampling rate in bytes, the values already scaled up to estimates. 1 when
    // every allocation is counted, or when the processes are sampled at different rates (their
    // comments say which).
    let mut rates = parts.iter().map(|part| part.report.sample_bytes);
    let first = rates.next().unwrap_or(0);
    let period = if rates.all(|rate| rate == first) { first.max(1) } else { 1 };
    let duration_s = parts.iter().map(|part| part.report.duration_s).fold(0.0, f64::max);

    use field::profile as p;
    let mut out = Writer::default();
    for [kind, unit] in sample_types {
        out.message(p::SAMPLE_TYPE, |m| value_type(m, kind, unit));
    }
    for sample in &samples {
        out.message(p::SAMPLE, |m| {
            m.packed(field::sample::LOCATION_ID, &sample.locations);
            m.packed(field::sample::VALUE, &sample.values);
            for &(key, value) in &sample.labels {
                m.message(field::sample::LABEL, |l| {
                    l.uint(field::label::KEY, key);
                    match value {
                        Value::Text(text) => l.uint(field::label::STR, text),
                        Value::Number(number) => l.uint(field::label::NUM, number),
                    }
                });
            }
        });
    }
    for mapping in &mappings {
        out.message(p::MAPPING, |m| mapping.write(m));
    }
    for (id, location) in (1..).zip(&tables.locations) {
        out.message(p::LOCATION, |m| location.write(m, id));
    }
    for (id, &(name, file)) in (1..).zip(&tables.functions) {
        out.message(p::FUNCTION, |m| {
            use field::function as f;
            m.uint(f::ID, id);
            m.uint(f::NAME, name);
            // memprof keeps only demangled names.
            m.uint(f::SYSTEM_NAME, name);
            m.uint(f::FILENAME, file);
        });
    }
    for string in &tables.strings {
        out.bytes(p::STRING_TABLE, string.as_bytes());
    }
    out.uint(p::TIME_NANOS, time_nanos);
    out.uint(p::DURATION_NANOS, (duration_s * 1e9) as u64);
    out.message(p::PERIOD_TYPE, |m| value_type(m, period_type[0], period_type[1]));
    out.uint(p::PERIOD, period);
    out.packed(p::COMMENT, &comments);
    out.uint(p::DEFAULT_SAMPLE_TYPE, default_type);
    out.into_bytes()
}

fn value_type(m: &mut Writer, kind: u64, unit: u64) {
    m.uint(field::value_type::TYPE, kind);
    m.uint(field::value_type::UNIT, unit);
}

/// A label's value: a string id, or a number.
#[derive(Clone, Copy)]
enum Value {
    Text(u64),
    Number(u64),
}

/// One sample, as ids into the tables.
struct Sample {
    locations: Vec<u64>,
    /// Per sample type.
    values: Vec<u64>,
    /// Keys (string ids) and values.
    labels: Vec<(u64, Value)>,
}

struct Location {
    mapping: u64,
    address: u64,
    /// (function id, line), innermost first.
    lines: Vec<(u64, u64)>,
}

impl Location {
    fn write(&self, m: &mut Writer, id: u64) {
        use field::location as l;
        m.uint(l::ID, id);
        m.uint(l::MAPPING_ID, self.mapping);
        m.uint(l::ADDRESS, self.address);
        for &(function, line) in &self.lines {
            m.message(l::LINE, |m| {
                m.uint(field::line::FUNCTION_ID, function);
                m.uint(field::line::LINE, line);
            });
        }
    }
}

struct Mapping {
    id: u64,
    start: u64,
    limit: u64,
    file_offset: u64,
    filename: u64,
    build_id: u64,
}

impl Mapping {
    fn write(&self, m: &mut Writer) {
        use field::mapping as f;
        m.uint(f::ID, self.id);
        m.uint(f::MEMORY_START, self.start);
        m.uint(f::MEMORY_LIMIT, self.limit);
        m.uint(f::FILE_OFFSET, self.file_offset);
        m.uint(f::FILENAME, self.filename);
        m.uint(f::BUILD_ID, self.build_id);
        // Symbolized already: pprof need not look for the files.
        for flag in [f::HAS_FUNCTIONS, f::HAS_FILENAMES, f::HAS_LINE_NUMBERS, f::HAS_INLINE_FRAMES] {
            m.bool(flag, true);
        }
    }
}

/// The profile's tables, each entry's id its index + 1 (string ids: the index).
#[derive(Default)]
struct Tables {
    strings: Vec<String>,
    string_ids: HashMap<String, u64>,
    /// (name, file name) as string ids.
    functions: Vec<(u64, u64)>,
    function_ids: HashMap<(u64, u64), u64>,
    locations: Vec<Location>,
    /// By part (process), module and address: two processes may map different files at one path
    /// and address.
    location_ids: HashMap<(usize, String, u64), u64>,
    /// Each part's modules in order of first use: mapping ids.
    modules: Vec<(usize, String)>,
}

impl Tables {
    fn string(&mut self, text: &str) -> u64 {
        if let Some(&id) = self.string_ids.get(text) {
            return id;
        }
        let id = self.strings.len() as u64;
        self.strings.push(text.to_string());
        self.string_ids.insert(text.to_string(), id);
        id
    }

    /// The sample of `stack`, of the profile's part `part` (`outermost` added above its frames),
    /// with its own labels; with its bytes per reachability class when `inspected` (0 for a stack
    /// of a process not inspected).
    fn sample(&mut self, part: usize, stack: &StackReport, outermost: Option<&Frame>, inspected: bool) -> Sample {
        let mut values = values(stack).to_vec();
        if inspected {
            let r = stack.reachability.unwrap_or_default();
            values.extend([r.definitely_lost_bytes, r.indirectly_lost_bytes, r.possibly_lost_bytes, r.reachable_bytes]);
        }
        Sample {
            locations: self.locations(part, &stack.frames, outermost),
            values,
            labels: vec![
                (self.string(STACK_ID_LABEL), Value::Text(self.string(&stack.stack_id))),
                (self.string(LEAK_LABEL), Value::Text(self.string(leak_label(stack)))),
            ],
        }
    }

    /// The sample of a stack's mapped memory: its bytes in `mapped_space` only, never in the
    /// heap's types (nor the classes' when `inspected`), and who mapped them in its `mapped_by`
    /// label.
    fn mapping_sample(
        &mut self,
        part: usize,
        stack: &MappingStack,
        outermost: Option<&Frame>,
        inspected: bool,
    ) -> Sample {
        let by = if stack.in_allocator { "allocator" } else { "program" };
        let mut values = vec![0; SAMPLE_TYPES.len() + if inspected { CLASS_TYPES.len() } else { 0 }];
        values[MAPPED_SPACE] = stack.outstanding_bytes;
        Sample {
            locations: self.locations(part, &stack.frames, outermost),
            values,
            labels: vec![
                (self.string(STACK_ID_LABEL), Value::Text(self.string(&stack.stack_id))),
                (self.string(MAPPED_BY_LABEL), Value::Text(self.string(by))),
            ],
        }
    }

    /// The locations of `frames` (`outermost` added above them), innermost first.
    fn locations(&mut self, part: usize, frames: &[Frame], outermost: Option<&Frame>) -> Vec<u64> {
        let mut locations = Vec::new();
        let mut lines: Vec<&Frame> = Vec::new();
        for frame in frames.iter().chain(outermost) {
            lines.push(frame);
            // An inlined frame shares its address with the frames after it, up to the function
            // it is inlined into.
            if !frame.inlined {
                locations.push(self.location(part, &lines));
                lines.clear();
            }
        }
        if !lines.is_empty() {
            // The stack was cut inside inlined frames.
            locations.push(self.location(part, &lines));
        }
        if frames.is_empty() {
            locations.insert(0, self.no_stack());
        }
        locations
    }

    /// The location of frames that share one address, innermost first.
    fn location(&mut self, part: usize, frames: &[&Frame]) -> u64 {
        let address = u64::from_str_radix(frames[0].address.trim_start_matches("0x"), 16).unwrap_or(0);
        let key = (part, frames[0].module.clone(), address);
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let mapping = self.mapping(part, &frames[0].module);
        let lines = frames
            .iter()
            .map(|f| (self.function(&f.function, f.file.as_deref().unwrap_or("")), f.line.map_or(0, u64::from)))
            .collect();
        self.locations.push(Location { mapping, address, lines });
        let id = self.locations.len() as u64;
        self.location_ids.insert(key, id);
        id
    }

    /// A stack memprof could not record (see the report's `dropped`).
    fn no_stack(&mut self) -> u64 {
        let function = self.function(NO_STACK, "");
        self.locations.push(Location { mapping: 0, address: 0, lines: vec![(function, 0)] });
        self.locations.len() as u64
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        let key = (self.string(name), self.string(file));
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        self.functions.push(key);
        let id = self.functions.len() as u64;
        self.function_ids.insert(key, id);
        id
    }

    fn mapping(&mut self, part: usize, module: &str) -> u64 {
        let index = match self.modules.iter().position(|(p, m)| *p == part && m == module) {
            Some(index) => index,
            None => {
                self.modules.push((part, module.to_string()));
                self.modules.len() - 1
            }
        };
        index as u64 + 1
    }

    /// One mapping per module used, spanning its code mappings (none for `[anonymous]` code).
    fn mappings(&mut self, parts: &[Part]) -> Vec<Mapping> {
        let modules = self.modules.clone();
        (1..)
            .zip(&modules)
            .map(|(id, (part, path))| {
                let code: Vec<_> = parts[*part].report.modules.iter().filter(|m| &m.path == path).collect();
                let first = code.iter().min_by_key(|m| m.start);
                Mapping {
                    id,
                    start: first.map_or(0, |m| m.start),
                    limit: code.iter().map(|m| m.limit).max().unwrap_or(0),
                    file_offset: first.map_or(0, |m| m.file_offset),
                    filename: self.string(path),
                    build_id: self.string(first.map_or("", |m| &m.build_id)),
                }
            })
            .collect()
    }
}
