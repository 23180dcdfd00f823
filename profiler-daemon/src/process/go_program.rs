//! A Go program built without cgo: statically linked, its only allocator Go's runtime, which
//! memprof probes no call of. Nothing but the runtime's own sampler shows its heap by stack, so
//! memprof traces it through that sampler when nothing else was asked for: found in a running
//! process (`in_process`) or in a command before it starts (`command`). A Go program with cgo
//! has the same sampler beside the C library's allocator (`sampler_beside_calls`).

use std::path::{Path, PathBuf};

use profiler_common::usdt::sampler;

use super::{
    allocator::{self, Allocator, RuntimeOnly},
    usdt::{self, Site},
};
use crate::error::UserError;

/// Why a program is not traced through Go's runtime sampler alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfit {
    /// It is no Go program without cgo whose runtime memprof reads.
    Other,
    /// It is one, but its runtime starts with its sampling off: it links no heap profile, and the
    /// sampler would show nothing.
    SamplingOff,
}

/// Process `pid`'s allocator and its runtime's sampler sites, when it runs a Go program without
/// cgo whose sampler memprof reads. A dynamic program caught before its loader mapped its
/// libraries is not one.
pub fn in_process(pid: u32) -> Result<(Allocator, Vec<Site>), Unfit> {
    if !allocator::statically_linked(pid) {
        return Err(Unfit::Other);
    }
    let allocator = allocator::find_with(pid, RuntimeOnly::Accepted).map_err(|_| Unfit::Other)?;
    sampled(allocator, usdt::in_process(pid))
}

/// As `in_process`, for `program` before it runs, with the files it maps (see
/// `allocator::for_command`).
pub fn command(program: &Path) -> Result<(Allocator, Vec<PathBuf>, Vec<Site>), Unfit> {
    let (allocator, files) = allocator::for_command(program, RuntimeOnly::Accepted).map_err(|_| Unfit::Other)?;
    if files.iter().any(|file| allocator::is_any_dynamic_loader(&file.to_string_lossy())) {
        return Err(Unfit::Other);
    }
    let (allocator, sites) = sampled(allocator, usdt::in_files(&files, program))?;
    Ok((allocator, files, sites))
}

/// The sites of Go's runtime sampler in a Go program with cgo whose `allocator` (the C
/// library's) memprof traces by its calls, among the probe sites `find` finds in its files: Go's
/// heap, which no call shows, is seen through them. None in any other program, or when its
/// sampler cannot show it; the Go heap's blind spot then says why, and what shows it instead.
/// Its `otel_memory` probes, of an allocator whose calls are traced, are left out: they would
/// count its blocks twice.
pub fn sampler_beside_calls(
    allocator: &mut Allocator,
    find: impl FnOnce() -> Result<Vec<Site>, UserError>,
) -> Option<Vec<Site>> {
    // A Go program without cgo has no allocator calls to be beside: `--mappings` traces it by
    // its mappings alone.
    if allocator.files.is_empty() || !allocator.go_heap_unseen() {
        return None;
    }
    let sites: Vec<Site> = match find() {
        Ok(sites) => sites.into_iter().filter(|site| site.spec.sampler == sampler::GO).collect(),
        Err(why) => {
            tracing::debug!("its Go heap stays unseen: {why}");
            allocator.go_heap_unseen_because(&format!("memprof cannot read its runtime's sampler ({why})"));
            return None;
        }
    };
    if sites.is_empty() {
        allocator.go_heap_unseen_because("memprof finds no sampler in its runtime");
        return None;
    }
    if sites.iter().any(|site| site.starts_off) {
        allocator.go_heap_unseen_because(&format!("its {SAMPLES_NOTHING}; {SET_THE_RATE}"));
        return None;
    }
    Some(sites)
}

/// Why a Go runtime's sampler shows nothing (after "its" or "whose"), and the fix in the program.
pub const SAMPLES_NOTHING: &str =
    "runtime samples nothing (runtime.MemProfileRate 0: it links neither runtime/pprof nor net/http/pprof)";
pub const SET_THE_RATE: &str = "set runtime.MemProfileRate in it (Go's default is 524288)";
/// What shows a Go heap that no sampler does.
pub const OTHER_MODES: &str = "--growth (the pages it touches) or --mappings (where it maps its memory)";

/// `sites`, when `allocator` holds no allocator memprof probes and they include a Go runtime's
/// sampler that starts on.
fn sampled(mut allocator: Allocator, sites: Result<Vec<Site>, UserError>) -> Result<(Allocator, Vec<Site>), Unfit> {
    let sites = match sites {
        Ok(sites) => sites,
        Err(why) => {
            tracing::debug!("no sampler to trace it through either: {why}");
            return Err(Unfit::Other);
        }
    };
    if !allocator.files.is_empty() || !sites.iter().any(|site| site.spec.sampler == sampler::GO) {
        return Err(Unfit::Other);
    }
    if sites.iter().any(|site| site.starts_off) {
        return Err(Unfit::SamplingOff);
    }
    allocator.seen_through(&sites);
    Ok((allocator, sites))
}
