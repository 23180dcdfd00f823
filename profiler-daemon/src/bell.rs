//! A bell one thread rings and another polls beside other descriptors: an eventfd, readable from
//! the first ring until it is cleared, however many rings came between. And `EdgeBell`, which
//! the kernel rings for a ring buffer only when its programs ask it to.

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

/// Polls readable only after the kernel has woken the waiters of a ring: an epoll set that holds
/// the ring edge-triggered. The ring itself polls readable while any record waits; a ring whose
/// programs wake its readers only at a threshold (the mapping events) wakes the sleep only then.
pub struct EdgeBell {
    epoll: OwnedFd,
}

impl EdgeBell {
    pub fn new(ring: BorrowedFd<'_>) -> io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointer; a descriptor it returns is ours to own.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned open, and nothing else owns it.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut event = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: 0 };
        // SAFETY: both descriptors are open; `event` lives across the call.
        if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, ring.as_raw_fd(), &mut event) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { epoll })
    }

    /// Takes the wake-up; whether there was one. The bell polls readable again only at the
    /// ring's next.
    pub fn take(&self) -> bool {
        let mut event = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: room for one event, which lives across the call; a zero timeout does not block.
        unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), &mut event, 1, 0) > 0 }
    }
}

impl AsFd for EdgeBell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
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

    #[test]
    fn an_edge_bell_is_taken_once_per_wake_up_of_what_it_watches() {
        // An eventfd stands for the ring: each write wakes its waiters, as a forced wake-up does.
        let watched = Bell::new().unwrap();
        let edge = EdgeBell::new(watched.as_fd()).unwrap();
        assert!(!edge.take(), "nothing woke it yet");
        watched.ring();
        assert!(edge.take());
        // Still readable itself, but no new wake-up: the bell stays quiet.
        assert!(rung(&watched));
        assert!(!edge.take());
        watched.ring();
        assert!(edge.take());
    }
}
