//! The man pages, generated from the command line's definition so that they never drift from it.

use std::{fs, path::Path};

use anyhow::Context as _;
use clap::CommandFactory as _;

use crate::cli::Cli;

/// Writes memprof.1 and memprof-SUBCOMMAND.1 for each visible subcommand into `dir`.
pub fn man_pages(dir: &Path) -> anyhow::Result<i32> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut command = Cli::command();
    command.build();
    write_page(dir, "memprof", command.clone())?;
    // Not `help`, clap's own: `man memprof` says what it does.
    for sub in command.get_subcommands().filter(|sub| !sub.is_hide_set() && sub.get_name() != "help") {
        let name = format!("memprof-{}", sub.get_name());
        write_page(dir, &name, sub.clone().name(&name))?;
    }
    Ok(0)
}

fn write_page(dir: &Path, name: &str, command: clap::Command) -> anyhow::Result<()> {
    let path = dir.join(format!("{name}.1"));
    let mut page = Vec::new();
    clap_mangen::Man::new(command).render(&mut page)?;
    fs::write(&path, page).with_context(|| format!("cannot write {}", path.display()))
}
