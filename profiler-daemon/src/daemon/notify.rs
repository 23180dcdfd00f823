//! systemd's readiness protocol (`Type=notify`): the daemon says when it serves, reloads and
//! stops. `systemctl start` then returns once the programs are loaded and the listener is up,
//! or fails with the daemon's error; a `systemctl reload` right after start waits for that,
//! instead of sending a SIGHUP the process has no handler for yet, which would end it.
//! Without `$NOTIFY_SOCKET` (not started by systemd) nothing is sent.

use std::{
    ffi::OsString,
    os::{
        linux::net::SocketAddrExt as _,
        unix::{
            ffi::OsStrExt as _,
            net::{SocketAddr, UnixDatagram},
        },
    },
};

use tracing::warn;

/// Serving, after start or a reload.
pub fn ready() {
    send("READY=1");
}

/// Reloading the config (systemd then waits for `ready`).
pub fn reloading() {
    send(&format!("RELOADING=1\nMONOTONIC_USEC={}", crate::kernel::aggregate::monotonic_now_ns() / 1000));
}

/// Detaching every probe before it exits.
pub fn stopping() {
    send("STOPPING=1");
}

fn send(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    if let Err(err) = try_send(&path, state) {
        warn!("cannot tell systemd {state:?} on {}: {err}", path.to_string_lossy());
    }
}

fn try_send(path: &OsString, state: &str) -> std::io::Result<()> {
    // `@name` is a socket in the abstract namespace.
    let address = match path.as_bytes().strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(path)?,
    };
    UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &address)?;
    Ok(())
}
