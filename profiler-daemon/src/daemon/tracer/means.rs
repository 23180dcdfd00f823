//! How the daemon traces each process: by its allocator's calls, or through its allocator's own
//! sampler. Every process with `--usdt`; without it, a process the daemon would not see
//! otherwise (a Go program without cgo: no allocator memprof probes, and neither mappings nor
//! growth traced) when its runtime has a sampler memprof reads. A Go program with cgo is traced
//! by its calls, and its Go heap through its runtime's sampler beside them.

use heap::sampling::{RateGuard, Sampling};

use super::Tracer;
use crate::{
    error::UserError,
    heap,
    process::allocator::{self, Allocator},
    process::go_program::{self, Unfit},
    process::usdt::{self, Site},
};

/// What a process is traced by.
pub(super) struct Means {
    pub allocator: Allocator,
    /// The sampler's sites, when it is traced through them rather than by its calls.
    pub sampler: Option<Vec<Site>>,
    /// Go's runtime sampler's sites in a Go program with cgo traced by its calls: they show its
    /// Go heap, which no call does.
    pub beside_calls: Option<Vec<Site>>,
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
        if !self.config.sampling.usdt {
            return match found {
                Ok(mut allocator) => {
                    // Traced by its pages, its Go heap shows already.
                    let beside_calls = self
                        .config
                        .sampling
                        .traces_calls()
                        .then(|| go_program::sampler_beside_calls(&mut allocator, || usdt::in_process(pid)))
                        .flatten();
                    Ok(Means { allocator, sampler: None, beside_calls })
                }
                Err(refused) => match go_program::in_process(pid) {
                    Ok((allocator, sites)) => Ok(Means { allocator, sampler: Some(sites), beside_calls: None }),
                    Err(Unfit::SamplingOff) => Err(UserError::GoSamplingOff { target: format!("pid {pid}") }.into()),
                    Err(Unfit::Other) => Err(refused.into()),
                },
            };
        }
        // Its allocator first: a process that cannot be attached yet is tried again, and its
        // sampling-off warning is not said at each try.
        let mut allocator = found?;
        let sites = usdt::in_process(pid)?;
        usdt::say_if_sampling_off(&sites);
        allocator.seen_through(&sites);
        Ok(Means { allocator, sampler: Some(sites), beside_calls: None })
    }
}
