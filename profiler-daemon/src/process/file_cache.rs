//! What was read from a file, kept by the file's identity: the next process that maps the same
//! file (the C library, a shell, an interpreter's library, at every exec and attach) does not
//! read it again.

use std::{collections::HashMap, os::unix::fs::MetadataExt as _, path::Path, sync::Mutex};

/// A file as it is now: another file, or the same one rewritten, has another key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileKey {
    device: u64,
    inode: u64,
    size: u64,
    modified_ns: i128,
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

    /// The value kept for the file at `path` and `context`, else `read`'s, kept. A file that
    /// cannot be looked at is read every time.
    pub fn get_or_read(&self, path: &Path, context: &str, read: impl FnOnce() -> V) -> V {
        let Ok(meta) = std::fs::metadata(path) else { return read() };
        let key = FileKey {
            device: meta.dev(),
            inode: meta.ino(),
            size: meta.size(),
            modified_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            context: context.to_string(),
        };
        if let Some(value) = self.lock().get(&key) {
            return value.clone();
        }
        let value = read();
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
        let read = || {
            reads.set(reads.get() + 1);
            std::fs::read(&path).unwrap()
        };
        assert_eq!(cache.get_or_read(&path, "a", read), b"one");
        assert_eq!(cache.get_or_read(&path, "a", read), b"one");
        assert_eq!(reads.get(), 1);
        // Another name for the same file is another value.
        cache.get_or_read(&path, "b", read);
        assert_eq!(reads.get(), 2);
        // Rewritten with another size: read again.
        std::fs::write(&path, b"three").unwrap();
        assert_eq!(cache.get_or_read(&path, "a", read), b"three");
        assert_eq!(reads.get(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
