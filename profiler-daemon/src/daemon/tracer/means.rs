//! How the daemon traces each process: by its allocator's calls, or through its allocator's own
//! sampler. Every process with `--usdt`; without it, a process the daemon would not see
//! otherwise (a Go program without cgo: no allocator memprof probes, and neither mappings nor
//! growth traced) when its runtime has a sampler memprof reads.

use heap::sampling::{RateGuard, Sampling};
use profiler_common::usdt::sampler;

use super::Tracer;
use crate::{
    heap,
    process::allocator::{self, Allocator, RuntimeOnly},
    process::usdt::{self, Site},
};

/// What a process is traced by.
pub(super) struct Means {
    pub allocator: Allocator,
    /// The sampler's sites, when it is traced through them rather than by its calls.
    pub sampler: Option<Vec<Site>>,
}

impl Means {
    /// Its `--max-rate` guard: none for a process traced through its sampler, whose cost does
    /// not follow its calls (and whose counts are estimates, not calls).
    pub fn rate_guard(&self, sampling: Sampling) -> RateGuard {
        match self.sampler {
            Some(_) => RateGuard::new(Sampling { usdt: true, ..Sampling::default() }),
            None => RateGuard::new(sampling),
        }
    }

    pub fn traces_calls(&self, sampling: Sampling) -> bool {
        self.sampler.is_none() && sampling.traces_calls()
    }
}

impl Tracer {
    /// How `pid` is traced; an error when it cannot be.
    pub(super) fn means_of(&self, pid: u32) -> anyhow::Result<Means> {
        let found = allocator::find_with(pid, self.runtime_only());
        let (mut allocator, sites) = if self.config.sampling.usdt {
            // Its allocator first: a process that cannot be attached yet is tried again, and its
            // sampling-off warning is not said at each try.
            let allocator = found?;
            let sites = usdt::in_process(pid)?;
            usdt::say_if_sampling_off(&sites);
            (allocator, sites)
        } else {
            match found {
                Ok(allocator) => return Ok(Means { allocator, sampler: None }),
                Err(refused) => match pure_go(pid) {
                    Some(found) => found,
                    None => return Err(refused.into()),
                },
            }
        };
        allocator.seen_through(&sites);
        Ok(Means { allocator, sampler: Some(sites) })
    }
}

/// A Go program built without cgo: statically linked, its only allocator Go's runtime, with a
/// sampler memprof reads that starts on (the program links a heap profile; one that does not
/// would show nothing, and stays refused, with the refusal's advice). A dynamic program caught
/// before its loader mapped its libraries is not one: it is tried again once it has.
fn pure_go(pid: u32) -> Option<(Allocator, Vec<Site>)> {
    if !allocator::statically_linked(pid) {
        return None;
    }
    let allocator = allocator::find_with(pid, RuntimeOnly::Accepted).ok()?;
    match usdt::in_process(pid) {
        Ok(sites) if allocator.files.is_empty() && sites.iter().any(|site| site.spec.sampler == sampler::GO) => {
            if sites.iter().any(|site| site.starts_off) {
                tracing::debug!(pid, "its Go runtime starts with its heap sampling off: not traced through it");
                return None;
            }
            Some((allocator, sites))
        }
        Ok(_) => None,
        Err(why) => {
            tracing::debug!(pid, "no sampler to trace it through either: {why}");
            None
        }
    }
}
