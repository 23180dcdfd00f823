//! Descriptors passed over a Unix socket (`SCM_RIGHTS`), one tagged message at a time.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
};

/// The most descriptors one message carries (`SCM_MAX_FD` in the kernel).
pub const MOST_PER_MESSAGE: usize = 253;

/// Sends the one-byte `tag` with `fds` (at most `MOST_PER_MESSAGE`) on `socket`. The receiver
/// holds copies of them from the moment this returns.
pub fn send(socket: BorrowedFd, tag: u8, fds: &[RawFd]) -> io::Result<()> {
    debug_assert!(fds.len() <= MOST_PER_MESSAGE);
    let mut byte = tag;
    let mut data = libc::iovec { iov_base: (&raw mut byte).cast(), iov_len: 1 };
    let mut control = ControlBuffer::for_fds(fds.len());
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &raw mut data;
    message.msg_iovlen = 1;
    if !fds.is_empty() {
        message.msg_control = control.pointer();
        message.msg_controllen = control.bytes;
        // SAFETY: the control buffer holds one header with room for `fds` (`for_fds`), aligned
        // for it; CMSG_FIRSTHDR returns its start, and the copy stays within CMSG_LEN's data.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&message);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(size_of_val(fds) as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(header).cast::<RawFd>(), fds.len());
        }
    }
    loop {
        // SAFETY: the message points at the byte and the control buffer above, alive here.
        if unsafe { libc::sendmsg(socket.as_raw_fd(), &message, libc::MSG_NOSIGNAL) } >= 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Receives one message: its tag and the descriptors it carries (close-on-exec). None at the end
/// of the stream (the sender has closed its end).
pub fn receive(socket: BorrowedFd) -> io::Result<Option<(u8, Vec<OwnedFd>)>> {
    let mut byte = 0u8;
    let mut data = libc::iovec { iov_base: (&raw mut byte).cast(), iov_len: 1 };
    let mut control = ControlBuffer::for_fds(MOST_PER_MESSAGE);
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &raw mut data;
    message.msg_iovlen = 1;
    message.msg_control = control.pointer();
    message.msg_controllen = control.bytes;
    let received = loop {
        // SAFETY: the message points at the byte and the control buffer above, alive here.
        let received = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut message, libc::MSG_CMSG_CLOEXEC) };
        if received >= 0 {
            break received;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled the control buffer with whole headers up to msg_controllen;
    // CMSG_FIRSTHDR and CMSG_NXTHDR stay within it, and each SCM_RIGHTS header's data holds
    // (cmsg_len - CMSG_LEN(0)) / 4 descriptors, now this process's, owned by nothing else.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*header).cmsg_len - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                let first = libc::CMSG_DATA(header).cast::<RawFd>();
                fds.extend((0..count).map(|i| OwnedFd::from_raw_fd(first.add(i).read_unaligned())));
            }
            header = libc::CMSG_NXTHDR(&message, header);
        }
    }
    Ok((received > 0).then_some((byte, fds)))
}

/// Room for one SCM_RIGHTS header and its descriptors, aligned as the headers must be.
struct ControlBuffer {
    words: Vec<u64>,
    bytes: usize,
}

impl ControlBuffer {
    fn for_fds(count: usize) -> Self {
        // SAFETY: CMSG_SPACE only computes a size.
        let bytes = unsafe { libc::CMSG_SPACE((count * size_of::<RawFd>()) as u32) } as usize;
        Self { words: vec![0; bytes.div_ceil(size_of::<u64>())], bytes }
    }

    fn pointer(&mut self) -> *mut libc::c_void {
        self.words.as_mut_ptr().cast()
    }
}
