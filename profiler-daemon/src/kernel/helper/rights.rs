//! Messages on the helper's Unix socket: a one-byte tag, a payload, and descriptors passed along
//! (`SCM_RIGHTS`).

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
};

/// The most descriptors one message carries (`SCM_MAX_FD` in the kernel).
pub const MOST_PER_MESSAGE: usize = 253;
/// The longest payload a message carries: an attach's request with its path and about 4,000
/// probes' offsets and cookies.
pub const MOST_PAYLOAD: usize = 64 << 10;

/// A message received: its tag, its payload and the descriptors it carried, now this process's.
pub struct Message {
    pub tag: u8,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Sends `tag` with `payload` (at most `MOST_PAYLOAD` bytes) and `fds` (at most
/// `MOST_PER_MESSAGE`) on `socket`. The receiver holds copies of the descriptors from the moment
/// this returns.
pub fn send(socket: BorrowedFd, tag: u8, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    debug_assert!(fds.len() <= MOST_PER_MESSAGE);
    if payload.len() > MOST_PAYLOAD {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a message longer than the helper takes"));
    }
    let mut byte = tag;
    let mut data = [
        libc::iovec { iov_base: (&raw mut byte).cast(), iov_len: 1 },
        libc::iovec { iov_base: payload.as_ptr().cast_mut().cast(), iov_len: payload.len() },
    ];
    let mut control = ControlBuffer::for_fds(fds.len());
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = data.as_mut_ptr();
    message.msg_iovlen = data.len();
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
        // SAFETY: the message points at the byte, the payload (which sendmsg only reads) and the
        // control buffer above, alive here.
        if unsafe { libc::sendmsg(socket.as_raw_fd(), &message, libc::MSG_NOSIGNAL) } >= 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Receives one message (its descriptors close-on-exec). None at the end of the stream (the
/// sender has closed its end).
pub fn receive(socket: BorrowedFd) -> io::Result<Option<Message>> {
    let mut byte = 0u8;
    let mut payload = vec![0u8; MOST_PAYLOAD];
    let mut data = [
        libc::iovec { iov_base: (&raw mut byte).cast(), iov_len: 1 },
        libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() },
    ];
    let mut control = ControlBuffer::for_fds(MOST_PER_MESSAGE);
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = data.as_mut_ptr();
    message.msg_iovlen = data.len();
    message.msg_control = control.pointer();
    message.msg_controllen = control.bytes;
    let received = loop {
        // SAFETY: the message points at the byte, the payload and the control buffer above,
        // alive here.
        let received = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut message, libc::MSG_CMSG_CLOEXEC) };
        if received >= 0 {
            break received as usize;
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
    if message.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a message longer than the helper takes"));
    }
    if received == 0 {
        return Ok(None);
    }
    payload.truncate(received - 1);
    Ok(Some(Message { tag: byte, payload, fds }))
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

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;

    use super::*;

    #[test]
    fn a_message_arrives_whole_with_its_descriptors() {
        let (ours, theirs) = super::super::seqpacket_pair().unwrap();
        let payload: Vec<u8> = (0..MOST_PAYLOAD).map(|i| i as u8).collect();
        send(ours.as_fd(), 7, &payload, &[ours.as_raw_fd()]).unwrap();
        let message = receive(theirs.as_fd()).unwrap().unwrap();
        assert_eq!((message.tag, &message.payload, message.fds.len()), (7, &payload, 1));
        // The copy of `ours` it carried goes, so that the end of the stream is seen below.
        drop(message);
        send(ours.as_fd(), 8, &[], &[]).unwrap();
        let message = receive(theirs.as_fd()).unwrap().unwrap();
        assert_eq!((message.tag, message.payload.len(), message.fds.len()), (8, 0, 0));
        drop(ours);
        assert!(receive(theirs.as_fd()).unwrap().is_none());
    }

    #[test]
    fn a_payload_too_long_is_refused_before_it_is_sent() {
        let (ours, _theirs) = super::super::seqpacket_pair().unwrap();
        let err = send(ours.as_fd(), 7, &vec![0; MOST_PAYLOAD + 1], &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
