//! Each user's part of the unwind rows, bounded in the daemon: the rows are one array for every
//! traced process, and without a bound one user's processes, mapping large files, could take
//! them all and leave every later process's stacks cut (docs: reference/limits.md#unwind-rows).
//!
//! A user's rows are those of the tables of every file their traced processes map, a file mapped
//! by several users counted for each. Only a table not loaded yet is refused, and only to the
//! user it would take past the bound: a table in the kernel already costs no row more, and a
//! shared library refused to one user is loaded for the next whose processes map it.

use std::collections::HashMap;

/// Root's processes are the host's own services (and, on Kubernetes, every container without a
/// user namespace): one user for all of them, bounded by `--max-unwind-rows` alone.
const ROOT: u32 = 0;

/// The rows each user's traced processes hold, and the most a user may take.
#[derive(Debug, Default)]
pub struct UserShares {
    /// `--max-unwind-rows-per-user`; None outside the daemon (`attach` and `run` trace what one
    /// person chose).
    limit: Option<u32>,
    rows: HashMap<u32, u64>,
}

impl UserShares {
    pub fn bound(&mut self, limit: u32) {
        self.limit = Some(limit);
    }

    pub fn limit(&self) -> Option<u32> {
        self.limit
    }

    /// The rows `uid`'s traced processes hold.
    pub fn held(&self, uid: u32) -> u64 {
        self.rows.get(&uid).copied().unwrap_or(0)
    }

    /// Whether a new table of `rows` rows stays within `uid`'s share.
    pub fn fits(&self, uid: u32, rows: u32) -> bool {
        uid == ROOT || self.limit.is_none_or(|limit| self.held(uid) + u64::from(rows) <= u64::from(limit))
    }

    /// `uid`'s processes map a file of `rows` rows none of theirs mapped before.
    pub fn take(&mut self, uid: u32, rows: u32) {
        *self.rows.entry(uid).or_default() += u64::from(rows);
    }

    /// No process of `uid` maps a file of `rows` rows any more.
    pub fn give(&mut self, uid: u32, rows: u32) {
        if let Some(held) = self.rows.get_mut(&uid) {
            *held = held.saturating_sub(u64::from(rows));
            if *held == 0 {
                self.rows.remove(&uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_is_refused_past_the_bound_and_root_never() {
        let mut shares = UserShares::default();
        shares.take(1000, 900);
        assert!(shares.fits(1000, 1_000_000), "no bound outside the daemon");
        shares.bound(1000);
        assert!(shares.fits(1000, 100));
        assert!(!shares.fits(1000, 101));
        assert!(shares.fits(1001, 1000), "another user has a share of their own");
        shares.take(ROOT, 5000);
        assert!(shares.fits(ROOT, 1_000_000));
        shares.give(1000, 900);
        assert_eq!(shares.held(1000), 0);
        assert!(shares.fits(1000, 1000));
    }
}
