//! What memprof reads about a process from `/proc`.

use std::{
    collections::HashMap,
    fs, io,
    ops::Range,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use super::{
    file_cache::{FileId, Opened},
    mounts,
};
use crate::{error::UserError, text::printable};

/// A `/proc` file as text. Names in it (a comm, a mapped file's path) are the bytes a process
/// chose, not always UTF-8: those bytes read as U+FFFD rather than failing the whole read.
pub fn read_text(path: impl AsRef<std::path::Path>) -> io::Result<String> {
    fs::read(path).map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
}

/// `PF_KTHREAD` and `PF_EXITING` in the flags field of `/proc/PID/stat`.
const PF_KTHREAD: u64 = 0x0020_0000;
const PF_EXITING: u64 = 0x0000_0004;

/// One line of `/proc/PID/maps` that maps a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMapping {
    pub start: u64,
    pub end: u64,
    /// Offset in the file of `start`.
    pub offset: u64,
    pub path: String,
    /// Mapped with execute permission: code whose frames may be on a stack.
    pub executable: bool,
    /// The file's device (`major:minor`) and inode: they name it for as long as it is mapped.
    pub device: String,
    pub inode: u64,
}

/// What memprof needs from `/proc/PID/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub kernel_thread: bool,
    pub zombie: bool,
    /// In its exit, from its first step: its memory map may be going meanwhile.
    pub exiting: bool,
    /// Clock ticks after boot when the process started: with the pid, names one process for good.
    pub start_time: u64,
    /// CPU time used, user and system, in clock ticks.
    pub cpu_ticks: u64,
    /// The system part of `cpu_ticks`: the process's time in the kernel, where uprobe traps and
    /// the BPF programs they run are counted.
    pub system_ticks: u64,
    /// Its wait status once it has exited (a zombie's, until its parent reaps it); 0 before.
    pub wait_status: i32,
}

pub fn stat(pid: u32) -> Option<Stat> {
    let stat = task_stat(&format!("/proc/{pid}"))?;
    // A main thread that called pthread_exit is a zombie while its threads run on.
    Some(Stat { zombie: stat.zombie && live_thread(pid).is_none(), ..stat })
}

/// `pid`'s threads now and their names (`/proc/PID/task/TID/comm`), made printable.
pub fn thread_names(pid: u32) -> Vec<(u32, String)> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .filter_map(|task| {
            let task = task.ok()?;
            let tid = task.file_name().to_str()?.parse().ok()?;
            let name = fs::read_to_string(task.path().join("comm")).ok()?;
            Some((tid, printable(name.trim_end_matches('\n')).into_owned()))
        })
        .collect()
}

/// The processes `pid`'s threads have forked and not yet reaped (`/proc/PID/task/TID/children`).
pub fn children(pid: u32) -> io::Result<Vec<u32>> {
    let mut children = Vec::new();
    for task in fs::read_dir(format!("/proc/{pid}/task"))? {
        let list = read_text(task?.path().join("children"))?;
        children.extend(list.split_whitespace().filter_map(|child| child.parse::<u32>().ok()));
    }
    Ok(children)
}

/// `/proc/PID/stat` of the process or one of its threads, read from `dir`.
fn task_stat(dir: &str) -> Option<Stat> {
    let text = read_text(format!("{dir}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields resume after the last ')'.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    // Numbered as in proc(5): state is field 3, flags 9, starttime 22, exit_code 52.
    let field = |n: usize| fields.get(n - 3).copied();
    let flags: u64 = field(9)?.parse().ok()?;
    let system_ticks: u64 = field(15)?.parse().ok()?;
    Some(Stat {
        kernel_thread: flags & PF_KTHREAD != 0,
        zombie: matches!(field(3)?, "Z" | "X"),
        exiting: flags & PF_EXITING != 0,
        start_time: field(22)?.parse().ok()?,
        cpu_ticks: field(14)?.parse::<u64>().ok()? + system_ticks,
        system_ticks,
        wait_status: field(52).and_then(|status| status.parse().ok()).unwrap_or(0),
    })
}

/// Where to read what a process's threads share (memory map, executable, root, environment):
/// `/proc/PID`, unless its main thread has exited (pthread_exit) while others run. Such a
/// leader keeps the pid, but its maps, exe and root read empty; a live thread's directory reads
/// them.
pub(crate) fn dir(pid: u32) -> String {
    let leader = format!("/proc/{pid}");
    // A running leader's exe link reads: one syscall, where its stat takes three and a format
    // (this is asked for every read, for every target, every interval).
    if fs::read_link(format!("{leader}/exe")).is_ok() || !task_stat(&leader).is_some_and(|stat| stat.zombie) {
        return leader;
    }
    live_thread(pid).map_or(leader, |tid| format!("/proc/{pid}/task/{tid}"))
}

/// Whether the main thread of `pid` has exited (pthread_exit) while other threads run on.
pub fn leader_exited(pid: u32) -> bool {
    task_stat(&format!("/proc/{pid}")).is_some_and(|stat| stat.zombie) && live_thread(pid).is_some()
}

/// A thread of `pid` other than its exited main thread that has not exited.
/// The id through which `pid`'s memory is read (`process_vm_readv`): `pid`, unless its main
/// thread has exited (pthread_exit) while others run, which left it no memory to read.
pub fn memory_task(pid: u32) -> u32 {
    if leader_exited(pid) {
        live_thread(pid).unwrap_or(pid)
    } else {
        pid
    }
}

/// Whether thread `tid` of `pid` has exited and waits to be reaped with its process (a main
/// thread that called pthread_exit): it has no registers or stack left to stop.
pub fn thread_ended(pid: u32, tid: u32) -> bool {
    task_stat(&format!("/proc/{pid}/task/{tid}")).is_some_and(|stat| stat.zombie)
}

/// A thread of `pid` other than `except` that stays (see `thread_stays`), in the order the
/// kernel lists them, oldest first.
pub fn staying_thread(pid: u32, except: u32) -> Option<u32> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks
        .filter_map(|task| task.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|&tid| tid != except && thread_stays(pid, tid))
}

/// Whether thread `tid` of `pid` is not on its way out: not exited, not exiting, and without a
/// SIGKILL pending. When a whole process goes (`exit_group`, a fatal signal, an exec by another
/// thread) the kernel gives each of its other threads a SIGKILL before the first exits; a thread
/// that exits alone (`pthread_exit`) leaves the others staying.
pub fn thread_stays(pid: u32, tid: u32) -> bool {
    let dir = format!("/proc/{pid}/task/{tid}");
    task_stat(&dir).is_some_and(|stat| !stat.zombie && !stat.exiting)
        && read_text(format!("{dir}/status")).is_ok_and(|status| !kill_pending(&status))
}

/// Whether a thread's `status` shows a SIGKILL pending, for the thread or its process.
fn kill_pending(status: &str) -> bool {
    const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);
    status
        .lines()
        .filter_map(|line| line.strip_prefix("SigPnd:").or_else(|| line.strip_prefix("ShdPnd:")))
        .any(|mask| u64::from_str_radix(mask.trim(), 16).is_ok_and(|mask| mask & SIGKILL_BIT != 0))
}

fn live_thread(pid: u32) -> Option<u32> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks
        .filter_map(|task| task.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|&tid| tid != pid && task_stat(&format!("/proc/{pid}/task/{tid}")).is_some_and(|stat| !stat.zombie))
}

/// Resident memory of the process, in bytes.
pub fn resident_bytes(pid: u32) -> u64 {
    statm_pages(pid).map_or(0, |(resident, _)| resident * page_size())
}

/// Anonymous resident memory of the process (`RssAnon` in `/proc/PID/status`), in bytes; none
/// once it has exited. Read from `statm`, whose second field is every resident page and third
/// the file and shmem ones (the kernel's `task_statm`): their difference is `RssAnon`, from a
/// file the kernel formats in a fraction of `status`'s time (read for every target, twice an
/// interval).
pub fn anon_resident_bytes(pid: u32) -> Option<u64> {
    statm_pages(pid).map(|(resident, shared)| resident.saturating_sub(shared) * page_size())
}

/// `statm`'s resident and shared (file and shmem) page counts; none without memory: a process
/// that has exited and not been reaped yet reads all zeros.
fn statm_pages(pid: u32) -> Option<(u64, u64)> {
    let statm = read_text(format!("{}/statm", dir(pid))).ok()?;
    let mut fields = statm.split_whitespace().map(|field| field.parse::<u64>().ok());
    if fields.next()?? == 0 {
        return None;
    }
    Some((fields.next()??, fields.next()??))
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as u64 }
}

/// Whether the process's environment (`/proc/PID/environ`) holds `entry` (`NAME=value`).
pub fn has_env(pid: u32, entry: &str) -> bool {
    entry.split_once('=').is_some_and(|(name, value)| env(pid, name).as_deref() == Some(value))
}

/// The unit of `Stat::start_time`, `Stat::cpu_ticks` and `Stat::system_ticks`.
pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}

/// Seconds since boot, the clock `Stat::start_time` counts on.
pub fn seconds_since_boot() -> f64 {
    let uptime = read_text("/proc/uptime").unwrap_or_default();
    uptime.split_whitespace().next().and_then(|s| s.parse().ok()).unwrap_or(0.0)
}

/// Fails unless `pid` is a live user-space process.
pub fn check_traceable(pid: u32) -> Result<(), UserError> {
    match stat(pid) {
        None => Err(UserError::NoSuchProcess(pid)),
        Some(s) if s.kernel_thread => Err(UserError::KernelThread(pid)),
        Some(s) if s.zombie => Err(UserError::Zombie(pid)),
        Some(_) => match thread_group(pid) {
            // /proc answers for a thread's id too, but its probes would go to the whole process.
            Some(process) if process != pid => Err(UserError::Thread { thread: pid, process }),
            _ => Ok(()),
        },
    }
}

/// The process `pid` is a thread of (itself for a process): `Tgid` in `/proc/PID/status`.
fn thread_group(pid: u32) -> Option<u32> {
    let status = read_text(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("Tgid:"))?.trim().parse().ok()
}

/// Every pid in /proc.
pub fn pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// The process's cgroup paths, one per hierarchy (one on a cgroup v2 system), such as
/// `/system.slice/nginx.service`.
pub fn cgroups(pid: u32) -> Vec<String> {
    let text = read_text(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    // Lines read `hierarchy-id:controllers:path`.
    text.lines().filter_map(|line| line.splitn(3, ':').nth(2)).map(str::to_string).collect()
}

/// The process's cgroup in the unified (v2) hierarchy, such as `/system.slice/nginx.service` or a
/// container's `/kubepods.slice/.../cri-containerd-ID.scope`: the `0::PATH` line of
/// `/proc/PID/cgroup`. `None` once the process is gone, or on a host without that hierarchy.
pub fn cgroup(pid: u32) -> Option<String> {
    let text = read_text(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|line| line.strip_prefix("0::")).map(str::to_string)
}

/// Where the cgroup hierarchies are mounted: the unified one (`cgroup2`: `/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid host) or the v1 ones (`cgroup`).
pub fn cgroup_mounts(fs_type: &str) -> Vec<PathBuf> {
    let mounts = read_text("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(2) == Some(&fs_type)).then(|| PathBuf::from(fields[1]))
        })
        .collect()
}

/// A cgroup given as a directory under a cgroup mount (`/sys/fs/cgroup/system.slice`, or
/// `/sys/fs/cgroup/unified/x` on a hybrid system) as the path processes see (`/system.slice`).
/// A path that is under no cgroup mount is taken to be such a path already.
pub fn cgroup_path(dir: &str) -> String {
    let mounts = [cgroup_mounts("cgroup"), cgroup_mounts("cgroup2")].concat();
    let mount = mounts
        .iter()
        .filter_map(|mount| mount.to_str())
        .filter(|mount| dir.strip_prefix(mount).is_some_and(|rest| rest.is_empty() || rest.starts_with('/')))
        .max_by_key(|mount| mount.len());
    let path = mount.map_or(dir, |mount| &dir[mount.len()..]).trim_end_matches('/');
    format!("/{}", path.trim_start_matches('/'))
}

/// The process's command name, safe to print (any process names itself as it likes).
pub fn comm(pid: u32) -> Option<String> {
    fs::read(format!("/proc/{pid}/comm")).ok().map(|bytes| comm_text(&bytes))
}

/// A command name's bytes as `comm` gives them, so that a name known otherwise (the one an exec
/// gave) meets the rules as `/proc` would have said it.
pub fn comm_text(bytes: &[u8]) -> String {
    printable(String::from_utf8_lossy(bytes).trim_end_matches('\n')).into_owned()
}

/// The user who started the process: the real uid of `/proc/PID/status`'s `Uid:` line (a
/// set-user-ID program run by a user counts as that user's).
pub fn real_uid(pid: u32) -> Option<u32> {
    parse_real_uid(&read_text(format!("/proc/{pid}/status")).ok()?)
}

fn parse_real_uid(status: &str) -> Option<u32> {
    status.lines().find_map(|line| line.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()
}

/// The process's pid in its own pid namespace, when that is not memprof's (a container's process):
/// the last entry of `NSpid` in `/proc/PID/status`, whose first entry is the pid memprof sees.
pub fn ns_pid(pid: u32) -> Option<u32> {
    parse_ns_pid(&read_text(format!("/proc/{pid}/status")).ok()?)
}

fn parse_ns_pid(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|line| line.strip_prefix("NSpid:"))?;
    let pids: Vec<u32> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
    match pids.as_slice() {
        [own, .., innermost] if own != innermost => Some(*innermost),
        _ => None,
    }
}

/// The executable's path as the process sees it, by the name it was started as (see
/// `launch_name`).
pub fn exe_path(pid: u32) -> Option<String> {
    let exe = fs::read_link(format!("{}/exe", dir(pid))).ok()?.to_string_lossy().into_owned();
    Some(launch_name(pid, &exe).unwrap_or(exe))
}

/// Every file-backed mapping of the process, in address order; the executable's by the name it
/// was started as (see `launch_name`). None, as for a process gone, when it began to exit by the
/// end of the read: `maps` is read a page at a time, and a read its exit overtakes ends early, a
/// few mappings long (its executable's first, without its code).
pub fn file_mappings(pid: u32) -> io::Result<Vec<FileMapping>> {
    file_mappings_and_code(pid).map(|(mappings, _)| mappings)
}

/// `file_mappings`, and from the same read the ranges of every executable mapping, a JIT's
/// anonymous ones too (see `executable_ranges`).
pub fn file_mappings_and_code(pid: u32) -> io::Result<(Vec<FileMapping>, Vec<Range<u64>>)> {
    let dir = dir(pid);
    let text = read_text(format!("{dir}/maps"))?;
    let mut mappings = parse_maps(&text);
    if task_stat(&dir).is_none_or(|stat| stat.zombie || stat.exiting) {
        return Ok((Vec::new(), Vec::new()));
    }
    // Files on a user's FUSE mount, or on one that does not answer, are left alone (see
    // `mounts`). Such a file system's device has major number 0, as few others have: mounts are
    // read only for those.
    let fuse_like = mappings.iter().any(|m| mounts::maps_device(&m.device).is_some_and(|(major, _)| major == 0));
    let risky = if fuse_like { mounts::risky_mounts(pid).unwrap_or_default() } else { Vec::new() };
    if !risky.is_empty() {
        leave_held_alone(pid, &risky, &mut mappings);
    }
    let exe = fs::read_link(format!("{dir}/exe")).ok().map(|p| p.to_string_lossy().into_owned());
    if let Some((exe, name)) = exe.and_then(|exe| launch_name(pid, &exe).map(|name| (exe, name))) {
        for mapping in mappings.iter_mut().filter(|m| m.path == exe) {
            mapping.path = name.clone();
        }
    }
    Ok((mappings, code_ranges(&text)))
}

/// Takes out of `mappings` those on `pid`'s `risky` mounts that memprof may not look at (each
/// mount asked once), and says which.
fn leave_held_alone(pid: u32, risky: &[mounts::RiskyMount], mappings: &mut Vec<FileMapping>) {
    let mut held: HashMap<(u64, u64), Option<mounts::Risk>> = HashMap::new();
    for mapping in mappings.iter() {
        let Some(device) = mounts::maps_device(&mapping.device) else { continue };
        held.entry(device).or_insert_with(|| {
            let mount = risky.iter().find(|mount| mount.device == device)?;
            let probe = &mapping.reachable_paths(pid)[0];
            (!mount.may_look_at(Path::new(probe))).then_some(mount.risk)
        });
    }
    let risk_of =
        |m: &FileMapping| mounts::maps_device(&m.device).and_then(|device| held.get(&device).copied().flatten());
    for risk in [mounts::Risk::UsersFuse, mounts::Risk::MayNotAnswer] {
        let mut left: Vec<&str> =
            mappings.iter().filter(|m| risk_of(m) == Some(risk)).map(|m| m.path.as_str()).collect();
        left.dedup();
        if !left.is_empty() {
            mounts::say_left_alone(pid, risk, &left);
        }
    }
    mappings.retain(|m| risk_of(m).is_none());
}

/// The path the process was started as, when it is a link to its executable `exe` under another
/// name: Debian's `/usr/bin/redis-server` is a link to `redis-check-rdb`, which the kernel
/// reports, but users know the program by the name they ran. `None` when the names agree or
/// `argv[0]` does not lead to `exe`.
fn launch_name(pid: u32, exe: &str) -> Option<String> {
    let dir = dir(pid);
    let cmdline = fs::read(format!("{dir}/cmdline")).ok()?;
    let argv0 = String::from_utf8_lossy(cmdline.split(|&b| b == 0).next()?).into_owned();
    // A process that retitles itself (redis, postgres) writes its title over argv: the program's
    // name stays in front, followed by a space.
    let candidates = [argv0.as_str(), argv0.split(' ').next().unwrap_or_default()];
    let base = |path: &str| path.rsplit('/').next().unwrap_or_default().to_string();
    // A name is found by its file name: the executable's leaves nothing to find.
    if candidates.iter().all(|name| name.is_empty() || base(name) == base(exe)) {
        return None;
    }
    // The paths tried are the process's choice (its `argv[0]`, its `PATH`), and a link on the way
    // may lead anywhere: none is looked at while the process sees a user's FUSE mount, nor on a
    // mount that does not answer (see `mounts`), nor when its mounts cannot be read.
    let risky = mounts::risky_mounts(pid).ok().filter(|risky| !mounts::has_users_fuse(risky))?;
    let root = format!("{dir}/root");
    let target = fs::metadata(format!("{dir}/exe")).ok()?;
    let same_file = |path: &str| {
        let found = format!("{root}{path}");
        mounts::may_look(&risky, Path::new(path), Path::new(&found))
            && fs::metadata(&found).is_ok_and(|found| (found.dev(), found.ino()) == (target.dev(), target.ino()))
    };
    let found = candidates.iter().filter(|name| !name.is_empty()).find_map(|name| {
        if name.contains('/') {
            let cwd = fs::read_link(format!("{dir}/cwd")).ok()?;
            let path = if name.starts_with('/') { name.to_string() } else { format!("{}/{name}", cwd.display()) };
            same_file(&path).then_some(path)
        } else {
            let search = env(pid, "PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".to_string());
            search.split(':').map(|dir| format!("{dir}/{name}")).find(|path| same_file(path))
        }
    })?;
    (base(&found) != base(exe)).then_some(found)
}

/// The value of `name` in the process's environment.
fn env(pid: u32, name: &str) -> Option<String> {
    let environ = fs::read(format!("{}/environ", dir(pid))).ok()?;
    let prefix = format!("{name}=");
    environ
        .split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// Why `pid`'s mappings could not be read: it is gone, or they are refused to memprof.
pub fn maps_error(pid: u32, cause: io::Error) -> UserError {
    match cause.kind() {
        io::ErrorKind::PermissionDenied => UserError::MapsUnreadable { pid, cause },
        _ => UserError::NoSuchProcess(pid),
    }
}

/// The first mapping of each distinct file the process maps.
pub fn mapped_files(pid: u32) -> Result<Vec<FileMapping>, UserError> {
    let mappings = file_mappings(pid).map_err(|err| maps_error(pid, err))?;
    let mut files: Vec<FileMapping> = Vec::new();
    for mapping in mappings {
        if !files.iter().any(|f| f.path == mapping.path) {
            files.push(mapping);
        }
    }
    Ok(files)
}

impl FileMapping {
    /// Paths that reach the mapped file from memprof's mount namespace, best first.
    ///
    /// `/proc/PID/maps` names files as the process's root and mount namespace see them (or, for
    /// a chroot in our namespace, as ours do), so the path alone may lead elsewhere. The
    /// `map_files` link always reaches the very inode mapped; the path under `/proc/PID/root` is
    /// the fallback for kernels that restrict `map_files`.
    pub fn reachable_paths(&self, pid: u32) -> [String; 2] {
        [format!("/proc/{pid}/map_files/{:x}-{:x}", self.start, self.end), format!("{}/root{}", dir(pid), self.path)]
    }

    /// Opens the mapped file: by its `map_files` link, else by a path that names the very file
    /// mapped (same device and inode): under `/proc/PID/root`, or, once the process is gone (a
    /// short-lived command that exited before memprof read its files), the path itself. Those
    /// paths are the process's to change: it may have put a FIFO, a device or another file
    /// there since it mapped the file (`Opened::is_mapped` says what matches on overlayfs).
    ///
    /// The path itself is looked up in memprof's mounts only where those allow (a process in a
    /// container does not see the host's mount that may hold that path).
    pub fn open(&self, pid: u32) -> Option<fs::File> {
        let [map_files, under_root] = self.reachable_paths(pid);
        if let Ok(file) = open_regular(Path::new(&map_files)) {
            return Some(file);
        }
        if let Some(file) = self.open_same(Path::new(&under_root)) {
            return Some(file);
        }
        let path = Path::new(&self.path);
        mounts::MemprofsView::read().may_look(path).then(|| self.open_same(path)).flatten()
    }

    /// The file, as its maps line names it.
    pub fn id(&self) -> Option<FileId> {
        FileId::of_maps_fields(&self.device, self.inode)
    }

    /// `path`, opened if it names the file mapped (see `open`).
    fn open_same(&self, path: &Path) -> Option<fs::File> {
        let opened = Opened::open(path).ok()?;
        opened.is_mapped(self.id()?).then(|| opened.into_file())
    }
}

/// Opens `path` for reading when it names a regular file. Paths a traced process names (its
/// files, once it is gone; its dynamic linker's list) may by then name a FIFO, whose open would
/// wait for a writer: the open does not wait.
pub fn open_regular(path: &Path) -> io::Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
    }
    Ok(file)
}

fn parse_maps(text: &str) -> Vec<FileMapping> {
    text.lines().filter_map(parse_maps_line).collect()
}

/// The fields of one line of `/proc/PID/maps`.
struct MapsLine<'a> {
    start: u64,
    end: u64,
    perms: &'a [u8],
    offset: &'a str,
    device: &'a str,
    inode: &'a str,
    path: &'a str,
}

fn split_maps_line(line: &str) -> Option<MapsLine<'_>> {
    // address perms offset dev inode path (path absent for most anonymous mappings)
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    Some(MapsLine {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        perms: fields.next()?.as_bytes(),
        offset: fields.next()?,
        device: fields.next()?,
        inode: fields.next()?,
        path: fields.next().unwrap_or_default().trim_start(),
    })
}

fn parse_maps_line(line: &str) -> Option<FileMapping> {
    let fields = split_maps_line(line)?;
    if fields.inode == "0" || !fields.path.starts_with('/') {
        return None;
    }
    Some(FileMapping {
        start: fields.start,
        end: fields.end,
        offset: u64::from_str_radix(fields.offset, 16).ok()?,
        // A file replaced on disk keeps running from the old inode.
        path: fields.path.trim_end_matches(" (deleted)").to_string(),
        executable: fields.perms.get(2) == Some(&b'x'),
        device: fields.device.to_string(),
        inode: fields.inode.parse().ok()?,
    })
}

/// One mapping of any kind, file-backed or anonymous: what `memprof --inspect` scans for roots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub start: u64,
    pub end: u64,
    /// Readable and writable: where a program can keep a pointer.
    pub writable: bool,
    /// Shared (`MAP_SHARED`): others may write its pages without the process touching them.
    pub shared: bool,
    /// The file, `[stack]`, `[heap]` or empty for anonymous memory.
    pub path: String,
}

/// The address ranges of the process's executable mappings, a file's or not (a JIT's code).
pub fn executable_ranges(pid: u32) -> io::Result<Vec<Range<u64>>> {
    Ok(code_ranges(&read_text(format!("{}/maps", dir(pid)))?))
}

/// The executable mappings' ranges in `maps`, the text of `/proc/PID/maps`.
fn code_ranges(maps: &str) -> Vec<Range<u64>> {
    maps.lines().filter_map(split_maps_line).filter(|l| l.perms.get(2) == Some(&b'x')).map(|l| l.start..l.end).collect()
}

/// Every mapping of the process, in address order.
pub fn regions(pid: u32) -> io::Result<Vec<Region>> {
    let text = read_text(format!("{}/maps", dir(pid)))?;
    Ok(text
        .lines()
        .filter_map(split_maps_line)
        .map(|line| Region {
            start: line.start,
            end: line.end,
            writable: line.perms.starts_with(b"rw"),
            shared: line.perms.get(3) == Some(&b's'),
            path: line.path.to_string(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_file_mappings_and_skips_anonymous_ones() {
        let maps = "\
55d0c8a00000-55d0c8a01000 r--p 00000000 fe:01 1234   /usr/bin/leaky
55d0c8a01000-55d0c8a02000 r-xp 00001000 fe:01 1234   /usr/bin/leaky
55d0c9000000-55d0c9021000 rw-p 00000000 00:00 0      [heap]
7f00000000-7f00001000 rw-p 00000000 00:00 0
7f1000000000-7f1000100000 r-xp 00028000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6 (deleted)
";
        let parsed = parse_maps(maps);
        assert_eq!(parsed.len(), 3);
        assert_eq!(
            parsed[1],
            FileMapping {
                start: 0x55d0c8a01000,
                end: 0x55d0c8a02000,
                offset: 0x1000,
                path: "/usr/bin/leaky".into(),
                executable: true,
                device: "fe:01".into(),
                inode: 1234,
            }
        );
        assert_eq!(parsed[2].path, "/usr/lib/x86_64-linux-gnu/libc.so.6");
        assert!(!parsed[0].executable && parsed[2].executable);
    }

    /// The file a process mapped, its path since replaced by a FIFO, then by another file: the
    /// open neither waits for a FIFO's writer nor takes the other file for the one mapped.
    #[test]
    fn a_mapped_files_path_replaced_since_is_not_opened() {
        use std::os::unix::fs::MetadataExt as _;
        let dir = std::env::temp_dir().join(format!("memprof-procfs-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lib.so");
        fs::write(&path, b"mapped").unwrap();
        let meta = fs::metadata(&path).unwrap();
        let mapping = FileMapping {
            // No such mapping: its map_files link does not resolve.
            start: 0x1000,
            end: 0x2000,
            offset: 0,
            path: path.to_str().unwrap().to_string(),
            executable: true,
            device: format!("{:02x}:{:02x}", libc::major(meta.dev()), libc::minor(meta.dev())),
            inode: meta.ino(),
        };
        let pid = std::process::id();
        assert!(mapping.open(pid).is_some());
        let renamed = dir.join("renamed.so");
        fs::rename(&path, &renamed).unwrap();
        let fifo = std::ffi::CString::new(mapping.path.as_str()).unwrap();
        // SAFETY: a path of ours, NUL-terminated.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(mapping.open(pid).is_none());
        fs::remove_file(&path).unwrap();
        fs::write(&path, b"another file").unwrap();
        assert!(mapping.open(pid).is_none());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_namespace_pid_is_the_innermost_when_it_differs() {
        assert_eq!(parse_ns_pid("Name:\tsh\nNSpid:\t4321\t17\t1\nNSsid:\t1\n"), Some(1));
        assert_eq!(parse_ns_pid("NSpid:\t4321\n"), None);
        assert_eq!(parse_ns_pid("Name:\tsh\n"), None);
        assert_eq!(ns_pid(std::process::id()), None, "the tests run in memprof's own namespace");
    }

    #[test]
    fn the_real_uid_is_the_first_of_the_uid_line() {
        assert_eq!(parse_real_uid("Name:\tpasswd\nUid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n"), Some(1000));
        assert_eq!(parse_real_uid("Name:\tsh\n"), None);
        // SAFETY: getuid has no arguments and cannot fail.
        assert_eq!(real_uid(std::process::id()), Some(unsafe { libc::getuid() }));
    }

    #[test]
    fn cgroup_directories_become_cgroup_paths() {
        assert_eq!(cgroup_path("/system.slice/"), "/system.slice");
        assert_eq!(cgroup_path("/"), "/");
        let mounts = read_text("/proc/self/mounts").unwrap();
        if let Some(mount) = mounts.lines().find(|l| l.split_whitespace().nth(2) == Some("cgroup2")) {
            let mount = mount.split_whitespace().nth(1).unwrap();
            assert_eq!(cgroup_path(&format!("{mount}/a.slice/b")), "/a.slice/b");
            assert_eq!(cgroup_path(mount), "/");
        }
    }

    #[test]
    fn kernel_threads_a_processs_threads_and_missing_pids_are_refused() {
        assert!(matches!(check_traceable(2), Err(UserError::KernelThread(2))));
        let own = stat(std::process::id()).unwrap();
        assert!(!own.kernel_thread && !own.zombie && own.start_time > 0 && own.system_ticks <= own.cpu_ticks);
        assert!(resident_bytes(std::process::id()) > 0);
        // statm's difference is status's RssAnon (read apart, so a few pages may move between).
        let status = read_text("/proc/self/status").unwrap();
        let rss_anon = status.lines().find_map(|l| l.strip_prefix("RssAnon:")).unwrap();
        let rss_anon = rss_anon.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024;
        assert!(anon_resident_bytes(std::process::id()).unwrap().abs_diff(rss_anon) < 1 << 20);
        let age = seconds_since_boot() - own.start_time as f64 / clock_ticks_per_second();
        assert!((0.0..600.0).contains(&age), "the test started {age} s ago");
        assert!(pids().contains(&std::process::id()));
        assert!(cgroups(std::process::id()).iter().all(|c| c.starts_with('/')));
        assert!(matches!(check_traceable(u32::MAX - 1), Err(UserError::NoSuchProcess(_))));
        check_traceable(std::process::id()).unwrap();
        let (ids, stop) = std::sync::mpsc::channel();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let running = std::thread::spawn(move || {
            // SAFETY: gettid takes nothing and cannot fail.
            ids.send(unsafe { libc::gettid() } as u32).unwrap();
            wait.recv().ok();
        });
        let tid = stop.recv().unwrap();
        let process = std::process::id();
        assert!(
            matches!(check_traceable(tid), Err(UserError::Thread { thread, process: p }) if thread == tid && p == process)
        );
        release.send(()).unwrap();
        running.join().unwrap();
    }

    /// An exited process not reaped yet has no memory: its statm reads all zeros, which is not
    /// "nothing resident".
    #[test]
    fn a_zombie_has_no_resident_memory_to_read() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let zombie = (0..1000).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            stat(pid).is_some_and(|stat| stat.zombie)
        });
        assert!(zombie, "pid {pid} did not exit");
        assert_eq!((anon_resident_bytes(pid), resident_bytes(pid)), (None, 0));
        child.wait().unwrap();
    }

    #[test]
    fn maps_refused_are_not_a_missing_process() {
        let refused = maps_error(1, io::Error::from_raw_os_error(libc::EACCES)).to_string();
        assert!(
            refused.starts_with("cannot read /proc/1/maps: Permission denied (os error 13) (the kernel shows"),
            "{refused}"
        );
        assert!(refused.ends_with("memprof cannot trace it"), "{refused}");
        let gone = maps_error(1, io::Error::from_raw_os_error(libc::ENOENT));
        assert!(matches!(gone, UserError::NoSuchProcess(1)));
    }
}
