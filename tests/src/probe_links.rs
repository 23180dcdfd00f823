//! The BPF links processes hold, and those that probe a process, found in every process's
//! `/proc/PID/fdinfo`: the kernel describes each link a descriptor holds there, with more than
//! Debian's bpftool 7.1 shows (it names a uprobe_multi link only "type 12", without its pid or
//! path).

use std::fs;

/// One BPF link probing a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeLink {
    /// The process holding the link.
    pub holder: u32,
    /// A uprobe_multi link; else a perf-event uprobe.
    pub multi: bool,
    /// Its probes fire at functions' return.
    pub at_return: bool,
    /// How many probes the link attaches.
    pub probes: usize,
}

/// The links, held by any process, whose probes fire in process `target`: uprobe_multi links
/// naming its pid, and perf-event uprobes on a file reached through its `/proc/PID/` (as memprof
/// attaches to a running process's files).
pub fn probing(target: u32) -> Vec<ProbeLink> {
    all().into_iter().filter(|(_, probed)| *probed == target).map(|(link, _)| link).collect()
}

/// The links `holder` shares among every process that maps a file (pid 0): the daemon's.
pub fn shared(holder: u32) -> Vec<ProbeLink> {
    all().into_iter().filter(|(link, probed)| *probed == 0 && link.holder == holder).map(|(link, _)| link).collect()
}

/// Every uprobe link held by any process, with the pid it probes (0 for every process).
pub fn all() -> Vec<(ProbeLink, u32)> {
    let Ok(processes) = fs::read_dir("/proc") else { return Vec::new() };
    processes
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .flat_map(|holder| descriptions(holder).into_iter().filter_map(move |info| parse(holder, &info)))
        .collect()
}

/// The fdinfo of each BPF link process `holder` holds.
pub fn descriptions(holder: u32) -> Vec<String> {
    held(holder).into_iter().map(|(_, info)| info).collect()
}

/// The descriptors by which `holder` holds links probing process `target`.
pub fn descriptors(holder: u32, target: u32) -> Vec<u32> {
    held(holder)
        .into_iter()
        .filter(|(_, info)| parse(holder, info).is_some_and(|(_, probed)| probed == target))
        .map(|(fd, _)| fd)
        .collect()
}

/// Each BPF link process `holder` holds: its descriptor and fdinfo.
fn held(holder: u32) -> Vec<(u32, String)> {
    let Ok(fds) = fs::read_dir(format!("/proc/{holder}/fd")) else { return Vec::new() };
    fds.flatten()
        .filter(|fd| fs::read_link(fd.path()).is_ok_and(|file| file.as_os_str() == "anon_inode:bpf_link"))
        .filter_map(|fd| {
            let fd: u32 = fd.file_name().to_str()?.parse().ok()?;
            Some((fd, fs::read_to_string(format!("/proc/{holder}/fdinfo/{fd}")).ok()?))
        })
        .collect()
}

/// Field `name` of a link's fdinfo `info`; empty if it has none.
pub fn field<'a>(info: &'a str, name: &str) -> &'a str {
    info.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':')).map(str::trim).unwrap_or("")
}

/// A uprobe link's description in fdinfo, and the pid it probes.
fn parse(holder: u32, info: &str) -> Option<(ProbeLink, u32)> {
    let field = |name: &str| field(info, name);
    match field("link_type") {
        kind @ ("uprobe_multi" | "uretprobe_multi") => {
            let link = ProbeLink {
                holder,
                multi: true,
                at_return: kind == "uretprobe_multi",
                probes: field("uprobe_cnt").parse().ok()?,
            };
            Some((link, field("pid").parse().ok()?))
        }
        "perf" => {
            let at_return = match field("event_type") {
                "uprobe" => false,
                "uretprobe" => true,
                _ => return None,
            };
            let probed = field("name").strip_prefix("/proc/")?.split('/').next()?.parse().ok()?;
            Some((ProbeLink { holder, multi: false, at_return, probes: 1 }, probed))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_of_both_kinds_of_link_is_read() {
        let multi = "link_type:\turetprobe_multi\nlink_id:\t9\nuprobe_cnt:\t8\npid:\t1029\npath:\t/usr/lib/libc.so.6\n";
        assert_eq!(parse(7, multi), Some((ProbeLink { holder: 7, multi: true, at_return: true, probes: 8 }, 1029)));
        let perf = "link_type:\tperf\nname:\t/proc/1821/map_files/7f9a-7f9b\noffset:\t0x98930\nevent_type:\tuprobe\n";
        assert_eq!(parse(7, perf), Some((ProbeLink { holder: 7, multi: false, at_return: false, probes: 1 }, 1821)));
        assert_eq!(parse(7, "link_type:\ttracing\n"), None);
    }
}
