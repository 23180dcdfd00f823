//! The daemon's open files. Each target holds its probes' links, and the files its symbols are
//! read from, which are open once for all the targets that map them. Run out of them and
//! everything fails at once (the listener's accepts, reads of /proc that say whether a target
//! still runs), so the soft limit is raised at start and a new target is refused while too few
//! are left.

/// Descriptors a target may take: a few links, and two for each file it maps that no other
/// target maps yet (a program's first process).
const PER_TARGET: u64 = 32;
/// Kept for the listener's connections and everything else that is not a target.
const RESERVE: u64 = 512;

/// Raises the soft limit on open files to the hard one, as services that hold many do. Returns
/// the soft limit in force.
pub fn raise_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` into the struct it is given, which lives here.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit reads the struct it is given. It fails (and changes nothing) past
        // the kernel's `fs.nr_open`, as an unlimited hard limit is.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return raised.rlim_cur;
        }
    }
    limit.rlim_cur
}

/// Whether a target more fits under `limit` beside `targets`: the open descriptors are counted
/// only once the targets could take half of it.
pub fn room_for_another(targets: usize, limit: u64) -> bool {
    if (targets as u64 + 1) * PER_TARGET < limit / 2 {
        return true;
    }
    open() + PER_TARGET + RESERVE <= limit
}

/// The descriptors open now.
pub fn open() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_more_is_refused_near_the_limit() {
        assert!(room_for_another(1, 65_536));
        // Half the limit and more is counted: this test process holds a few, never 3,500.
        assert!(room_for_another(100, 4_096));
        // Whatever other tests open meanwhile: this process holds at least its standard streams.
        assert!(!room_for_another(100, PER_TARGET + RESERVE));
    }
}
