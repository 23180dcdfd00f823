//! Tables of files no traced process maps any more, kept a while for the next process that maps
//! them (`--keep-unwind-tables`). A program started again and again (a service's workers, a
//! script run by cron, a build's compilers) would otherwise have its libraries' tables built anew
//! each time, at a cost to the daemon, while its walks wait for them (`deferred`). An idle table
//! gives its rows back once kept long enough, or at once when a new table needs them.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use super::space::RowSpace;

/// A mapped file, named by device and inode: the same while any process maps it.
pub type FileKey = (String, u64);

/// The idle tables, by when their last process let them go.
#[derive(Debug)]
pub struct IdleTables {
    keep: Duration,
    since: HashMap<FileKey, Instant>,
    /// Idle tables a mapping list being synced names (see `claim`), with their idle time.
    claimed: HashMap<FileKey, Instant>,
}

impl IdleTables {
    pub fn new(keep: Duration) -> Self {
        Self { keep, since: HashMap::new(), claimed: HashMap::new() }
    }

    pub fn set_keep(&mut self, keep: Duration) {
        self.keep = keep;
    }

    /// The file's last process let it go at `now`, unless it was idle already (claimed too:
    /// its time runs from then).
    pub fn went_idle(&mut self, key: &FileKey, now: Instant) {
        let since = self.claimed.remove(key).unwrap_or(now);
        self.since.entry(key.clone()).or_insert(since);
    }

    /// Keeps an idle table for a list being synced: no new table takes its rows meanwhile, and
    /// its time does not run. It is idle again, with its time, if no process maps it after all
    /// (`went_idle`, `unclaim`).
    pub fn claim(&mut self, key: &FileKey) {
        if let Some(since) = self.since.remove(key) {
            self.claimed.insert(key.clone(), since);
        }
    }

    /// A claimed table no process of the list took: idle again at once, with its time.
    pub fn unclaim(&mut self, key: &FileKey) {
        if let Some(since) = self.claimed.remove(key) {
            self.since.insert(key.clone(), since);
        }
    }

    pub fn contains(&self, key: &FileKey) -> bool {
        self.since.contains_key(key)
    }

    /// The file is mapped again, or its table went.
    pub fn remove(&mut self, key: &FileKey) {
        self.since.remove(key);
        self.claimed.remove(key);
    }

    /// Whether the file's table, idle, has been kept long enough at `now`.
    pub fn expired(&self, key: &FileKey, now: Instant) -> bool {
        self.since.get(key).is_some_and(|since| now.saturating_duration_since(*since) >= self.keep)
    }

    /// The idle files, the longest idle first: the order in which a new table takes their rows.
    pub fn oldest_first(&self) -> Vec<FileKey> {
        let mut idle: Vec<(&FileKey, &Instant)> = self.since.iter().collect();
        idle.sort_by_key(|&(key, since)| (*since, key));
        idle.into_iter().map(|(key, _)| key.clone()).collect()
    }

    /// When the next idle table's time is up.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.since.values().min().map(|since| *since + self.keep)
    }

    pub fn keys(&self) -> impl Iterator<Item = &FileKey> {
        self.since.keys()
    }
}

/// How many of the idle tables' row ranges `idle` (first row and rows, the longest idle first)
/// must be freed in `space` for a range of `rows` rows to be free; None when freeing all of them
/// would not do, and then none is freed: a table that cannot fit takes nothing from the others.
pub fn evictions_needed(space: &RowSpace, idle: &[(u32, u32)], rows: u32) -> Option<usize> {
    if space.fits(rows) {
        return Some(0);
    }
    let mut space = space.clone();
    for (count, &(first_row, length)) in idle.iter().enumerate() {
        space.free(first_row, length);
        if space.fits(rows) {
            return Some(count + 1);
        }
    }
    None
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
        assert_eq!(idle.oldest_first(), [key(1), key(2)]);
        assert_eq!(idle.next_expiry(), Some(start + Duration::from_secs(60)));
        assert!(!idle.expired(&key(1), start + Duration::from_secs(59)));
        assert!(idle.expired(&key(1), start + Duration::from_secs(60)));
        assert!(!idle.expired(&key(2), start + Duration::from_secs(60)));
        // Claimed for a list, then let go again: idle with its first time, not a new one.
        idle.claim(&key(1));
        assert_eq!(idle.oldest_first(), [key(2)], "a claimed table's rows are not taken");
        idle.went_idle(&key(1), start + Duration::from_secs(50));
        assert_eq!(idle.next_expiry(), Some(start + Duration::from_secs(60)));
        idle.claim(&key(1));
        idle.unclaim(&key(1));
        assert_eq!(idle.oldest_first(), [key(1), key(2)]);
        idle.claim(&key(1));
        idle.remove(&key(1));
        assert_eq!(idle.oldest_first(), [key(2)]);
        idle.went_idle(&key(1), start + Duration::from_secs(70));
        assert_eq!(idle.oldest_first(), [key(2), key(1)], "mapped, then let go: idle from then");
        idle.remove(&key(1));
        assert!(!idle.expired(&key(1), start + Duration::from_secs(600)), "mapped again: not idle");
        idle.set_keep(Duration::ZERO);
        assert!(idle.expired(&key(2), start + Duration::from_secs(10)), "kept for no time: goes at once");
    }

    #[test]
    fn only_the_idle_tables_a_new_one_needs_go_and_none_when_all_would_not_do() {
        // 100 rows: idle tables at 0..30 (the longest idle) and 60..90, one in use at 30..60.
        let mut space = RowSpace::new(100);
        let (first, in_use, second) = (space.alloc(30).unwrap(), space.alloc(30).unwrap(), space.alloc(30).unwrap());
        assert_eq!((first, in_use, second), (0, 30, 60));
        let idle = [(first, 30), (second, 30)];
        assert_eq!(evictions_needed(&space, &idle, 10), Some(0), "10 rows free at 90..100");
        assert_eq!(evictions_needed(&space, &idle, 30), Some(1), "the longest idle one's 30 rows");
        assert_eq!(evictions_needed(&space, &idle, 40), Some(2), "60..100, once the second goes");
        assert_eq!(evictions_needed(&space, &idle, 41), None, "never 41 rows together beside the one in use");
        assert_eq!(space.used(), 90, "the space itself is left as it was");
    }
}
