//! A report as a profile: one sample per stack of each process (the traced one and its
//! children), one location per return address (its inlined frames as extra lines), one mapping
//! per module. Each sample carries labels for `-tagfocus` and `-tags`: its stack id, its leak
//! state and its process's pid, command name and executable.

use std::{collections::HashMap, io::Write as _, time::SystemTime};

use flate2::{write::GzEncoder, Compression};

use super::{field, wire::Writer, DefaultType, NO_STACK, SAMPLE_TYPES, STACK_ID_LABEL};
use crate::{
    heap::report::{self, Report, StackReport},
    symbolize::Frame,
};

/// A sample's labels: (key, value).
pub type Labels = Vec<(&'static str, String)>;

/// The labels of every sample of `process`.
pub fn process_labels(process: &Report) -> Labels {
    vec![("pid", process.pid.to_string()), ("comm", process.comm.clone()), ("exe", process.exe.clone())]
}

/// The leak rule's state of a stack, as its `leak` label says it: `candidate`, `no`, or
/// `warming_up` (too few intervals seen for a verdict).
fn leak_label(stack: &StackReport) -> &'static str {
    match (stack.leak.candidate, stack.leak.warming_up) {
        (true, _) => "candidate",
        (false, Some(_)) => "warming_up",
        (false, None) => "no",
    }
}

/// The report as a gzip-compressed profile.proto whose default sample type is `default`.
pub fn render(report: &Report, default: DefaultType) -> Vec<u8> {
    // When the report was taken: from the run's start for a session's, so that a recording
    // renders the same profile every time.
    let now = match &report.context {
        Some(context) => context.started_unix_ns + (report.duration_s * 1e9) as u64,
        None => SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
    };
    let mut gzip = GzEncoder::new(Vec::new(), Compression::default());
    gzip.write_all(&encode(report, default, now)).expect("writing to memory cannot fail");
    gzip.finish().expect("writing to memory cannot fail")
}

/// The uncompressed profile, taken at `time_nanos` (since the Unix epoch).
pub(super) fn encode(report: &Report, default: DefaultType, time_nanos: u64) -> Vec<u8> {
    let mut tables = Tables::default();
    tables.string("");
    let processes: Vec<&Report> = std::iter::once(report).chain(&report.children).collect();
    let mut samples = Vec::new();
    for process in &processes {
        // With children, each process is the outermost frame of its stacks, as in the flame graph.
        let outermost = (processes.len() > 1).then(|| report::process_frame(process));
        let labels = process_labels(process);
        for stack in &process.stacks {
            samples.push(tables.sample(stack, outermost.as_ref(), &labels));
        }
    }
    let sample_types: Vec<[u64; 2]> =
        SAMPLE_TYPES.iter().map(|(kind, unit)| [tables.string(kind), tables.string(unit)]).collect();
    let period_type = [tables.string("space"), tables.string("bytes")];
    let mut comments = vec![tables.string(&format!("memprof: pid {} ({})", report.pid, report.comm))];
    if let Some(context) = &report.context {
        let about = format!(
            "started {} on {} by memprof {}: {}",
            context.started,
            context.host,
            context.memprof_version,
            context.command_line.join(" ")
        );
        comments.push(tables.string(&about));
    }
    if report.sample_bytes > 0 {
        let sampled =
            format!("sampled: one allocation recorded per {} bytes; values are estimates", report.sample_bytes);
        comments.push(tables.string(&sampled));
    }
    let default_type = tables.string(default.name());
    let mappings = tables.mappings(&processes);

    use field::profile as p;
    let mut out = Writer::default();
    for [kind, unit] in sample_types {
        out.message(p::SAMPLE_TYPE, |m| value_type(m, kind, unit));
    }
    for sample in &samples {
        out.message(p::SAMPLE, |m| {
            m.packed(field::sample::LOCATION_ID, &sample.locations);
            m.packed(field::sample::VALUE, &sample.values);
            for [key, value] in &sample.labels {
                m.message(field::sample::LABEL, |l| {
                    l.uint(field::label::KEY, *key);
                    l.uint(field::label::STR, *value);
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
    out.uint(p::DURATION_NANOS, (report.duration_s * 1e9) as u64);
    out.message(p::PERIOD_TYPE, |m| value_type(m, period_type[0], period_type[1]));
    // As Go does: the sampling rate in bytes, the values already scaled up to estimates. 1 when
    // every allocation is counted.
    out.uint(p::PERIOD, report.sample_bytes.max(1));
    out.packed(p::COMMENT, &comments);
    out.uint(p::DEFAULT_SAMPLE_TYPE, default_type);
    out.into_bytes()
}

fn value_type(m: &mut Writer, kind: u64, unit: u64) {
    m.uint(field::value_type::TYPE, kind);
    m.uint(field::value_type::UNIT, unit);
}

/// One sample, as ids into the tables.
struct Sample {
    locations: Vec<u64>,
    values: [u64; 4],
    /// The labels' keys and values.
    labels: Vec<[u64; 2]>,
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
    /// By module, address and innermost function.
    location_ids: HashMap<(String, u64, String), u64>,
    /// Module paths in order of first use: mapping ids.
    modules: Vec<String>,
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

    fn sample(&mut self, stack: &StackReport, outermost: Option<&Frame>, labels: &Labels) -> Sample {
        let mut locations = Vec::new();
        let mut lines: Vec<&Frame> = Vec::new();
        for frame in stack.frames.iter().chain(outermost) {
            lines.push(frame);
            // An inlined frame shares its address with the frames after it, up to the function
            // it is inlined into.
            if !frame.inlined {
                locations.push(self.location(&lines));
                lines.clear();
            }
        }
        if !lines.is_empty() {
            // The stack was cut inside inlined frames.
            locations.push(self.location(&lines));
        }
        if stack.frames.is_empty() {
            locations.insert(0, self.no_stack());
        }
        let own = [(STACK_ID_LABEL, stack.stack_id.as_str()), ("leak", leak_label(stack))];
        let labels = own
            .into_iter()
            .chain(labels.iter().map(|(key, value)| (*key, value.as_str())))
            .map(|(key, value)| [self.string(key), self.string(value)])
            .collect();
        Sample {
            locations,
            values: [stack.allocations, stack.allocated_bytes, stack.outstanding_allocations, stack.outstanding_bytes],
            labels,
        }
    }

    /// The location of frames that share one address, innermost first.
    fn location(&mut self, frames: &[&Frame]) -> u64 {
        let address = u64::from_str_radix(frames[0].address.trim_start_matches("0x"), 16).unwrap_or(0);
        // The function too: processes share a profile, and one file's code may sit at the same
        // address in two of them at different offsets (and every process frame is at 0).
        let key = (frames[0].module.clone(), address, frames[0].function.clone());
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let mapping = self.mapping(&frames[0].module);
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

    fn mapping(&mut self, module: &str) -> u64 {
        let index = match self.modules.iter().position(|m| m == module) {
            Some(index) => index,
            None => {
                self.modules.push(module.to_string());
                self.modules.len() - 1
            }
        };
        index as u64 + 1
    }

    /// One mapping per module used, spanning its code mappings in `processes` (none for
    /// `[anonymous]` code).
    fn mappings(&mut self, processes: &[&Report]) -> Vec<Mapping> {
        let modules = self.modules.clone();
        (1..)
            .zip(&modules)
            .map(|(id, path)| {
                let code: Vec<_> = processes.iter().flat_map(|p| &p.modules).filter(|m| &m.path == path).collect();
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
