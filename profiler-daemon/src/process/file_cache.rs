//! What was read from a file, kept by the file's identity: the next process that maps the same
//! file (the C library, a shell, an interpreter's library, at every exec and attach) does not
//! read it again.
//!
//! What is read of a file is kept by the identity of the descriptor it was read through
//! (`Opened`), and probes go only into a file checked to be that same one (links shared by every
//! process go through the descriptor itself): the path a traced process names may name another
//! file between the two (it can map another file at the same place, or put one at the same
//! path), and a probe placed by offsets read in one file would land mid-instruction in the other.

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    sync::Mutex,
};

/// A file, whatever path reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    pub device: u64,
    pub inode: u64,
}

impl FileId {
    /// The file that `path` names now.
    pub fn of(path: &Path) -> io::Result<Self> {
        std::fs::metadata(path).map(|meta| Self { device: meta.dev(), inode: meta.ino() })
    }

    /// The file a line of `/proc/PID/maps` maps (`None` for an anonymous one).
    pub fn of_maps_line(line: &str) -> Option<Self> {
        let mut fields = line.split_ascii_whitespace();
        let device = fields.nth(3)?;
        let inode: u64 = fields.next()?.parse().ok()?;
        (inode != 0).then(|| Self::of_maps_fields(device, inode)).flatten()
    }

    /// The file a maps line's device (`major:minor`, in hex) and inode name.
    pub fn of_maps_fields(device: &str, inode: u64) -> Option<Self> {
        let (major, minor) = super::mounts::maps_device(device)?;
        Some(Self { device: libc::makedev(u32::try_from(major).ok()?, u32::try_from(minor).ok()?), inode })
    }
}

/// A regular file, open: what memprof reads of it, and what the kernel probes in it for links
/// shared by every process (`kernel_path`).
#[derive(Debug)]
pub struct Opened {
    file: File,
    meta: std::fs::Metadata,
}

impl Opened {
    /// Opens `path` if it names a regular file, without waiting on a FIFO.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = super::procfs::open_regular(path)?;
        let meta = file.metadata()?;
        Ok(Self { file, meta })
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn id(&self) -> FileId {
        FileId { device: self.meta.dev(), inode: self.meta.ino() }
    }

    /// A path the kernel resolves to this very file while it is open, whatever its own path
    /// names meanwhile: for probes placed by what was read of it. By memprof's pid, not
    /// `self`: memprof's helper process makes the links.
    pub fn kernel_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), self.file.as_raw_fd()))
    }

    pub fn into_file(self) -> File {
        self.file
    }

    /// Whether this is the file a process's mapping names (`FileId::of_maps_line`). A file on
    /// overlayfs (a container's image, say) is mapped as the layer's file, whose device `maps`
    /// shows, while `fstat` gives the overlay's device with the layer file's inode: there the
    /// inode alone must match.
    pub fn is_mapped(&self, mapped: FileId) -> bool {
        self.id() == mapped || (self.meta.ino() == mapped.inode && is_overlay(&self.file))
    }

    /// `path` opened, if it still names the file `expected`.
    pub fn open_same(path: &Path, expected: FileId) -> io::Result<Self> {
        let opened = Self::open(path)?;
        if opened.id() != expected {
            return Err(io::Error::other(format!("{} is another file than the one memprof read", path.display())));
        }
        Ok(opened)
    }

    /// The file `expected`, opened through process `pid`'s mapping of it (see
    /// `FileMapping::reachable_paths`), else at `path`: a file replaced on disk since (a library
    /// upgraded under a running process) is reached while the process maps it.
    pub fn open_mapped(pid: u32, path: &Path, expected: FileId) -> io::Result<Self> {
        let mappings = super::procfs::file_mappings(pid).unwrap_or_default();
        let mapped = mappings
            .iter()
            .filter(|mapping| mapping.inode == expected.inode)
            .flat_map(|mapping| mapping.reachable_paths(pid))
            .find_map(|reachable| Self::open_same(Path::new(&reachable), expected).ok());
        mapped.map_or_else(|| Self::open_same(path, expected), Ok)
    }
}

/// Whether `file` is on overlayfs.
fn is_overlay(file: &File) -> bool {
    const OVERLAYFS_SUPER_MAGIC: libc::c_long = 0x794c_7630;
    let mut stat = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `file` is an open descriptor and `stat` has room for the kernel's answer.
    if unsafe { libc::fstatfs(file.as_raw_fd(), stat.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstatfs succeeded, so it filled `stat`.
    unsafe { stat.assume_init() }.f_type == OVERLAYFS_SUPER_MAGIC
}

/// A file's contents as its metadata tells them: the same file (device and inode) written in
/// place since has another version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileVersion {
    size: u64,
    modified_ns: i128,
}

impl FileVersion {
    pub fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            size: meta.size(),
            modified_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

/// A file as it is now: another file, or the same one rewritten, has another key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileKey {
    device: u64,
    inode: u64,
    version: FileVersion,
    /// What the value was made for besides the file (the name messages give it).
    context: String,
}

pub struct FileCache<V> {
    entries: Mutex<HashMap<FileKey, V>>,
    capacity: usize,
}

impl<V: Clone> FileCache<V> {
    /// Holds up to `capacity` files' values; emptied when full (files come and go with programs).
    pub fn new(capacity: usize) -> Self {
        Self { entries: Mutex::new(HashMap::new()), capacity }
    }

    /// The value kept for `file` and `context`, else `read`'s of it, kept.
    pub fn get_or_read(&self, file: &Opened, context: &str, read: impl FnOnce(&File) -> V) -> V {
        let meta = &file.meta;
        let key = FileKey {
            device: meta.dev(),
            inode: meta.ino(),
            version: FileVersion::of(meta),
            context: context.to_string(),
        };
        if let Some(value) = self.lock().get(&key) {
            return value.clone();
        }
        let value = read(file.file());
        let mut entries = self.lock();
        if entries.len() >= self.capacity {
            entries.clear();
        }
        entries.insert(key, value.clone());
        value
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<FileKey, V>> {
        // A panic elsewhere while the lock was held leaves whole entries: they are still good.
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_read_once_until_it_changes() {
        let dir = std::env::temp_dir().join(format!("memprof-file-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lib.so");
        std::fs::write(&path, b"one").unwrap();
        let cache = FileCache::new(8);
        let reads = std::cell::Cell::new(0);
        let read = |file: &File| {
            reads.set(reads.get() + 1);
            let mut text = Vec::new();
            std::io::Read::read_to_end(&mut &*file, &mut text).unwrap();
            text
        };
        let open = || Opened::open(&path).unwrap();
        assert_eq!(cache.get_or_read(&open(), "a", read), b"one");
        assert_eq!(cache.get_or_read(&open(), "a", read), b"one");
        assert_eq!(reads.get(), 1);
        // Another name for the same file is another value.
        cache.get_or_read(&open(), "b", read);
        assert_eq!(reads.get(), 2);
        // Rewritten with another size: read again.
        std::fs::write(&path, b"three").unwrap();
        assert_eq!(cache.get_or_read(&open(), "a", read), b"three");
        assert_eq!(reads.get(), 3);
        // Rewritten with the same size, later: read again.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&path, b"eerht").unwrap();
        assert_eq!(cache.get_or_read(&open(), "a", read), b"eerht");
        assert_eq!(reads.get(), 4);
        // Another file at the path since it was read: refused.
        let read_then = open();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"other").unwrap();
        assert!(Opened::open_same(&path, read_then.id()).is_err());
        assert!(Opened::open_same(&path, open().id()).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
