//! The memory memprof may still take: the room its cgroup leaves under each `memory.max` and
//! `memory.high` set up its hierarchy (v2; v1's `memory.limit_in_bytes` where the memory
//! controller is mounted apart), and never more than the host has available. Going by
//! the host alone, a daemon under `MemoryMax=` would start work the kernel OOM-kills it for.

use std::path::{Path, PathBuf};

use Limit::{CgroupHigh, CgroupMax};

/// Where the cgroup v2 hierarchy is mounted on every distribution memprof supports.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// How much memory memprof may still take, and what says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub bytes: u64,
    /// The host's memory, or the cgroup file that limits it.
    pub limited_by: Limit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Host,
    /// A cgroup's hard limit, read from this file (v2's `memory.max`, v1's `memory.limit_in_bytes`).
    CgroupMax(&'static str),
    /// A cgroup's soft limit, read from this file (v2's `memory.high`, v1's soft limit).
    CgroupHigh(&'static str),
    /// Neither could be read: memprof goes on as if unlimited.
    Unknown,
}

impl std::fmt::Display for Room {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = self.bytes >> 20;
        match self.limited_by {
            Limit::Host => write!(f, "{mib} MiB available on this host"),
            Limit::CgroupMax(file) => write!(f, "{mib} MiB left to memprof under its cgroup's memory limit ({file})"),
            Limit::CgroupHigh(file) => write!(f, "{mib} MiB left to memprof under its cgroup's {file}"),
            Limit::Unknown => write!(f, "{mib} MiB available (unknown)"),
        }
    }
}

/// The memory this process may still take.
pub fn room() -> Room {
    let host = mem_available().map(|bytes| Room { bytes, limited_by: Limit::Host });
    let cgroup = own_cgroup("0::")
        .and_then(|dir| cgroup_room(Path::new(CGROUP_ROOT), &dir, V2))
        .or_else(|| own_cgroup_v1().and_then(|dir| cgroup_room(&Path::new(CGROUP_ROOT).join("memory"), &dir, V1)));
    match (host, cgroup) {
        (Some(host), Some(cgroup)) if cgroup.bytes < host.bytes => cgroup,
        (Some(host), _) => host,
        (None, Some(cgroup)) => cgroup,
        (None, None) => Room { bytes: u64::MAX, limited_by: Limit::Unknown },
    }
}

/// The files that say what a cgroup uses and may use: v2's, and v1's memory controller's.
type Files = (&'static str, [Limit; 2]);
const V2: Files = ("memory.current", [CgroupMax("memory.max"), CgroupHigh("memory.high")]);
const V1: Files =
    ("memory.usage_in_bytes", [CgroupMax("memory.limit_in_bytes"), CgroupHigh("memory.soft_limit_in_bytes")]);

/// This process's cgroup path on the line of /proc/self/cgroup that starts with `prefix`.
fn own_cgroup(prefix: &str) -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix(prefix))?;
    Some(PathBuf::from(path.trim_start_matches('/')))
}

/// This process's cgroup in v1's memory hierarchy (`N:memory:/path`).
fn own_cgroup_v1() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    })?;
    Some(PathBuf::from(path.trim_start_matches('/')))
}

/// The least room any cgroup from `dir` up to `root` leaves: its limit less what it uses now.
fn cgroup_room(root: &Path, dir: &Path, files: Files) -> Option<Room> {
    cgroup_limits(root, dir, files)
        .map(|(_, limited_by, limit, usage)| Room { bytes: limit.saturating_sub(usage.used), limited_by })
        .min_by_key(|room| room.bytes)
}

/// What the cgroups from `dir` up to `root` use, and each limit of theirs that is set: the
/// cgroup (relative to `root`), which limit, the limit in bytes, and its use.
fn cgroup_limits<'a>(
    root: &'a Path,
    dir: &'a Path,
    (usage, limits): Files,
) -> impl Iterator<Item = (&'a Path, Limit, u64, Usage)> + 'a {
    dir.ancestors().flat_map(move |ancestor| {
        let at = root.join(ancestor);
        let used = read_u64(&at.join(usage));
        limits.into_iter().filter_map(move |limited_by| {
            let (Limit::CgroupMax(file) | Limit::CgroupHigh(file)) = limited_by else { return None };
            // "max" (no limit) does not parse.
            let limit = read_u64(&at.join(file))?;
            Some((ancestor, limited_by, limit, Usage { used: used?, at: at.clone() }))
        })
    })
}

/// What a cgroup uses, and its directory (for its `memory.stat`).
struct Usage {
    used: u64,
    at: PathBuf,
}

impl Usage {
    /// What it uses less the page cache the kernel reclaims first, before any OOM kill
    /// (`inactive_file` of its `memory.stat`; v1's `total_inactive_file` counts its children too,
    /// as its usage does).
    fn unreclaimable(&self) -> u64 {
        let stat = std::fs::read_to_string(self.at.join("memory.stat")).unwrap_or_default();
        let inactive = ["inactive_file ", "total_inactive_file "]
            .iter()
            .filter_map(|key| stat.lines().find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok()))
            .max()
            .unwrap_or(0);
        self.used.saturating_sub(inactive)
    }
}

/// The room the tightest hard memory limit over this process's cgroup and its ancestors leaves it
/// (v2's `memory.max`, v1's `memory.limit_in_bytes`), the page cache the kernel would reclaim
/// counted as room: past it, the kernel OOM-kills a process it cannot refuse memory to. None
/// without such a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HardLimit {
    pub room: u64,
    /// The cgroup that sets it, as /proc/PID/cgroup names it ("/system.slice/memprof.service").
    pub cgroup: PathBuf,
    /// The file that holds the limit.
    pub file: &'static str,
}

pub fn hard_limit() -> Option<HardLimit> {
    own_cgroup("0::").and_then(|dir| tightest_hard_limit(Path::new(CGROUP_ROOT), &dir, V2)).or_else(|| {
        own_cgroup_v1().and_then(|dir| tightest_hard_limit(&Path::new(CGROUP_ROOT).join("memory"), &dir, V1))
    })
}

fn tightest_hard_limit(root: &Path, dir: &Path, files: Files) -> Option<HardLimit> {
    cgroup_limits(root, dir, files)
        .filter_map(|(cgroup, limited_by, limit, usage)| {
            let Limit::CgroupMax(file) = limited_by else { return None };
            let room = limit.saturating_sub(usage.unreclaimable());
            Some(HardLimit { room, cgroup: Path::new("/").join(cgroup), file })
        })
        .min_by_key(|limit| limit.room)
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    Some(line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()? * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tightest_limit_up_the_hierarchy_less_its_use_is_the_room() {
        let root = std::env::temp_dir().join(format!("memprof-cgroup-test-{}", std::process::id()));
        let leaf = root.join("a/b");
        std::fs::create_dir_all(&leaf).unwrap();
        let write = |dir: &Path, file: &str, value: &str| std::fs::write(dir.join(file), value).unwrap();
        write(&leaf, "memory.current", "100");
        write(&leaf, "memory.max", "max\n");
        write(&leaf, "memory.high", "max\n");
        write(&root.join("a"), "memory.current", "300");
        write(&root.join("a"), "memory.max", "1000\n");
        write(&root.join("a"), "memory.high", "900\n");
        let room = cgroup_room(&root, Path::new("a/b"), V2).unwrap();
        assert_eq!(room, Room { bytes: 600, limited_by: CgroupHigh("memory.high") });
        write(&leaf, "memory.max", "150\n");
        let room = cgroup_room(&root, Path::new("a/b"), V2).unwrap();
        assert_eq!(room, Room { bytes: 50, limited_by: CgroupMax("memory.max") });
        assert_eq!(cgroup_room(&root, Path::new("c"), V2), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_tightest_hard_limit_counts_inactive_page_cache_as_room_and_names_its_cgroup() {
        let root = std::env::temp_dir().join(format!("memprof-cgroup-hard-test-{}", std::process::id()));
        let leaf = root.join("a/b");
        std::fs::create_dir_all(&leaf).unwrap();
        let write = |dir: &Path, file: &str, value: &str| std::fs::write(dir.join(file), value).unwrap();
        let mib = |n: u64| (n << 20).to_string();
        write(&leaf, "memory.current", &mib(10));
        write(&leaf, "memory.max", "max\n");
        // A soft limit throttles, and kills nothing: not a hard limit.
        write(&leaf, "memory.high", &mib(11));
        write(&root.join("a"), "memory.current", &mib(300));
        write(&root.join("a"), "memory.max", &mib(400));
        write(&root.join("a"), "memory.stat", &format!("anon {}\ninactive_file {}\n", mib(200), mib(50)));
        let limit = tightest_hard_limit(&root, Path::new("a/b"), V2).unwrap();
        assert_eq!(limit, HardLimit { room: 150 << 20, cgroup: PathBuf::from("/a"), file: "memory.max" });
        write(&leaf, "memory.max", &mib(100));
        let limit = tightest_hard_limit(&root, Path::new("a/b"), V2).unwrap();
        assert_eq!(limit, HardLimit { room: 90 << 20, cgroup: PathBuf::from("/a/b"), file: "memory.max" });
        std::fs::remove_dir_all(&root).unwrap();

        let root = std::env::temp_dir().join(format!("memprof-cgroup-hard-v1-test-{}", std::process::id()));
        std::fs::create_dir_all(root.join("a")).unwrap();
        write(&root.join("a"), "memory.usage_in_bytes", &mib(60));
        write(&root.join("a"), "memory.limit_in_bytes", &mib(128));
        write(&root.join("a"), "memory.stat", &format!("inactive_file {}\ntotal_inactive_file {}\n", mib(1), mib(4)));
        let limit = tightest_hard_limit(&root, Path::new("a"), V1).unwrap();
        assert_eq!(limit, HardLimit { room: 72 << 20, cgroup: PathBuf::from("/a"), file: "memory.limit_in_bytes" });
        assert_eq!(tightest_hard_limit(&root, Path::new("c"), V1), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_v1_limit_is_named_by_its_own_file() {
        let root = std::env::temp_dir().join(format!("memprof-cgroup-v1-test-{}", std::process::id()));
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::write(root.join("a/memory.usage_in_bytes"), "1048576").unwrap();
        std::fs::write(root.join("a/memory.limit_in_bytes"), "3145728").unwrap();
        let room = cgroup_room(&root, Path::new("a"), V1).unwrap();
        assert_eq!(room.to_string(), "2 MiB left to memprof under its cgroup's memory limit (memory.limit_in_bytes)");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
