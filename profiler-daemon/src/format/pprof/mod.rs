//! pprof's profile.proto (github.com/google/pprof/proto/profile.proto), gzip-compressed: what
//! `go tool pprof` reads. A heap profile with Go's four sample types, in Go's order, and three of
//! memprof's and the mapped memory's after them, of one process or of several (the daemon's profile of the host), each
//! sample labelled; with the bytes of each reachability class as four more sample types when a
//! process was inspected.

mod decode;
mod encode;
mod wire;

pub use decode::{read, PprofError};
pub use encode::{render, render_parts};

use crate::{
    heap::report::{self, Report, StackReport},
    symbolize::Frame,
};

/// One process's samples in a profile.
pub struct Part<'a> {
    pub report: &'a Report,
    /// Stacks written after the report's: the daemon keeps those that freed all they allocated
    /// apart from its report.
    pub more_stacks: &'a [StackReport],
    /// Labels each of its samples carries beside its stack's own (`stack_id`, `leak`).
    pub labels: Vec<(&'static str, Label)>,
    /// A frame added outermost to each of its stacks: the process, when a session's profile
    /// holds its children too (as in the flame graph).
    pub outermost: Option<Frame>,
}

/// A label's value. `go tool pprof -tagfocus=KEY=N` compares numbers exactly, and takes a text
/// value as a regular expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Label {
    Text(String),
    Number(u64),
}

impl<'a> Part<'a> {
    /// A process's samples, labelled `pid` (a number, so that `-tagfocus=pid=N` is exact), `comm`,
    /// `exe` and, when known, `cgroup` (its path in the unified hierarchy: a container or a
    /// systemd service).
    pub fn labelled(report: &'a Report, more_stacks: &'a [StackReport], cgroup: Option<&str>) -> Self {
        let mut labels = vec![
            ("pid", Label::Number(report.pid.into())),
            ("comm", Label::Text(report.comm.clone())),
            ("exe", Label::Text(report.exe.clone())),
        ];
        labels.extend(cgroup.map(|cgroup| ("cgroup", Label::Text(cgroup.to_string()))));
        Self { report, more_stacks, labels, outermost: None }
    }

    /// A session's report and its followed children, each process its own part.
    pub fn session(report: &'a Report) -> Vec<Self> {
        let processes: Vec<&Report> = std::iter::once(report).chain(&report.children).collect();
        let many = processes.len() > 1;
        processes
            .into_iter()
            .map(|process| Self {
                outermost: many.then(|| report::process_frame(process)),
                ..Self::labelled(process, &[], None)
            })
            .collect()
    }
}

/// The sample types: Go's four in Go's order (tools that expect a Go heap profile find them
/// where Go puts them), then each stack's own high-water mark, its temporary allocations and the
/// resident bytes its blocks pin (docs: outputs/pprof.md#pprof); last the bytes of anonymous mappings a stack
/// holds (docs: guide/mappings.md#memory-outside-malloc-mappings), on samples of their own, so that no total adds them to
/// the heap. Each sample's values are in this order too.
pub const SAMPLE_TYPES: [(&str, &str); 8] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
    ("max_inuse_space", "bytes"),
    ("temporary_objects", "count"),
    ("pinned_space", "bytes"),
    ("mapped_space", "bytes"),
];

/// Where `mapped_space` is in `SAMPLE_TYPES`.
const MAPPED_SPACE: usize = 7;

/// A stack's values, in the order of `SAMPLE_TYPES`.
fn values(stack: &StackReport) -> [u64; SAMPLE_TYPES.len()] {
    [
        stack.allocations,
        stack.allocated_bytes,
        stack.outstanding_allocations,
        stack.outstanding_bytes,
        stack.max_outstanding_bytes,
        stack.temporary_allocations,
        stack.pinned_bytes,
        0,
    ]
}

/// The sample types after `SAMPLE_TYPES` when a process was inspected (`--inspect`): each stack's
/// bytes per class, as in its `reachability`.
pub const CLASS_TYPES: [(&str, &str); 4] =
    [("definitely_lost", "bytes"), ("indirectly_lost", "bytes"), ("possibly_lost", "bytes"), ("reachable", "bytes")];

/// The sample type `go tool pprof` shows unless told otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultType {
    /// A heap profile: what is in use now.
    InuseSpace,
    /// An allocation profile: everything allocated since tracing began.
    AllocSpace,
}

impl DefaultType {
    fn name(self) -> &'static str {
        match self {
            DefaultType::InuseSpace => "inuse_space",
            DefaultType::AllocSpace => "alloc_space",
        }
    }
}

/// Field numbers of profile.proto's messages.
mod field {
    pub mod profile {
        pub const SAMPLE_TYPE: u32 = 1;
        pub const SAMPLE: u32 = 2;
        pub const MAPPING: u32 = 3;
        pub const LOCATION: u32 = 4;
        pub const FUNCTION: u32 = 5;
        pub const STRING_TABLE: u32 = 6;
        pub const TIME_NANOS: u32 = 9;
        pub const DURATION_NANOS: u32 = 10;
        pub const PERIOD_TYPE: u32 = 11;
        pub const PERIOD: u32 = 12;
        pub const COMMENT: u32 = 13;
        pub const DEFAULT_SAMPLE_TYPE: u32 = 14;
    }
    pub mod value_type {
        pub const TYPE: u32 = 1;
        pub const UNIT: u32 = 2;
    }
    pub mod sample {
        pub const LOCATION_ID: u32 = 1;
        pub const VALUE: u32 = 2;
        pub const LABEL: u32 = 3;
    }
    pub mod label {
        pub const KEY: u32 = 1;
        pub const STR: u32 = 2;
        pub const NUM: u32 = 3;
    }
    pub mod mapping {
        pub const ID: u32 = 1;
        pub const MEMORY_START: u32 = 2;
        pub const MEMORY_LIMIT: u32 = 3;
        pub const FILE_OFFSET: u32 = 4;
        pub const FILENAME: u32 = 5;
        pub const BUILD_ID: u32 = 6;
        pub const HAS_FUNCTIONS: u32 = 7;
        pub const HAS_FILENAMES: u32 = 8;
        pub const HAS_LINE_NUMBERS: u32 = 9;
        pub const HAS_INLINE_FRAMES: u32 = 10;
    }
    pub mod location {
        pub const ID: u32 = 1;
        pub const MAPPING_ID: u32 = 2;
        pub const ADDRESS: u32 = 3;
        pub const LINE: u32 = 4;
    }
    pub mod line {
        pub const FUNCTION_ID: u32 = 1;
        pub const LINE: u32 = 2;
    }
    pub mod function {
        pub const ID: u32 = 1;
        pub const NAME: u32 = 2;
        pub const SYSTEM_NAME: u32 = 3;
        pub const FILENAME: u32 = 4;
    }
}

/// The label each sample carries with its report's `stack_id`.
const STACK_ID_LABEL: &str = "stack_id";
/// The label each sample carries with the leak rule's state of its stack: `candidate`, `no`, or
/// `warming_up` (too few intervals seen for a verdict).
const LEAK_LABEL: &str = "leak";

/// The label of a mapping's sample: `program`, or `allocator` for memory a probed allocator
/// mapped for its blocks (which the heap's samples count already).
const MAPPED_BY_LABEL: &str = "mapped_by";

/// The function of the one location of a sample whose stack memprof could not record.
const NO_STACK: &str = "[no stack]";

#[cfg(test)]
mod tests {
    use super::{decode::PprofError, wire::Reader, *};
    use crate::{
        heap::{
            inspect::{Inspection, Reachability},
            mappings::MappingStack,
            report::{samples, Report},
        },
        symbolize::Frame,
    };

    /// The sample report, plus a stack with an inlined frame and a fully freed one without frames.
    fn report() -> Report {
        let mut report = samples::report();
        let mut stack = report.stacks[0].clone();
        let at = |address: &str, mut frame: Frame, inlined| {
            frame.address = address.into();
            frame.inlined = inlined;
            frame
        };
        stack.stack_id = "01".into();
        stack.frames = vec![
            at("0x1500", samples::frame("inlined_helper", Some("cache.h"), Some(3)), true),
            at("0x1500", samples::frame("grow", Some("cache.c"), Some(40)), false),
            at("0x1234", samples::frame("leak_here", Some("leaky.c"), Some(12)), false),
            at("0x7f00", samples::frame("libc.so.6+0x29d90", None, None), false),
        ]
        .into();
        std::sync::Arc::make_mut(&mut stack.frames)[3].module = "/lib/libc.so.6".into();
        (stack.outstanding_bytes, stack.outstanding_allocations, stack.allocations, stack.allocated_bytes) =
            (300, 3, 5, 500);
        let mut freed = stack.clone();
        (freed.stack_id, freed.frames) = ("none".into(), Default::default());
        (freed.outstanding_bytes, freed.outstanding_allocations, freed.allocations, freed.allocated_bytes) =
            (0, 0, 7, 70);
        report.stacks.extend([stack, freed]);
        report
    }

    #[test]
    fn what_is_encoded_decodes_to_the_same_frames_and_values() {
        let mut report = report();
        let mapped = MappingStack {
            stack_id: "0m".into(),
            outstanding_bytes: 8192,
            ranges: 2,
            in_allocator: false,
            truncated: false,
            frames: report.stacks[0].frames.clone(),
        };
        report.mappings.stacks.push(mapped);
        let decoded = read(&render(&report, DefaultType::AllocSpace)).unwrap();
        assert_eq!(decoded.sample_types, SAMPLE_TYPES.map(|(name, _)| name));
        assert_eq!(decoded.sample_types[MAPPED_SPACE], "mapped_space");
        assert_eq!(decoded.default_sample_type, "alloc_space");
        assert_eq!(decoded.samples.len(), report.stacks.len() + 1);
        let mapping = decoded.samples.last().unwrap();
        assert_eq!(mapping.values, [0, 0, 0, 0, 0, 0, 0, 8192], "mapped bytes in their own type only");
        assert_eq!(mapping.stack_id.as_deref(), Some("0m"));
        for (sample, stack) in decoded.samples.iter().zip(&report.stacks) {
            assert_eq!(sample.values, values(stack));
            assert_eq!(sample.frames, *stack.frames, "{}", stack.stack_id);
            assert_eq!(sample.stack_id.as_deref(), Some(stack.stack_id.as_str()));
        }
        assert_eq!(read(&render(&report, DefaultType::InuseSpace)).unwrap().default_sample_type, "inuse_space");
    }

    #[test]
    fn an_inspected_report_has_the_bytes_of_each_class() {
        let mut report = report();
        report.inspection = Some(Inspection::default());
        report.stacks[0].reachability = Some(Reachability {
            definitely_lost_bytes: 40,
            indirectly_lost_bytes: 30,
            possibly_lost_bytes: 20,
            reachable_bytes: 10,
            ..Reachability::default()
        });
        let decoded = read(&render(&report, DefaultType::InuseSpace)).unwrap();
        let classes = ["definitely_lost", "indirectly_lost", "possibly_lost", "reachable"];
        let classes_at = SAMPLE_TYPES.len();
        assert_eq!(decoded.sample_types[classes_at..], classes);
        assert_eq!(decoded.samples[0].values[classes_at..], [40, 30, 20, 10]);
        // A stack with no block tracked when inspected has none in any class.
        assert_eq!(decoded.samples[1].values[classes_at..], [0, 0, 0, 0]);
    }

    /// The profile's messages of field `number`, each as its fields' integer values.
    fn messages(profile: &[u8], number: u32) -> Vec<Vec<(u32, u64)>> {
        let inner = Reader::new(profile).map(Result::unwrap).filter(|(n, _)| *n == number);
        inner
            .map(|(_, v)| {
                Reader::new(v.bytes().unwrap())
                    .map(Result::unwrap)
                    .filter_map(|(n, v)| v.int().ok().map(|i| (n, i)))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn modules_become_mappings_and_inlined_frames_lines_of_one_location() {
        let report = report();
        let profile = encode::encode(&Part::session(&report), None, DefaultType::InuseSpace, 1);
        let strings: Vec<String> = Reader::new(&profile)
            .map(Result::unwrap)
            .filter(|(n, _)| *n == field::profile::STRING_TABLE)
            .map(|(_, v)| String::from_utf8(v.bytes().unwrap().to_vec()).unwrap())
            .collect();
        assert_eq!(strings[0], "");
        use field::mapping as m;
        let mappings = messages(&profile, field::profile::MAPPING);
        // The leaky binary (with its code mapping) and libc (not among the report's modules).
        assert_eq!(mappings.len(), 2);
        let get = |fields: &[(u32, u64)], n| fields.iter().find(|(k, _)| *k == n).map_or(0, |(_, v)| *v);
        let leaky = &mappings[0];
        assert_eq!(strings[get(leaky, m::FILENAME) as usize], "/usr/bin/leaky");
        assert_eq!(strings[get(leaky, m::BUILD_ID) as usize], "0badc0de");
        assert_eq!(
            (get(leaky, m::MEMORY_START), get(leaky, m::MEMORY_LIMIT), get(leaky, m::FILE_OFFSET)),
            (0x1000, 0x2000, 0x1000)
        );
        assert_eq!(get(leaky, m::HAS_INLINE_FRAMES), 1);
        assert_eq!(strings[get(&mappings[1], m::FILENAME) as usize], "/lib/libc.so.6");
        // Locations: leak_here (stack 1); 0x1500 with two lines, 0x1234 again, libc (stack 2); [no stack].
        let locations =
            Reader::new(&profile).map(Result::unwrap).filter(|(n, _)| *n == field::profile::LOCATION).count();
        assert_eq!(locations, 4);
        let types = messages(&profile, field::profile::SAMPLE_TYPE);
        let names: Vec<_> = types.iter().map(|t| strings[get(t, field::value_type::TYPE) as usize].as_str()).collect();
        assert_eq!(
            names,
            [
                "alloc_objects",
                "alloc_space",
                "inuse_objects",
                "inuse_space",
                "max_inuse_space",
                "temporary_objects",
                "pinned_space",
                "mapped_space"
            ]
        );
        let units: Vec<_> = types.iter().map(|t| strings[get(t, field::value_type::UNIT) as usize].as_str()).collect();
        assert_eq!(units, ["count", "bytes", "count", "bytes", "bytes", "count", "bytes", "bytes"]);
    }

    #[test]
    fn a_sampled_report_has_its_sampling_rate_as_period() {
        let period = |report: &Report| {
            let profile = encode::encode(&Part::session(report), None, DefaultType::InuseSpace, 1);
            let mut fields = Reader::new(&profile).map(Result::unwrap);
            fields.find(|(n, _)| *n == field::profile::PERIOD).map(|(_, v)| v.int().unwrap())
        };
        let mut sampled = report();
        assert_eq!(period(&sampled), Some(1), "every allocation counted");
        sampled.sample_bytes = 512 * 1024;
        assert_eq!(period(&sampled), Some(512 * 1024));
    }

    #[test]
    fn what_is_not_a_profile_is_an_error() {
        assert!(matches!(read(b"{\"final\": true}"), Err(PprofError::NotAProfile)));
        assert!(matches!(read(&[0x1f, 0x8b, 0, 1, 2]), Err(PprofError::Gzip(_))));
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gzip, b"\x0b garbage").unwrap();
        assert!(matches!(read(&gzip.finish().unwrap()), Err(PprofError::Wire(_))));
    }

    /// One location with a long name, named a million times by one sample in a few kilobytes:
    /// refused, not a million frames of it.
    #[test]
    fn a_sample_of_more_frames_than_any_stack_is_refused() {
        let mut profile = wire::Writer::default();
        profile.message(field::profile::SAMPLE_TYPE, |t| t.uint(field::value_type::TYPE, 1));
        profile.message(field::profile::SAMPLE, |s| {
            s.packed(field::sample::LOCATION_ID, &vec![1; 1_000_000]);
            s.packed(field::sample::VALUE, &[1]);
        });
        profile.message(field::profile::LOCATION, |l| {
            l.uint(field::location::ID, 1);
            l.message(field::location::LINE, |line| line.uint(field::line::FUNCTION_ID, 1));
        });
        profile.message(field::profile::FUNCTION, |f| {
            f.uint(field::function::ID, 1);
            f.uint(field::function::NAME, 2);
        });
        for string in ["", "space", &"f".repeat(4096)] {
            profile.bytes(field::profile::STRING_TABLE, string.as_bytes());
        }
        assert!(matches!(decode::decode(&profile.into_bytes()), Err(PprofError::TooDeep)));
    }

    #[test]
    fn a_profile_reads_the_same_without_its_gzip() {
        let gzipped = render(&report(), DefaultType::InuseSpace);
        let mut plain = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gzipped.as_slice()), &mut plain).unwrap();
        assert_eq!(read(&plain).unwrap(), read(&gzipped).unwrap());
    }
}
