//! A bell one thread rings and another polls beside other descriptors: an eventfd, readable from
//! the first ring until it is cleared, however many rings came between.

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

pub struct Bell(OwnedFd);

impl Bell {
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; its result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to the eventfd. It fails only when the
        // counter would overflow, and then the bell is rung already.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Makes the bell quiet until it is rung again.
    pub fn clear(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer; resets the counter (EAGAIN when at 0).
        unsafe { libc::read(self.0.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    }
}

/// Readable while rung.
impl AsFd for Bell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rung(bell: &Bell) -> bool {
        let mut fd = libc::pollfd { fd: bell.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd; no wait.
        unsafe { libc::poll(&mut fd, 1, 0) == 1 }
    }

    #[test]
    fn a_bell_polls_readable_from_its_first_ring_until_cleared() {
        let bell = Bell::new().unwrap();
        assert!(!rung(&bell));
        bell.ring();
        bell.ring();
        assert!(rung(&bell));
        bell.clear();
        assert!(!rung(&bell));
        // Cleared when quiet: no error, nothing blocks.
        bell.clear();
        bell.ring();
        assert!(rung(&bell));
    }
}
