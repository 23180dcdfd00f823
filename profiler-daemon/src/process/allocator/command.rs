//! A command's allocators, found before it runs: in its executable and the libraries its
//! dynamic loader lists for it.

use std::{
    collections::HashSet,
    fs,
    path::{Path, PathBuf},
};

use object::{Object, ObjectSection};

use super::{allocator_of, is_dynamic_loader, is_libc, scan, Allocator, RuntimeOnly};
use crate::error::UserError;

/// The interpreter of a script (`#!/bin/sh -e`, `#!/usr/bin/env python3`), found as the kernel
/// and `env` find it.
fn script_interpreter(data: &[u8]) -> Option<PathBuf> {
    let line = data.strip_prefix(b"#!")?.split(|&b| b == b'\n').next()?;
    let mut words = std::str::from_utf8(line).ok()?.split_whitespace();
    let interpreter = PathBuf::from(words.next()?);
    if interpreter.file_name() != Some("env".as_ref()) {
        return Some(interpreter);
    }
    let name = words.find(|word| !word.starts_with('-'))?;
    std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(name)).find(|path| path.is_file())
}

/// The allocators a command will have once the dynamic loader has mapped its libraries, found
/// before it runs: in the executable and in the libraries its loader lists for it (`ld.so --list
/// PROGRAM`, what `ldd` runs, which maps them without running the program), with memprof's
/// environment (`LD_PRELOAD`, `LD_LIBRARY_PATH`), which the command inherits.
///
/// Also returns the files the command maps when it starts (itself, its libraries and its dynamic
/// loader), whose unwind tables can be built before it runs.
pub fn for_command(program: &Path, runtime_only: RuntimeOnly) -> Result<(Allocator, Vec<PathBuf>), UserError> {
    let no_allocator = |detail: String| UserError::NoAllocatorInCommand { program: program.to_path_buf(), detail };
    let mut data = fs::read(program).map_err(|err| no_allocator(format!("reading it: {err}")))?;
    // A script runs its interpreter (the kernel follows up to four of them).
    let mut program = program.to_path_buf();
    for _ in 0..4 {
        let Some(interpreter) = script_interpreter(&data) else { break };
        data =
            fs::read(&interpreter).map_err(|err| no_allocator(format!("reading {}: {err}", interpreter.display())))?;
        program = interpreter;
    }
    // As the kernel runs it: the file a link names, whose directory `$ORIGIN` in its RPATH is.
    let program = fs::canonicalize(&program).unwrap_or(program);
    let program = program.as_path();
    let mut paths = vec![program.to_path_buf()];
    if let Some(interpreter) = interpreter(&data) {
        paths.extend(loader_list(&interpreter, program).map_err(no_allocator)?);
        if !paths.contains(&interpreter) {
            paths.push(interpreter);
        }
    }
    // As /proc/PID/maps will name them, to recognise the allocator's own frames later.
    let displayed: Vec<String> = paths
        .iter()
        .map(|path| fs::canonicalize(path).unwrap_or_else(|_| path.clone()).to_string_lossy().into_owned())
        .collect();
    let scans = paths
        .iter()
        .zip(&displayed)
        .filter(|(path, _)| !is_dynamic_loader(&path.to_string_lossy()))
        .filter_map(|(path, display)| scan(path, display));
    let looked_into = displayed.iter().cloned().collect();
    let allocator = allocator_of(scans.collect(), looked_into, runtime_only).map_err(no_allocator)?;
    Ok((allocator, paths))
}

/// The allocator libraries a program loads in place of the C library's malloc with
/// `LD_PRELOAD`, by the names Debian ships them under.
const PRELOADABLE: &[&str] = &["libjemalloc.so.2", "libtcmalloc.so.4", "libtcmalloc_minimal.so.4", "libmimalloc.so.2"];

/// The preloadable allocator libraries (`PRELOADABLE`) installed beside `allocator`'s C library
/// that `allocator` does not hold already. `run` probes them for its command before it starts:
/// the kernel puts a file's probes in place when the process maps it, so a program the command
/// execs later with one preloaded (`env LD_PRELOAD=... prog`) is traced from its first call.
pub fn standby(allocator: &Allocator) -> Allocator {
    let held: HashSet<PathBuf> = allocator.files.iter().filter_map(|f| fs::canonicalize(&f.attach_path).ok()).collect();
    let Some(dir) = allocator.files.iter().find(|f| is_libc(&f.display_path)).and_then(|f| f.attach_path.parent())
    else {
        return Allocator::default();
    };
    let files = PRELOADABLE
        .iter()
        .filter_map(|name| fs::canonicalize(dir.join(name)).ok())
        .filter(|path| !held.contains(path))
        .filter_map(|path| scan(&path, &path.to_string_lossy())?.allocator)
        .collect();
    Allocator { files, ..Allocator::default() }
}

/// The dynamic loader an executable names (`PT_INTERP`); none for a static one.
fn interpreter(data: &[u8]) -> Option<PathBuf> {
    let elf = object::File::parse(data).ok()?;
    let section = elf.section_by_name(".interp")?;
    let bytes = section.data().ok()?;
    let path = bytes.split(|&b| b == 0).next()?;
    Some(PathBuf::from(std::str::from_utf8(path).ok()?))
}

/// The libraries `interpreter --list program` says the program maps, in load order.
fn loader_list(interpreter: &Path, program: &Path) -> Result<Vec<PathBuf>, String> {
    let out = std::process::Command::new(interpreter)
        .arg("--list")
        .arg(program)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|err| format!("running {} --list: {err}", interpreter.display()))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        return Err(format!("its dynamic loader cannot load it: {}", why.trim()));
    }
    Ok(parse_loader_list(&String::from_utf8_lossy(&out.stdout)))
}

/// Lines such as `libjemalloc.so.2 => /lib/x86_64-linux-gnu/libjemalloc.so.2 (0x7f...)` and
/// `/lib64/ld-linux-x86-64.so.2 (0x7f...)`; the vDSO has no file.
fn parse_loader_list(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = line.split_once("=> ").map_or(line, |(_, path)| path);
            let path = path.rsplit_once(" (").map_or(path, |(path, _)| path);
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_lists_are_read_as_ldd_prints_them() {
        let text = "\tlinux-vdso.so.1 (0x00007ffc)\n\tlibjemalloc.so.2 => /lib/x86_64-linux-gnu/libjemalloc.so.2 (0x00007f1)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f3)\n";
        let paths: Vec<String> = parse_loader_list(text).iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            paths,
            [
                "/lib/x86_64-linux-gnu/libjemalloc.so.2",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
        );
    }
}
