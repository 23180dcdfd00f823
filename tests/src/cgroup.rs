//! Memory cgroups for tests that run memprof under a memory limit.

use std::path::PathBuf;

/// A memory cgroup limited to `limit` bytes, removed when dropped: cgroup v2 when its memory
/// controller is there, else v1's memory hierarchy.
pub struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    pub fn new(name: &str, limit_bytes: u64) -> Self {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        let v2_mount = mounts
            .lines()
            .find(|l| l.split_whitespace().nth(2) == Some("cgroup2"))
            .map(|l| PathBuf::from(l.split_whitespace().nth(1).unwrap()));
        let v2 = v2_mount.as_ref().filter(|m| {
            std::fs::read_to_string(m.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        });
        let (dir, v2) = match v2 {
            Some(mount) => (mount.join(name), true),
            None => (PathBuf::from("/sys/fs/cgroup/memory").join(name), false),
        };
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating the memory cgroup {}: {e}", dir.display()));
        let group = Self { dir, v2 };
        std::fs::write(group.dir.join(group.limit_file()), limit_bytes.to_string()).unwrap();
        group
    }

    /// The file that holds its limit, which memprof's messages name.
    pub fn limit_file(&self) -> &'static str {
        if self.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        }
    }

    pub fn enter(&self, pid: u32) {
        std::fs::write(self.procs(), pid.to_string()).expect("moving a process into the cgroup");
    }

    /// The file a process writes its pid to, to enter the cgroup.
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn value(&self, file: &str, key: Option<&str>) -> u64 {
        let text = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        match key {
            None => text.trim().parse().unwrap_or(0),
            Some(key) => text.lines().find_map(|l| l.strip_prefix(key)?.trim().parse().ok()).unwrap_or(0),
        }
    }

    /// The most memory its processes used, page cache included.
    pub fn peak(&self) -> u64 {
        if self.v2 {
            self.value("memory.peak", None)
        } else {
            self.value("memory.max_usage_in_bytes", None)
        }
    }

    pub fn oom_kills(&self) -> u64 {
        if self.v2 {
            self.value("memory.events", Some("oom_kill "))
        } else {
            self.value("memory.oom_control", Some("oom_kill "))
        }
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // A process killed a moment ago may still be leaving it: the kernel refuses to remove a
        // cgroup with a process in it (EBUSY).
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
