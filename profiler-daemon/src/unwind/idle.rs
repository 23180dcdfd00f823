//! Tables of files no traced process maps any more, kept a while for the next process that maps
//! them (`--keep-unwind-tables`). A program started again and again (a service's workers, a
//! script run by cron, a build's compilers) would otherwise have its libraries' tables built anew
//! each time, at a cost to the daemon, while its walks wait for them (`deferred`). An idle table
//! gives its rows back once kept long enough, or at once when a new table needs them.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

/// A mapped file, named by device and inode: the same while any process maps it.
pub type FileKey = (String, u64);

/// The idle tables, by when their last process let them go.
#[derive(Debug)]
pub struct IdleTables {
    keep: Duration,
    since: HashMap<FileKey, Instant>,
}

impl IdleTables {
    pub fn new(keep: Duration) -> Self {
        Self { keep, since: HashMap::new() }
    }

    pub fn set_keep(&mut self, keep: Duration) {
        self.keep = keep;
    }

    /// The file's last process let it go at `now`, unless it was idle already.
    pub fn went_idle(&mut self, key: &FileKey, now: Instant) {
        if !self.since.contains_key(key) {
            self.since.insert(key.clone(), now);
        }
    }

    pub fn contains(&self, key: &FileKey) -> bool {
        self.since.contains_key(key)
    }

    pub fn is_empty(&self) -> bool {
        self.since.is_empty()
    }

    /// The file is mapped again, or its table went.
    pub fn remove(&mut self, key: &FileKey) {
        self.since.remove(key);
    }

    /// Whether the file's table, idle, has been kept long enough at `now`.
    pub fn expired(&self, key: &FileKey, now: Instant) -> bool {
        self.since.get(key).is_some_and(|since| now.saturating_duration_since(*since) >= self.keep)
    }

    /// The file idle the longest: the first whose rows a new table takes.
    pub fn oldest(&self) -> Option<FileKey> {
        self.since.iter().min_by_key(|(_, since)| **since).map(|(key, _)| key.clone())
    }

    /// When the next idle table's time is up.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.since.values().min().map(|since| *since + self.keep)
    }

    pub fn keys(&self) -> impl Iterator<Item = &FileKey> {
        self.since.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(inode: u64) -> FileKey {
        ("fe:01".to_string(), inode)
    }

    #[test]
    fn an_idle_table_is_kept_its_time_and_the_oldest_goes_first() {
        let start = Instant::now();
        let mut idle = IdleTables::new(Duration::from_secs(60));
        idle.went_idle(&key(1), start);
        idle.went_idle(&key(2), start + Duration::from_secs(10));
        // Idle already: its time runs from the first.
        idle.went_idle(&key(1), start + Duration::from_secs(20));
        assert_eq!(idle.oldest(), Some(key(1)));
        assert_eq!(idle.next_expiry(), Some(start + Duration::from_secs(60)));
        assert!(!idle.expired(&key(1), start + Duration::from_secs(59)));
        assert!(idle.expired(&key(1), start + Duration::from_secs(60)));
        assert!(!idle.expired(&key(2), start + Duration::from_secs(60)));
        idle.remove(&key(1));
        assert_eq!(idle.oldest(), Some(key(2)));
        assert!(!idle.expired(&key(1), start + Duration::from_secs(600)), "mapped again: not idle");
        idle.set_keep(Duration::ZERO);
        assert!(idle.expired(&key(2), start + Duration::from_secs(10)), "kept for no time: goes at once");
    }
}
