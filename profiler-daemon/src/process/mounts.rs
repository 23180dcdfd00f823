//! The mounts whose files could hold memprof for good, as a process sees them.
//!
//! - A FUSE file system of a user other than root is served by a program of that user's, which
//!   answers the kernel's requests on its files when it likes: never, for memprof's. Root can
//!   open a user's mount where `/etc/fuse.conf` has `user_allow_other` (elsewhere the kernel
//!   refuses it at once). memprof leaves those files alone: it reads neither their code nor their
//!   symbols, and names nothing by a path through them.
//! - Root's FUSE file systems and network file systems answer unless their server hangs or is
//!   gone. memprof looks at their files only while they answer (see `answers`).

use std::{
    collections::HashSet,
    io,
    os::unix::ffi::OsStringExt as _,
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use super::{
    answers::{answers, ANSWER_TIME},
    procfs::{dir, read_text},
};
use crate::text::printable;

/// Why a mount's files may hold memprof.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Risk {
    /// A FUSE file system of a user other than root: never looked at.
    UsersFuse,
    /// Root's FUSE file systems and network file systems: looked at while they answer.
    MayNotAnswer,
}

/// A mount whose files may hold memprof: its device, where it is mounted, and why.
pub struct RiskyMount {
    pub device: (u64, u64),
    mount_point: PathBuf,
    pub risk: Risk,
}

/// File systems served over a network or by a program, whose requests wait for that server.
/// `fuseblk` (FUSE on a block device) is among them: mounting one takes a block device that
/// root gave the user, so it is never a user's.
const SERVED: [&str; 10] = ["fuseblk", "nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "afs", "virtiofs", "glusterfs"];

impl RiskyMount {
    /// Whether memprof may look at this mount's files now, `probe` being one of them as memprof
    /// reaches it: never a user's FUSE mount's; another's while it answers.
    pub fn may_look_at(&self, probe: &Path) -> bool {
        self.risk == Risk::MayNotAnswer && answers(self.device, probe)
    }
}

/// `line` of `/proc/PID/mountinfo`, when its files may hold memprof. A FUSE mount is a user's
/// when its `user_id` (the mounting user, as this process's user namespace sees it) is not 0.
fn risky(line: &str) -> Option<RiskyMount> {
    let mut fields = line.split(' ');
    let device = fields.nth(2)?;
    let mount_point = fields.nth(1)?;
    let mut after_separator = fields.skip_while(|field| *field != "-").skip(1);
    let (fs_type, options) = (after_separator.next()?, after_separator.nth(1)?);
    let risk = if fs_type == "fuse" || fs_type.starts_with("fuse.") {
        if options.split(',').any(|option| option == "user_id=0") {
            Risk::MayNotAnswer
        } else {
            Risk::UsersFuse
        }
    } else if SERVED.contains(&fs_type) {
        Risk::MayNotAnswer
    } else {
        return None;
    };
    let (major, minor) = device.split_once(':')?;
    Some(RiskyMount { device: (major.parse().ok()?, minor.parse().ok()?), mount_point: unescaped(mount_point), risk })
}

/// A mount point as mountinfo writes it: space, tab, newline and backslash as octal escapes.
fn unescaped(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let code =
            bytes.get(at + 1..at + 4).and_then(|digits| u8::from_str_radix(std::str::from_utf8(digits).ok()?, 8).ok());
        match code {
            Some(byte) if bytes[at] == b'\\' => {
                out.push(byte);
                at += 4;
            }
            _ => {
                out.push(bytes[at]);
                at += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The mounts `pid` sees whose files may hold memprof.
pub fn risky_mounts(pid: u32) -> io::Result<Vec<RiskyMount>> {
    Ok(read_text(format!("{}/mountinfo", dir(pid)))?.lines().filter_map(risky).collect())
}

/// Whether `mounts` holds a user's FUSE mount: a path the process chose may then lead into it
/// through a link, which only following it would tell.
pub fn has_users_fuse(mounts: &[RiskyMount]) -> bool {
    mounts.iter().any(|mount| mount.risk == Risk::UsersFuse)
}

/// Whether memprof may look at `path`, a path as the mounts `mounts` see it (`probe`: the same
/// file, as memprof reaches it): not on a user's FUSE mount, nor on one that does not answer.
/// The longest mount point that holds the path decides.
pub fn may_look(mounts: &[RiskyMount], path: &Path, probe: &Path) -> bool {
    let holder = mounts
        .iter()
        .filter(|mount| path.starts_with(&mount.mount_point))
        .max_by_key(|mount| mount.mount_point.as_os_str().len());
    holder.is_none_or(|mount| mount.may_look_at(probe))
}

/// Where memprof itself sees the mounts whose files may hold it: the paths of a process gone,
/// read in memprof's own mounts, are looked at only where `may_look` allows.
pub struct MemprofsView(Option<Vec<RiskyMount>>);

impl MemprofsView {
    pub fn read() -> Self {
        Self(risky_mounts(std::process::id()).ok())
    }

    /// Whether memprof may look at `path` (at no path, when its mounts could not be read).
    pub fn may_look(&self, path: &Path) -> bool {
        self.0.as_ref().is_some_and(|mounts| may_look(mounts, path, path))
    }
}

/// Processes `say_left_alone` remembers having spoken of.
const MOST_PROCESSES_REMEMBERED: usize = 4096;

/// Says once per process and risk that memprof leaves `pid`'s files `paths` alone.
pub fn say_left_alone(pid: u32, risk: Risk, paths: &[&str]) {
    static SAID: Mutex<Option<HashSet<(u32, Risk)>>> = Mutex::new(None);
    let mut said = SAID.lock().unwrap_or_else(PoisonError::into_inner);
    let said = said.get_or_insert_with(HashSet::new);
    // Bounded: a daemon that runs for months sees pids come and go; one said again costs a line.
    if said.len() >= MOST_PROCESSES_REMEMBERED {
        said.clear();
    }
    if !said.insert((pid, risk)) {
        return;
    }
    let paths = paths.iter().map(|path| printable(path)).collect::<Vec<_>>().join(", ");
    match risk {
        Risk::UsersFuse => tracing::warn!(
            "pid {pid} maps {paths} from another user's FUSE file system, whose server could hold memprof for good: memprof leaves them alone, and frames in them are unnamed"
        ),
        Risk::MayNotAnswer => tracing::warn!(
            "pid {pid} maps {paths} from a file system that did not answer within {} s: memprof leaves them alone while it does not, and frames in them are unnamed",
            ANSWER_TIME.as_secs()
        ),
    }
}

/// `major:minor` as `/proc/PID/maps` writes a device (in hex), as numbers.
pub fn maps_device(device: &str) -> Option<(u64, u64)> {
    let (major, minor) = device.split_once(':')?;
    Some((u64::from_str_radix(major, 16).ok()?, u64::from_str_radix(minor, 16).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_fuse_mount_is_told_from_roots_and_from_network_file_systems() {
        let read = |line| risky(line).map(|mount| (mount.device, mount.mount_point, mount.risk));
        let users = "1070 29 0:63 / /tmp/my\\040mnt rw,nosuid,nodev,relatime shared:580 - fuse.sshfs me@host:/ rw,user_id=1000,group_id=1000";
        assert_eq!(read(users), Some(((0, 63), PathBuf::from("/tmp/my mnt"), Risk::UsersFuse)));
        let no_optional_fields = "36 25 0:32 / /mnt rw - fuse /dev/fuse rw,user_id=1000,group_id=1000,allow_other";
        assert_eq!(read(no_optional_fields), Some(((0, 32), PathBuf::from("/mnt"), Risk::UsersFuse)));
        let roots = "1071 29 0:64 / /srv/data rw,relatime shared:581 - fuse.sshfs root@host:/ rw,user_id=0,group_id=0";
        assert_eq!(read(roots), Some(((0, 64), PathBuf::from("/srv/data"), Risk::MayNotAnswer)));
        let nfs = "80 29 0:50 / /home rw,relatime shared:40 - nfs4 server:/home rw,vers=4.2,hard,proto=tcp";
        assert_eq!(read(nfs), Some(((0, 50), PathBuf::from("/home"), Risk::MayNotAnswer)));
        let overlay = "620 545 0:55 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w";
        assert_eq!(read(overlay).map(|mount| mount.2), None);
    }

    #[test]
    fn the_longest_mount_point_holding_a_path_decides() {
        let mount = |point: &str, risk| RiskyMount { device: (0, 1), mount_point: PathBuf::from(point), risk };
        let mounts = [mount("/srv", Risk::UsersFuse), mount("/srv/a", Risk::UsersFuse)];
        assert!(!may_look(&mounts, Path::new("/srv/a/prog"), Path::new("/nonexistent")));
        assert!(may_look(&mounts, Path::new("/srvx/prog"), Path::new("/nonexistent")));
        assert!(may_look(&mounts, Path::new("/usr/bin/prog"), Path::new("/nonexistent")));
    }

    #[test]
    fn a_maps_device_is_read_in_hex() {
        assert_eq!(maps_device("00:2f"), Some((0, 47)));
        assert_eq!(maps_device("103:02"), Some((259, 2)));
    }
}
