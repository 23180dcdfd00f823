//! Whether blazesym may read a file's debug information. Reading it, blazesym opens the files
//! the file names: a separate debug file (`.gnu_debuglink`: a name, looked for beside the file
//! and under /usr/lib/debug), and a supplementary one (`.gnu_debugaltlink`, `.debug_sup`: a path,
//! which may be anywhere), which the debug file may name too. Any of them may be a FIFO, whose
//! open waits for a writer: the symbolizer, and memprof with it, would wait for good. So the
//! debug information of a file that names another is read only when none of the files blazesym
//! may open for it can have been made or changed by a user other than root; elsewhere its names
//! come from its symbol table.

use std::{
    ffi::OsStr,
    fs::{self, File, Metadata},
    io,
    os::{
        fd::AsRawFd,
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::{Path, PathBuf},
};

use object::{Object as _, ObjectSection as _};

use crate::process::procfs::open_regular;

/// Where blazesym looks for debug files besides the file's own directory (its only debug
/// directory: see `SymbolizerThread::new`).
pub const DEBUG_DIR: &str = "/usr/lib/debug";

/// Whether blazesym may read `file`'s debug information.
pub fn debug_info_is_safe(file: &File) -> bool {
    let Some(links) = Links::read(file) else { return true };
    if links.debug_link.is_none() && links.supplementary.is_empty() {
        return true;
    }
    let Ok(path) = fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) else { return false };
    let directory = path.parent().and_then(|dir| fs::metadata(dir).ok());
    let debug_files_safe = || match &links.debug_link {
        Some(name) => debug_files_safe(&path, OsStr::from_bytes(name), &super::build_id(file)),
        None => true,
    };
    file.metadata().is_ok_and(|meta| root_only(&meta))
        && directory.is_some_and(|meta| root_only(&meta))
        && links.supplementary_safe()
        && debug_files_safe()
}

/// What an ELF file names for its debug information.
struct Links {
    debug_link: Option<Vec<u8>>,
    /// `.gnu_debugaltlink`'s and `.debug_sup`'s paths.
    supplementary: Vec<Vec<u8>>,
}

impl Links {
    /// None when the file is not ELF.
    fn read(file: &File) -> Option<Self> {
        let cache = object::ReadCache::new(file);
        let elf = object::File::parse(&cache).ok()?;
        // Each section starts with a NUL-terminated name; `.debug_sup` after its version (2
        // bytes) and flag (1 byte).
        let name = |section: &str, skip: usize| {
            let data = elf.section_by_name(section)?.data().ok()?;
            let name = data.get(skip..)?;
            Some(name.split(|&b| b == 0).next().unwrap_or_default().to_vec())
        };
        let supplementary = [name(".gnu_debugaltlink", 0), name(".debug_sup", 3)].into_iter().flatten().collect();
        Some(Self { debug_link: name(".gnu_debuglink", 0), supplementary })
    }

    /// Whether the supplementary files are named by absolute paths in directories only root
    /// can write to, up to `/`.
    fn supplementary_safe(&self) -> bool {
        self.supplementary.iter().all(|path| {
            let path = Path::new(OsStr::from_bytes(path));
            path.is_absolute() && path.parent().is_some_and(root_only_up_to_root)
        })
    }
}

/// Whether every debug file blazesym may find by the debug link `name` of the file at `path`
/// is root's and names only root's files in turn.
fn debug_files_safe(path: &Path, name: &OsStr, build_id: &str) -> bool {
    // A name with a slash, or `..`, would lead out of the directories searched.
    if name.is_empty() || name.as_bytes().contains(&b'/') || name == ".." || name == "." {
        return false;
    }
    candidates(path, name, build_id).iter().all(|candidate| match fs::metadata(candidate) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => true,
        Err(_) => false,
        Ok(_) => open_regular(candidate).is_ok_and(|debug_file| {
            debug_file.metadata().is_ok_and(|meta| root_only(&meta))
                && Links::read(&debug_file).is_none_or(|links| links.supplementary_safe())
        }),
    })
}

/// Where blazesym looks for the debug file `name` of the file at `path`: by build id and by
/// name under /usr/lib/debug, beside the file, and under /usr/lib/debug at the file's directory
/// and each of its parents.
fn candidates(path: &Path, name: &OsStr, build_id: &str) -> Vec<PathBuf> {
    let debug_dir = Path::new(DEBUG_DIR);
    let mut candidates = vec![debug_dir.join(name)];
    if build_id.len() >= 16 {
        let (first, rest) = build_id.split_at(2);
        candidates.push(debug_dir.join(".build-id").join(first).join(format!("{rest}.debug")));
    }
    if let Some(directory) = path.parent() {
        candidates.push(directory.join(name));
        let relative = directory.strip_prefix("/").unwrap_or(directory);
        candidates.extend(
            relative.ancestors().filter(|dir| !dir.as_os_str().is_empty()).map(|dir| debug_dir.join(dir).join(name)),
        );
    }
    candidates
}

/// Owned by root and writable by no one else.
fn root_only(meta: &Metadata) -> bool {
    meta.uid() == 0 && meta.mode() & 0o022 == 0
}

/// Whether `directory`, or its nearest ancestor that exists, and every directory above it, is
/// root's alone: no other user can make a file there, or a directory on the way to one.
fn root_only_up_to_root(directory: &Path) -> bool {
    let Some(existing) = directory.ancestors().find_map(|dir| fs::canonicalize(dir).ok()) else { return false };
    existing.ancestors().all(|dir| fs::metadata(dir).is_ok_and(|meta| root_only(&meta)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_files_are_looked_for_where_blazesym_looks() {
        let candidates = candidates(Path::new("/opt/app/bin/prog"), OsStr::new("prog.debug"), "0123456789abcdef01");
        let expected = [
            "/usr/lib/debug/prog.debug",
            "/usr/lib/debug/.build-id/01/23456789abcdef01.debug",
            "/opt/app/bin/prog.debug",
            "/usr/lib/debug/opt/app/bin/prog.debug",
            "/usr/lib/debug/opt/app/prog.debug",
            "/usr/lib/debug/opt/prog.debug",
        ];
        assert_eq!(candidates, expected.map(PathBuf::from));
    }

    #[test]
    fn a_debug_link_that_leaves_the_directories_searched_is_refused() {
        for name in ["../../tmp/fifo", "/tmp/fifo", "..", ""] {
            assert!(!debug_files_safe(Path::new("/usr/bin/true"), OsStr::new(name), ""), "{name}");
        }
    }

    #[test]
    fn supplementary_files_must_be_in_roots_directories() {
        let links = |path: &str| Links { debug_link: None, supplementary: vec![path.into()] };
        assert!(links("/usr/lib/debug/.dwz/x86_64-linux-gnu/libc6.debug").supplementary_safe());
        assert!(!links("/tmp/fifo").supplementary_safe());
        assert!(!links("relative/file.debug").supplementary_safe());
    }
}
