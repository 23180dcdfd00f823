//! The tracer thread's sleep: it wakes for a command, for a record in one of the kernel's rings
//! (whose descriptors poll readable while they hold unread records) or at its next deadline, and
//! not otherwise, so that an idle daemon takes no CPU between intervals.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    sync::{mpsc, Arc},
    time::Duration,
};

/// Sends commands to the thread that waits in `Inbox::wait`, waking it.
pub struct Commands<T> {
    sender: mpsc::Sender<T>,
    bell: Arc<OwnedFd>,
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
    bell: Arc<OwnedFd>,
}

/// A channel whose receiver can wait on it and on descriptors at once: an eventfd rung at each
/// send, polled with the descriptors.
pub fn channel<T>() -> io::Result<(Commands<T>, Inbox<T>)> {
    // SAFETY: eventfd takes no pointers; its result is checked before use.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let bell = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
    let (sender, receiver) = mpsc::channel();
    Ok((Commands { sender, bell: bell.clone() }, Inbox { receiver, bell }))
}

impl<T> Commands<T> {
    /// Sends `command` and wakes the receiver; fails when the receiver is gone.
    pub fn send(&self, command: T) -> Result<(), mpsc::SendError<T>> {
        self.sender.send(command)?;
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to the eventfd. It fails only when the
        // counter would overflow, and then the receiver is woken already.
        unsafe { libc::write(self.bell.as_raw_fd(), one.as_ptr().cast(), one.len()) };
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
        let mut fds: Vec<libc::pollfd> = std::iter::once(self.bell.as_raw_fd())
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
            let mut count = [0u8; 8];
            // SAFETY: reads 8 bytes into a live buffer; resets the counter the senders rang.
            unsafe { libc::read(self.bell.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
        }
        match self.receiver.try_recv() {
            Ok(command) => Woken::Command(command),
            Err(mpsc::TryRecvError::Disconnected) => Woken::Disconnected,
            Err(mpsc::TryRecvError::Empty) => Woken::Other,
        }
    }
}
