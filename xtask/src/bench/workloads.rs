//! The loop's peers: the same tools on the loop in two threads, a mixed workload (bench/mixed.c)
//! and a real program (Debian's perl building a hash, bench/hash.pl).

use std::{fmt::Write as _, path::Path};

use super::{added_cost_shares, median, Measured, Size, Tool};
use crate::root;

pub struct Workload {
    name: String,
    /// What one "pair" of its timing is.
    unit: &'static str,
    argv: Vec<String>,
}

pub fn prepare(dir: &Path, size: Size) -> anyhow::Result<Vec<Workload>> {
    let churn = super::build_loop(dir)?;
    let mixed = dir.join("mixed");
    crate::compile_c(&root().join("bench/mixed.c"), &mixed, &["-O2"])?;
    let keys = size.pairs / 2;
    Ok(vec![
        Workload {
            name: "the loop, 2 threads".into(),
            unit: "pair, per thread",
            argv: vec![churn.display().to_string(), size.pairs.to_string(), "2".into()],
        },
        Workload {
            name: "mixed: 16 B to 16 KiB in 4,096 slots".into(),
            unit: "malloc and its free",
            argv: vec![mixed.display().to_string(), size.pairs.to_string()],
        },
        Workload {
            name: format!("perl: a hash of {keys} keys"),
            unit: "key (several allocations)",
            // By path: bpftrace -c does not search PATH.
            argv: vec!["/usr/bin/perl".into(), root().join("bench/hash.pl").display().to_string(), keys.to_string()],
        },
    ])
}

/// One workload's times under each tool.
pub type Row<'a> = (&'a Workload, Vec<(&'a Tool, Measured)>);

/// Each workload under each tool: the median time per unit.
pub fn measure<'a>(tools: &[&'a Tool], workloads: &'a [Workload], size: Size) -> anyhow::Result<Vec<Row<'a>>> {
    let mut results = Vec::new();
    for workload in workloads {
        let mut row = Vec::new();
        for &tool in tools {
            let measured = median(tool, &workload.argv, size)?;
            eprintln!("xtask bench: {} under {}: {:.1} ns", workload.name, tool.name, measured.ns_per_pair);
            row.push((tool, measured));
        }
        results.push((workload, row));
    }
    Ok(results)
}

pub const TITLE: &str = "## Other workloads";

pub fn render(results: &[Row]) -> String {
    let mut out = format!("\n{TITLE}\n\n");
    out.push_str(
        "The same tools, in the same run, on the loop in two threads (both cores), a mixed workload \
         (bench/mixed.c) and a real program, Debian's perl building a hash (bench/hash.pl); time is \
         the workload's own, start-up excluded. The ratio is the added cost over the classic probe \
         set's. perl's timed part allocates about three blocks a key and frees almost none (its hash \
         is freed at exit, untimed): its cost is the allocations' traps, where the `traps` rows show \
         the floor, and their stack walks, which are deep in an interpreter.\n\n\
         | workload | per | tool | ns | added cost ÷ classic's |\n|---|---|---|---:|---:|\n",
    );
    for (workload, row) in results {
        for ((tool, m), share) in row.iter().zip(added_cost_shares(row)) {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.1} | {:.2} |",
                workload.name, workload.unit, tool.name, m.ns_per_pair, share
            );
        }
    }
    out
}
