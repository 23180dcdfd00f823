//! The tracer thread's sleep: it wakes for a command, for a record in one of the kernel's rings
//! (whose descriptors poll readable while they hold unread records) or at its next deadline, and
//! not otherwise, so that an idle daemon takes no CPU between intervals.

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    sync::{mpsc, Arc},
    time::Duration,
};

use crate::bell::Bell;

/// Sends commands to the thread that waits in `Inbox::wait`, waking it.
pub struct Commands<T> {
    sender: mpsc::Sender<T>,
    bell: Arc<Bell>,
}

impl<T> Clone for Commands<T> {
    fn clone(&self) -> Self {
        Self { sender: self.sender.clone(), bell: self.bell.clone() }
    }
}

/// What woke `Inbox::wait`.
pub enum Woken<T> {
    Command(T),
    /// Every `Commands` is gone: nobody can stop the thread any more.
    Disconnected,
    /// A ring has records, or the time is up.
    Other,
}

pub struct Inbox<T> {
    receiver: mpsc::Receiver<T>,
    bell: Arc<Bell>,
}

/// A channel whose receiver can wait on it and on descriptors at once: a bell rung at each send,
/// polled with the descriptors.
pub fn channel<T>() -> io::Result<(Commands<T>, Inbox<T>)> {
    let bell = Arc::new(Bell::new()?);
    let (sender, receiver) = mpsc::channel();
    Ok((Commands { sender, bell: bell.clone() }, Inbox { receiver, bell }))
}

impl<T> Commands<T> {
    /// Sends `command` and wakes the receiver; fails when the receiver is gone.
    pub fn send(&self, command: T) -> Result<(), mpsc::SendError<T>> {
        self.sender.send(command)?;
        self.bell.ring();
        Ok(())
    }
}

impl<T> Inbox<T> {
    /// Returns the next command at once if one is waiting; else waits until one is sent, one of
    /// `rings` polls readable, or `timeout` has passed.
    pub fn wait(&self, rings: &[BorrowedFd<'_>], timeout: Duration) -> Woken<T> {
        match self.receiver.try_recv() {
            Ok(command) => return Woken::Command(command),
            Err(mpsc::TryRecvError::Disconnected) => return Woken::Disconnected,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        let mut fds: Vec<libc::pollfd> = std::iter::once(self.bell.as_fd().as_raw_fd())
            .chain(rings.iter().map(|ring| ring.as_raw_fd()))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        let timeout = libc::timespec {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: `fds` is a live array of `fds.len()` entries; the timespec lives across the call.
        let ready = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &timeout, std::ptr::null()) };
        if ready < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                tracing::warn!("waiting for the kernel's rings: {err}");
            }
        }
        if fds[0].revents & libc::POLLIN != 0 {
            self.bell.clear();
        }
        match self.receiver.try_recv() {
            Ok(command) => Woken::Command(command),
            Err(mpsc::TryRecvError::Disconnected) => Woken::Disconnected,
            Err(mpsc::TryRecvError::Empty) => Woken::Other,
        }
    }
}
