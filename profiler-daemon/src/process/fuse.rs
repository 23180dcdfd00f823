//! The FUSE file systems of users other than root that a process sees. Such a file system is
//! served by a program of its user's, which answers the kernel's requests on its files when it
//! likes: never, for memprof's. Root can open a user's mount where `/etc/fuse.conf` has
//! `user_allow_other` (elsewhere the kernel refuses it at once). A look at such a file (its
//! attributes, an open, a read) would then hold memprof's thread for good. So memprof leaves
//! those files alone: it reads neither their code nor their symbols, and names nothing by a
//! path through them.

use std::{
    collections::HashSet,
    io,
    os::unix::ffi::OsStringExt as _,
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use super::procfs::{dir, read_text};
use crate::text::printable;

/// A FUSE mount of a user other than root: its device and where it is mounted.
struct UsersMount {
    device: (u64, u64),
    mount_point: PathBuf,
}

/// `line` of `/proc/PID/mountinfo`, when it is a FUSE mount whose server is not root's: its
/// `user_id` (the mounting user, as this process's user namespace sees it) is not 0.
fn users_fuse(line: &str) -> Option<UsersMount> {
    let mut fields = line.split(' ');
    let device = fields.nth(2)?;
    let mount_point = fields.nth(1)?;
    let mut after_separator = fields.skip_while(|field| *field != "-").skip(1);
    let (fs_type, options) = (after_separator.next()?, after_separator.nth(1)?);
    // Not `fuseblk`, whose device is the block device it serves: mounting it takes one that
    // root gave the user.
    let fuse = fs_type == "fuse" || fs_type.starts_with("fuse.");
    if !fuse || options.split(',').any(|option| option == "user_id=0") {
        return None;
    }
    let (major, minor) = device.split_once(':')?;
    Some(UsersMount { device: (major.parse().ok()?, minor.parse().ok()?), mount_point: unescaped(mount_point) })
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

fn users_mounts(pid: u32) -> io::Result<Vec<UsersMount>> {
    Ok(read_text(format!("{}/mountinfo", dir(pid)))?.lines().filter_map(users_fuse).collect())
}

/// The devices (major, minor) of the FUSE file systems of users other than root that `pid`
/// sees.
pub fn users_devices(pid: u32) -> io::Result<Vec<(u64, u64)>> {
    Ok(users_mounts(pid)?.into_iter().map(|mount| mount.device).collect())
}

/// Where memprof itself sees the FUSE file systems of users other than root: the paths of a
/// process gone, read in memprof's own mounts, are not followed through them.
pub struct MemprofsView(Option<Vec<PathBuf>>);

impl MemprofsView {
    pub fn read() -> Self {
        Self(users_mounts(std::process::id()).ok().map(|mounts| mounts.into_iter().map(|m| m.mount_point).collect()))
    }

    /// Whether `path` may lead through one (any path, when memprof's mounts could not be read).
    pub fn through_users_mount(&self, path: &Path) -> bool {
        self.0.as_ref().is_none_or(|points| points.iter().any(|point| path.starts_with(point)))
    }
}

/// Processes `say_left_alone` remembers having spoken of.
const MOST_PROCESSES_REMEMBERED: usize = 4096;

/// Says once per process that memprof leaves `pid`'s files on a user's FUSE mount alone.
pub fn say_left_alone(pid: u32, paths: &[&str]) {
    static SAID: Mutex<Option<HashSet<u32>>> = Mutex::new(None);
    let mut said = SAID.lock().unwrap_or_else(PoisonError::into_inner);
    let said = said.get_or_insert_with(HashSet::new);
    // Bounded: a daemon that runs for months sees pids come and go; one said again costs a line.
    if said.len() >= MOST_PROCESSES_REMEMBERED {
        said.clear();
    }
    if said.insert(pid) {
        tracing::warn!(
            "pid {pid} maps {} from another user's FUSE file system, whose server could hold memprof for good: memprof leaves them alone, and frames in them are unnamed",
            paths.iter().map(|path| printable(path)).collect::<Vec<_>>().join(", ")
        );
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
    fn a_users_fuse_mount_is_told_from_roots() {
        let read = |line| users_fuse(line).map(|mount| (mount.device, mount.mount_point));
        let users = "1070 29 0:63 / /tmp/my\\040mnt rw,nosuid,nodev,relatime shared:580 - fuse.sshfs me@host:/ rw,user_id=1000,group_id=1000";
        assert_eq!(read(users), Some(((0, 63), PathBuf::from("/tmp/my mnt"))));
        let no_optional_fields = "36 25 0:32 / /mnt rw - fuse /dev/fuse rw,user_id=1000,group_id=1000,allow_other";
        assert_eq!(read(no_optional_fields), Some(((0, 32), PathBuf::from("/mnt"))));
        let roots = "1071 29 0:64 / /srv/data rw,relatime shared:581 - fuse.sshfs root@host:/ rw,user_id=0,group_id=0";
        assert_eq!(read(roots), None);
        let overlay = "620 545 0:55 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w";
        assert_eq!(read(overlay), None);
    }

    #[test]
    fn a_maps_device_is_read_in_hex() {
        assert_eq!(maps_device("00:2f"), Some((0, 47)));
        assert_eq!(maps_device("103:02"), Some((259, 2)));
    }
}
