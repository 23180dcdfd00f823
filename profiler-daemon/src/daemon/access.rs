//! Who may ask what (the config's `[access]` table). What Prometheus needs (`/metrics`, health) is
//! served to anyone the listener reaches. Everything that names a process's code or data (stacks,
//! reports, profiles, targets) or acts on it (inspect) needs either a user and password of the web
//! config, or a connection to the daemon's Unix socket from root or a member of `group`, as the
//! kernel recorded it when the connection was made (`peer`): loopback is not private on a shared
//! host, and a header can be forged.

use std::path::PathBuf;

use serde::Deserialize;

use crate::{
    cli,
    peer::{self, Credentials},
};

/// Where the API's socket is unless told: in the directory systemd makes for the unit
/// (`RuntimeDirectory=memprof`), which only root may make; where `inspect` and `snapshot` ask.
pub const DEFAULT_SOCKET: &str = cli::DAEMON_SOCKET;

/// The `[access]` table of the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettingsFile {
    socket: Option<PathBuf>,
    group: Option<String>,
    inspect: Option<bool>,
}

/// Who may ask what, fixed when the daemon starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The Unix socket serving the whole API to root and `group`; None: none.
    pub socket: Option<PathBuf>,
    /// A group whose members the socket serves as it serves root.
    pub group: Option<u32>,
    /// Whether `/api/v1/inspect` may stop a process (to those allowed the rest).
    pub inspect: bool,
}

impl Settings {
    /// The file's settings over the defaults; `socket_flag` overrides the file's socket, and an
    /// empty path means no socket.
    pub fn new(file: Option<SettingsFile>, socket_flag: Option<PathBuf>) -> Result<Self, (&'static str, String)> {
        let file = file.unwrap_or_default();
        let socket = socket_flag.or(file.socket).unwrap_or_else(|| DEFAULT_SOCKET.into());
        if !socket.as_os_str().is_empty() && !socket.is_absolute() {
            return Err((
                "access.socket",
                format!("{} is not an absolute path; give one such as {DEFAULT_SOCKET}", socket.display()),
            ));
        }
        let group = match file.group {
            Some(name) => Some(peer::group_id(&name).ok_or((
                "access.group",
                format!("no group `{name}` on this host; create it (groupadd {name}) or name another"),
            ))?),
            None => None,
        };
        Ok(Self {
            socket: (!socket.as_os_str().is_empty()).then_some(socket),
            group,
            inspect: file.inspect.unwrap_or(true),
        })
    }

    /// Whether a connection to the socket from `peer` may ask anything, as one with a password may.
    pub fn trusts(&self, peer: &Credentials) -> bool {
        peer.uid == 0 || self.group.is_some_and(|group| peer.groups.contains(&group))
    }
}

/// The paths served to anyone the listener reaches: the metrics (counts by process, and the
/// labelled stack hashes and allocation sites of the top stacks, which Prometheus stores) and health.
pub fn is_public(path: &str) -> bool {
    matches!(path, "/metrics" | "/-/healthy" | "/-/ready")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_the_group_are_trusted_by_the_kernels_word() {
        let settings =
            Settings::new(Some(SettingsFile { group: Some("4242".into()), ..Default::default() }), None).unwrap();
        assert_eq!(settings.socket.as_deref(), Some(std::path::Path::new(DEFAULT_SOCKET)));
        assert!(settings.inspect);
        let peer = |uid, groups: &[u32]| Credentials { uid, groups: groups.to_vec() };
        assert!(settings.trusts(&peer(0, &[0])));
        assert!(settings.trusts(&peer(1000, &[1000, 4242])));
        assert!(!settings.trusts(&peer(65534, &[65534])));
        let no_group = Settings::new(None, None).unwrap();
        assert!(!no_group.trusts(&peer(1000, &[1000, 4242])));
    }

    #[test]
    fn settings_are_checked() {
        let none = Settings::new(None, Some(PathBuf::new())).unwrap();
        assert_eq!(none.socket, None);
        let err = Settings::new(None, Some("api.sock".into())).unwrap_err();
        assert_eq!(err.0, "access.socket");
        let file = SettingsFile { group: Some("no-such-group-memprof".into()), ..Default::default() };
        let err = Settings::new(Some(file), None).unwrap_err();
        assert!(err.1.contains("groupadd no-such-group-memprof"), "{}", err.1);
    }

    #[test]
    fn only_what_prometheus_needs_is_public() {
        for path in ["/metrics", "/-/healthy", "/-/ready"] {
            assert!(is_public(path), "{path}");
        }
        for path in ["/", "/api/v1/targets", "/api/v1/leaks", "/api/v1/inspect", "/report", "/debug/pprof/heap", "/x"] {
            assert!(!is_public(path), "{path}");
        }
    }
}
