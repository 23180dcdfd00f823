//! How a session traces its target: by its allocator's calls, or through its allocator's own
//! sampler, with `--usdt` or by itself in a Go program without cgo given no other way.

use std::path::{Path, PathBuf};

use crate::{
    cli::TraceArgs,
    console::say,
    error::UserError,
    heap::sampling::Sampling,
    kernel::loader,
    process::allocator::{self, Allocator},
    process::{
        go_program::{self, Unfit},
        usdt,
    },
};

/// What a session's target is traced by.
pub(super) struct Means {
    /// The session's settings: `--usdt` on when memprof chose the sampler itself.
    pub args: TraceArgs,
    pub allocator: Allocator,
    /// The sampler's sites, when the target is traced through them rather than by its calls.
    pub sites: Option<Vec<usdt::Site>>,
    /// Go's runtime sampler's sites in a Go program with cgo traced by its calls: they show its
    /// Go heap, which no call does.
    pub beside_calls: Option<Vec<usdt::Site>>,
}

/// How process `pid` is traced.
pub(super) fn of_process(args: &TraceArgs, pid: u32) -> Result<Means, UserError> {
    match allocator::find_with(pid, runtime_only(args)) {
        Ok(mut allocator) => {
            let sites = usdt_sites(args, &mut allocator, || usdt::in_process(pid))?;
            let beside_calls = beside_calls(args, &mut allocator, || usdt::in_process(pid));
            Ok(Means { args: args.clone(), allocator, sites, beside_calls })
        }
        Err(refused) => {
            let (allocator, sites) = go_sampler(args, refused, &format!("pid {pid}"), || go_program::in_process(pid))?;
            Ok(Means { args: with_sampler(args), allocator, sites: Some(sites), beside_calls: None })
        }
    }
}

/// How `program` is traced once it runs, with the files it maps when it starts (see
/// `allocator::for_command`).
pub(super) fn of_command(args: &TraceArgs, program: &Path) -> Result<(Means, Vec<PathBuf>), UserError> {
    match allocator::for_command(program, runtime_only(args)) {
        Ok((mut allocator, files)) => {
            let sites = usdt_sites(args, &mut allocator, || usdt::in_files(&files, program))?;
            let beside_calls = beside_calls(args, &mut allocator, || usdt::in_files(&files, program));
            Ok((Means { args: args.clone(), allocator, sites, beside_calls }, files))
        }
        Err(refused) => {
            let target = program.display().to_string();
            let (allocator, files, sites) = go_sampler(args, refused, &target, || go_program::command(program))?;
            Ok((Means { args: with_sampler(args), allocator, sites: Some(sites), beside_calls: None }, files))
        }
    }
}

/// A Go program without cgo (see `go_program`), given none of the modes that trace it otherwise,
/// is traced through its runtime's sampler as with `--usdt`: nothing else shows its heap by
/// stack. Said in one line. One whose sampler would show nothing is refused saying so; any other
/// target stays `refused`.
fn go_sampler<T>(
    args: &TraceArgs,
    refused: UserError,
    target: &str,
    found: impl FnOnce() -> Result<T, Unfit>,
) -> Result<T, UserError> {
    let sampling = args.sampling;
    // `--follow-forks` would give its children allocator probes, which `--usdt` refuses.
    let asked = args.maps.mappings
        || sampling.growth
        || sampling.usdt
        || sampling.sample_bytes.is_some()
        || args.follow_forks == Some(true);
    if asked {
        return Err(refused);
    }
    let found = match found() {
        Ok(found) => found,
        Err(Unfit::SamplingOff) => return Err(UserError::GoSamplingOff { target: target.to_string() }),
        Err(Unfit::Other) => return Err(refused),
    };
    say!(
        "memprof: {target} is a Go program without cgo: tracing it through its runtime's own sampler, as with --usdt (--growth or --mappings trace it otherwise)"
    );
    Ok(found)
}

/// A Go program with cgo traced by its calls has its Go heap read through its runtime's sampler
/// beside them (see `go_program::sampler_beside_calls`); not in growth mode, whose pages show it.
fn beside_calls(
    args: &TraceArgs,
    allocator: &mut Allocator,
    find: impl FnOnce() -> Result<Vec<usdt::Site>, UserError>,
) -> Option<Vec<usdt::Site>> {
    args.sampling.traces_calls().then(|| go_program::sampler_beside_calls(allocator, find)).flatten()
}

/// `args` with `--usdt` on, as memprof chose it.
fn with_sampler(args: &TraceArgs) -> TraceArgs {
    TraceArgs { sampling: Sampling { usdt: true, max_rate: None, ..args.sampling }, ..args.clone() }
}

/// With `--usdt`, the process's `otel_memory` probe sites and its Go runtime's, found before
/// anything is loaded: none is an error naming the fix. A process traced so has no allocator
/// probe, and its forks are not followed (they would get allocator probes). The heaps the sites
/// sample are no blind spot of `allocator`.
fn usdt_sites(
    args: &TraceArgs,
    allocator: &mut Allocator,
    find: impl FnOnce() -> Result<Vec<usdt::Site>, UserError>,
) -> Result<Option<Vec<usdt::Site>>, UserError> {
    if !args.sampling.usdt {
        return Ok(None);
    }
    if args.follow_forks == Some(true) {
        return Err(UserError::UsdtFollowForks);
    }
    let sites = find()?;
    usdt::say_if_sampling_off(&sites);
    allocator.seen_through(&sites);
    Ok(Some(sites))
}

/// With `--usdt`, every process is traced through its allocator's own sampler; without, the Go
/// programs with cgo among them read Go's heap through it (`beside_calls`).
pub(super) fn samplers(args: &TraceArgs) -> loader::Samplers {
    if args.sampling.usdt {
        loader::Samplers::Every
    } else {
        loader::Samplers::Some
    }
}

/// A process whose only allocator is a runtime's (a pure Go binary) is traced by what it maps or
/// touches, when that is traced, or through its runtime's sampler.
fn runtime_only(args: &TraceArgs) -> allocator::RuntimeOnly {
    allocator::RuntimeOnly::accepted_if(args.maps.mappings || args.sampling.growth || args.sampling.usdt)
}
