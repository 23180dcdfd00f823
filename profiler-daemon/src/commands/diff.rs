//! `memprof diff OLD NEW`: how memory in use grew per allocation site between two snapshots,
//! each a JSON report (`--format json`, `memprof snapshot`) or a pprof profile memprof wrote.
//!
//! A site is a stack's frames, the allocation wrappers memprof knows folded into the allocator
//! (as in reports; a report of an older memprof kept them), so the same code compares across
//! runs, whose addresses differ; a stack without frames is its id.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use anyhow::{anyhow, bail, Context as _};
use serde::{Deserialize, Serialize};

use crate::{
    cli::{DiffArgs, DiffFormat},
    format::{self, pprof, MAX_INPUT_BYTES},
    heap::{report, wrappers::Wrappers},
    process::memory,
    symbolize::Frame,
};

pub fn run(args: &DiffArgs) -> anyhow::Result<i32> {
    let old = read(&args.old)?;
    let new = read(&args.new)?;
    let (old_counts, new_counts) = (old.counts_objects, new.counts_objects);
    let sites = compare(old.sites, new.sites);
    let out = match args.format {
        DiffFormat::Table => table((&args.old, old_counts), (&args.new, new_counts), &sites),
        DiffFormat::Json => {
            let diff = Diff {
                old: &args.old.display().to_string(),
                new: &args.new.display().to_string(),
                old_counts_objects: old_counts,
                new_counts_objects: new_counts,
                sites,
            };
            serde_json::to_string(&diff).expect("a diff always serializes") + "\n"
        }
    };
    crate::commands::output::print(out.as_bytes())?;
    Ok(0)
}

/// What one site holds in one snapshot.
#[derive(Debug, Clone, Default, PartialEq)]
struct InUse {
    /// From the site's allocating frame outwards.
    frames: Vec<Frame>,
    stack_ids: Vec<String>,
    bytes: u64,
    objects: u64,
}

type Sites = BTreeMap<String, InUse>;

/// What a diff reads of a snapshot file.
struct Snapshot {
    sites: Sites,
    /// False for a report at its process's peak, which keeps bytes and no counts: its sites'
    /// objects read as 0.
    counts_objects: bool,
}

#[derive(Debug, Serialize)]
struct Diff<'a> {
    old: &'a str,
    new: &'a str,
    old_counts_objects: bool,
    new_counts_objects: bool,
    sites: Vec<SiteDiff>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
struct SiteDiff {
    frames: Vec<Frame>,
    /// The stacks (of either snapshot) that make up the site.
    stack_ids: Vec<String>,
    old_bytes: u64,
    new_bytes: u64,
    delta_bytes: i64,
    old_objects: u64,
    new_objects: u64,
    delta_objects: i64,
}

/// The part of a JSON report a diff reads: the stacks of its process and of the children it
/// followed, whose pids differ from one session to the next.
#[derive(Deserialize)]
struct JsonReport {
    stacks: Vec<JsonStack>,
    #[serde(default)]
    children: Vec<JsonReport>,
    #[serde(default)]
    at_peak: bool,
}

impl JsonReport {
    fn all_stacks(self) -> Vec<JsonStack> {
        let mut stacks = self.stacks;
        for child in self.children {
            stacks.extend(child.all_stacks());
        }
        stacks
    }
}

#[derive(Deserialize)]
struct JsonStack {
    stack_id: String,
    outstanding_bytes: u64,
    outstanding_allocations: u64,
    frames: Vec<Frame>,
}

/// The sites of a snapshot file.
fn read(path: &Path) -> anyhow::Result<Snapshot> {
    let bytes = read_capped(path)?;
    check_room(path, &bytes)?;
    let mut sites = Sites::new();
    let wrappers = Wrappers::default();
    let mut add = |stack_id: String, mut frames: Vec<Frame>, bytes: u64, objects: u64| {
        // A session's profile with several processes puts each under a frame of its pid.
        if frames.last().is_some_and(report::is_process_frame) {
            frames.pop();
        }
        let (frames, _) = wrappers.fold(frames.into());
        let key = site_key(&frames, &stack_id);
        let entry = sites.entry(key).or_insert_with(|| InUse { frames: frames.to_vec(), ..InUse::default() });
        entry.stack_ids.push(stack_id);
        entry.bytes = entry.bytes.saturating_add(bytes);
        entry.objects = entry.objects.saturating_add(objects);
    };
    let counts_objects = if bytes.starts_with(b"{") {
        // A file of JSON reports, one per line: the last is the final one.
        let text = bytes.trim_ascii_end();
        let last = text.rsplit(|&b| b == b'\n').next().unwrap_or_default();
        let report: JsonReport = serde_json::from_slice(last).map_err(|err| {
            let said = if err.is_eof() {
                format!(
                    "{} ends in a report cut short (memprof stopped as it wrote it); give a whole snapshot",
                    path.display()
                )
            } else {
                format!("{} is not a memprof JSON report", path.display())
            };
            anyhow::Error::new(err).context(said)
        })?;
        let counts_objects = !report.at_peak;
        for s in report.all_stacks() {
            add(s.stack_id, s.frames, s.outstanding_bytes, s.outstanding_allocations);
        }
        counts_objects
    } else {
        let profile = pprof::read(&bytes).map_err(|err| match err {
            pprof::PprofError::NotAProfile => {
                anyhow!("{} is neither a memprof JSON report nor a pprof profile", path.display())
            }
            pprof::PprofError::Gzip(cause) => {
                anyhow!("{} is damaged: cannot decompress it ({cause}); give a whole snapshot", path.display())
            }
            other => anyhow!("{}: {other}; give a snapshot memprof wrote", path.display()),
        })?;
        let (Some(bytes), Some(objects)) = (profile.value_index("inuse_space"), profile.value_index("inuse_objects"))
        else {
            bail!("{} has no inuse_space and inuse_objects samples: not a heap profile", path.display());
        };
        // A profile at the peak has bytes and no objects anywhere.
        let (mut any_bytes, mut any_objects) = (false, false);
        for s in profile.samples {
            any_bytes |= s.values[bytes] > 0;
            any_objects |= s.values[objects] > 0;
            add(s.stack_id.unwrap_or_default(), s.frames, s.values[bytes], s.values[objects]);
        }
        any_objects || !any_bytes
    };
    check_sums(path, &sites)?;
    Ok(Snapshot { sites, counts_objects })
}

/// Refuses a snapshot whose bytes or objects add up past what a signed 64-bit difference holds:
/// no process holds 8 EiB, only an edited file says so, and its sums would wrap.
fn check_sums(path: &Path, sites: &Sites) -> anyhow::Result<()> {
    let sum = |of: fn(&InUse) -> u64| sites.values().try_fold(0u64, |sum, site| sum.checked_add(of(site)));
    let fits = |sum: Option<u64>| sum.is_some_and(|sum| i64::try_from(sum).is_ok());
    if !fits(sum(|site| site.bytes)) || !fits(sum(|site| site.objects)) {
        bail!(
            "{} says its stacks hold more than 2^63 bytes or objects, which no process holds; give a snapshot memprof wrote",
            path.display()
        );
    }
    Ok(())
}

/// The file's bytes, refused at once when it is larger than memprof reads.
fn read_capped(path: &Path) -> anyhow::Result<Vec<u8>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let Some(bytes) =
        format::read_at_most(file, MAX_INPUT_BYTES).with_context(|| format!("cannot read {}", path.display()))?
    else {
        bail!(
            "{} is larger than {} MiB, more than any report memprof reads; give a snapshot memprof wrote",
            path.display(),
            MAX_INPUT_BYTES >> 20
        );
    };
    Ok(bytes)
}

/// Refuses, before it is read, a snapshot that needs more than half the memory memprof may use:
/// about its size, or for a gzip-compressed one, the size it says it decompresses to (its last
/// four bytes, the size modulo 4 GiB) up to `MAX_INPUT_BYTES`. Those bytes are only a hint: a cut
/// file's are whatever was cut at, and a bomb's are a lie, which the decompression refuses.
fn check_room(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let decompressed = match bytes {
        [0x1f, 0x8b, .., a, b, c, d] => u64::from(u32::from_le_bytes([*a, *b, *c, *d])).min(MAX_INPUT_BYTES),
        _ => 0,
    };
    let needs = bytes.len() as u64 + decompressed;
    let room = memory::room();
    if needs > room.bytes / 2 {
        bail!(
            "{} needs about {} MiB to read, more than half of the {room}; free memory or diff on a larger machine",
            path.display(),
            needs >> 20
        );
    }
    Ok(())
}

/// Names a site by its frames' functions, files, lines and modules: not their addresses.
fn site_key(frames: &[Frame], stack_id: &str) -> String {
    if frames.is_empty() {
        return format!("stack {stack_id}");
    }
    let mut key = String::new();
    for f in frames {
        let _ = writeln!(key, "{}\t{:?}\t{:?}\t{}\t{}", f.function, f.file, f.line, f.module, f.inlined);
    }
    key
}

/// Every site in either snapshot that holds memory in one of them, the most grown first.
fn compare(old: Sites, mut new: Sites) -> Vec<SiteDiff> {
    let mut keys: Vec<String> = old.keys().chain(new.keys()).cloned().collect();
    keys.sort();
    keys.dedup();
    let mut sites: Vec<SiteDiff> = keys
        .into_iter()
        .map(|key| {
            let before = old.get(&key).cloned().unwrap_or_default();
            let after = new.remove(&key).unwrap_or_default();
            let frames = if after.frames.is_empty() { before.frames } else { after.frames };
            let mut stack_ids: Vec<String> = before.stack_ids.into_iter().chain(after.stack_ids).collect();
            stack_ids.sort();
            stack_ids.dedup();
            SiteDiff {
                frames,
                stack_ids,
                old_bytes: before.bytes,
                new_bytes: after.bytes,
                delta_bytes: after.bytes as i64 - before.bytes as i64,
                old_objects: before.objects,
                new_objects: after.objects,
                delta_objects: after.objects as i64 - before.objects as i64,
            }
        })
        .filter(|s| s.old_bytes > 0 || s.new_bytes > 0 || s.old_objects > 0 || s.new_objects > 0)
        .collect();
    // Stable: equal growth keeps the order of the sites' names.
    sites.sort_by_key(|s| std::cmp::Reverse((s.delta_bytes, s.delta_objects)));
    sites
}

/// Each snapshot with whether it counts objects.
fn table((old, old_counts): (&Path, bool), (new, new_counts): (&Path, bool), sites: &[SiteDiff]) -> String {
    let total = |of: fn(&SiteDiff) -> u64| sites.iter().map(of).sum::<u64>();
    let (old_bytes, new_bytes) = (total(|s| s.old_bytes), total(|s| s.new_bytes));
    let (old_objects, new_objects) = (total(|s| s.old_objects), total(|s| s.new_objects));
    let mut out = format!(
        "memprof diff: {} -> {}: in use {old_bytes} -> {new_bytes} bytes ({:+}), {old_objects} -> {new_objects} objects ({:+})\n",
        old.display(),
        new.display(),
        new_bytes as i64 - old_bytes as i64,
        new_objects as i64 - old_objects as i64,
    );
    for (path, counts) in [(old, old_counts), (new, new_counts)] {
        if !counts {
            let _ = writeln!(
                out,
                "  {} is at its process's peak, which keeps bytes and no counts: its objects read as 0",
                path.display()
            );
        }
    }
    let _ = writeln!(
        out,
        "  {:>11} {:>11} {:>11} {:>10} {:>9} {:>9}  SITE",
        "DELTA_BYTES", "OLD_BYTES", "NEW_BYTES", "DELTA_OBJS", "OLD_OBJS", "NEW_OBJS"
    );
    for site in sites {
        let lead = format!(
            "  {:>+11} {:>11} {:>11} {:>+10} {:>9} {:>9}  ",
            site.delta_bytes, site.old_bytes, site.new_bytes, site.delta_objects, site.old_objects, site.new_objects
        );
        if site.frames.is_empty() {
            let _ = writeln!(out, "{lead}[no stack] {}", site.stack_ids.join(" "));
        }
        for (i, frame) in site.frames.iter().enumerate() {
            let pad = if i == 0 { lead.clone() } else { " ".repeat(lead.len()) };
            let _ = writeln!(out, "{pad}{}", format::describe(frame));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::report::samples::frame;

    fn sites(entries: &[(&str, u64, u64)]) -> Sites {
        entries
            .iter()
            .map(|&(function, bytes, objects)| {
                let frames = vec![frame(function, Some("a.c"), Some(1))];
                (site_key(&frames, "id"), InUse { frames, stack_ids: vec![function.into()], bytes, objects })
            })
            .collect()
    }

    #[test]
    fn sites_are_sorted_by_growth_and_those_empty_in_both_left_out() {
        let old = sites(&[("steady", 100, 1), ("shrinks", 500, 5), ("gone", 0, 0)]);
        let new = sites(&[("steady", 100, 1), ("shrinks", 200, 2), ("grows", 300, 3), ("gone", 0, 0)]);
        let diff = compare(old, new);
        let order: Vec<(&str, i64, i64)> =
            diff.iter().map(|s| (s.frames[0].function.as_str(), s.delta_bytes, s.delta_objects)).collect();
        assert_eq!(order, [("grows", 300, 3), ("steady", 0, 0), ("shrinks", -300, -3)]);
        assert_eq!((diff[2].old_bytes, diff[2].new_bytes, diff[2].old_objects, diff[2].new_objects), (500, 200, 5, 2));
    }

    /// A report at the peak keeps bytes and no counts: its sites count by their bytes.
    #[test]
    fn a_site_with_bytes_and_no_objects_is_compared() {
        let diff = compare(sites(&[("big_peak", 1_000_000, 0)]), sites(&[("leak", 100, 1)]));
        let deltas: Vec<(&str, i64)> = diff.iter().map(|s| (s.frames[0].function.as_str(), s.delta_bytes)).collect();
        assert_eq!(deltas, [("leak", 100), ("big_peak", -1_000_000)]);
    }

    /// A report cut mid-line (memprof stopped as it wrote it) is named so; a whole line that is
    /// no report, even without its newline, is not.
    #[test]
    fn a_json_report_cut_short_is_said_so() {
        let path = std::env::temp_dir().join(format!("memprof-diff-cut-{}.json", std::process::id()));
        for (text, said) in [
            ("{\"final\": false, \"pi", "ends in a report cut short"),
            ("{\"final\": false}\n   \n", "is not a memprof JSON report"),
            ("{\"x\": 1}", "is not a memprof JSON report"),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = format!("{:#}", read(&path).err().unwrap());
            assert!(err.contains(said), "{text}: {err}");
        }
        std::fs::remove_file(&path).unwrap();
    }

    /// An edited report's counts would wrap in the sums and differences: refused.
    #[test]
    fn sums_past_what_a_difference_holds_are_refused() {
        let path = Path::new("edited.json");
        assert!(check_sums(path, &sites(&[("a", i64::MAX as u64, 1)])).is_ok());
        for entries in [&[("a", u64::MAX, 1)][..], &[("a", i64::MAX as u64, 1), ("b", 1, 1)], &[("a", 1, u64::MAX)]] {
            let refused = check_sums(path, &sites(entries)).expect_err("refused").to_string();
            assert!(refused.starts_with("edited.json says its stacks hold more than 2^63"), "{refused}");
        }
    }

    #[test]
    fn a_site_is_its_code_not_its_addresses() {
        let mut moved = frame("leak_here", Some("leaky.c"), Some(12));
        moved.address = "0x7fff0000".into();
        let here = [frame("leak_here", Some("leaky.c"), Some(12))];
        assert_eq!(site_key(&[moved], "a"), site_key(&here, "b"));
        assert_ne!(site_key(&here, "a"), site_key(&[frame("leak_here", Some("leaky.c"), Some(13))], "a"));
        assert_eq!(site_key(&[], "ab12"), "stack ab12");
    }
}
