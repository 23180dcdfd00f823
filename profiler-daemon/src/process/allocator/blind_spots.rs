//! What memprof knows it does not see in a process: allocators it finds but does not probe
//! (a runtime's garbage-collected heap, CPython's object allocator), and what to do instead.

use serde::{Deserialize, Serialize};

/// Something memprof knows it does not see in a process, and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlindSpot {
    /// `unprobed_allocator` (found in a mapped file), `unseen_growth` (anonymous memory grew
    /// while no probed call was made) or `held_before_pages` (memory held before the process
    /// was traced by its pages).
    pub kind: &'static str,
    pub what: String,
    pub advice: String,
    /// The memory it holds in a few words ("the JVM's heap"), for a runtime's allocator: the
    /// likely owner of resident memory that the heap does not account for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heap: Option<&'static str>,
    /// The bytes of memory it concerns, where memprof measures them: how much anonymous memory
    /// grew unseen (`unseen_growth`), or was held before (`held_before_pages`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// An environment variable (`NAME=value`) under which the process routes this allocator's
    /// memory through malloc after all: then it is no blind spot.
    #[serde(skip)]
    pub unless_env: Option<&'static str>,
}

/// A blind spot as a saved report has it (see `crate::names`).
#[derive(Deserialize)]
struct SavedBlindSpot {
    kind: String,
    what: String,
    advice: String,
    #[serde(default)]
    heap: Option<String>,
    #[serde(default)]
    bytes: Option<u64>,
}

impl<'de> Deserialize<'de> for BlindSpot {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let saved = SavedBlindSpot::deserialize(deserializer)?;
        Ok(Self {
            kind: crate::names::intern(saved.kind),
            what: saved.what,
            advice: saved.advice,
            heap: saved.heap.map(crate::names::intern),
            bytes: saved.bytes,
            unless_env: None,
        })
    }
}

/// An allocator memprof finds but does not probe.
pub(super) struct Unprobed {
    /// A symbol that says a file holds it.
    pub(super) mark: &'static str,
    /// A section that says so too, in a file stripped of its symbols.
    pub(super) section: Option<&'static str>,
    /// What goes unseen, and what to do.
    pub(super) what: &'static str,
    pub(super) advice: &'static str,
    /// `BlindSpot::heap`.
    pub(super) heap: &'static str,
    /// The environment that routes it through malloc.
    pub(super) unless_env: Option<&'static str>,
}

/// Go's heap, which `--usdt` sees through its runtime's own sampler (`process::go_runtime`).
pub(super) const GO_HEAP: &str = "Go's heap";

pub(super) const UNPROBED: [Unprobed; 5] = [
    Unprobed {
        mark: "PyObject_Malloc",
        section: None,
        what: "CPython's object allocator (pymalloc): objects up to 512 bytes come from its own arenas, which malloc never sees",
        advice: "start python with PYTHONMALLOC=malloc to route them through malloc",
        heap: "pymalloc's arenas",
        unless_env: Some("PYTHONMALLOC=malloc"),
    },
    Unprobed {
        mark: "runtime.mallocgc",
        section: Some(".go.buildinfo"),
        what: "Go's runtime allocator: the Go heap never passes through malloc (only cgo's calls do)",
        advice: "trace it with --usdt, which reads the samples Go's runtime takes of its heap, and probes no malloc",
        heap: GO_HEAP,
        unless_env: None,
    },
    Unprobed {
        mark: "JNI_CreateJavaVM",
        section: None,
        what: "the JVM: Java objects live in its garbage-collected heap, which malloc never sees",
        advice: "use the JVM's own tools (jcmd GC.heap_info, Java Flight Recorder)",
        heap: "the JVM's heap",
        unless_env: None,
    },
    Unprobed {
        // v8::Isolate::New: node, and any program that embeds V8.
        mark: "_ZN2v87Isolate3NewERKNS0_12CreateParamsE",
        section: None,
        what: "V8: JavaScript objects live in its garbage-collected heap, which malloc never sees",
        advice: "use V8's own tools (node --heapsnapshot-signal, or a heap snapshot from node --inspect)",
        heap: "V8's heap",
        unless_env: None,
    },
    Unprobed {
        mark: "coreclr_initialize",
        section: None,
        what: ".NET's runtime: managed objects live in its garbage-collected heap, which malloc never sees",
        advice: "use .NET's own tools (dotnet-gcdump, dotnet-counters)",
        heap: ".NET's heap",
        unless_env: None,
    },
];

impl BlindSpot {
    /// The name of the variable of `unless_env`.
    pub fn env_name(&self) -> Option<&'static str> {
        self.unless_env.map(|entry| entry.split_once('=').map_or(entry, |(name, _)| name))
    }
}
