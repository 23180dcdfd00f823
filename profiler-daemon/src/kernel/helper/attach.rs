//! Attaches made by the helper: the system calls that put a uprobe's breakpoints in. memprof sends
//! the request (with the program, for a BPF link), the helper makes the call and sends back the
//! new descriptor, then closes its own copy. If memprof has died meanwhile, that close is the
//! last, made by a process with no SIGKILL pending.

use std::{
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd},
};

use super::{rights, Helper, ATTACH, ATTACHED, FAILED};
use crate::kernel::{perf_event, uprobe_multi};

/// A system call that puts a uprobe's breakpoints in as it makes its descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// A uprobe_multi link of the program sent along (see `uprobe_multi::link_create`).
    UprobeMulti {
        path: CString,
        offsets: Vec<u64>,
        cookies: Vec<u64>,
        /// Empty, or one per offset (see `uprobe_multi::attach_with_semaphores`).
        semaphores: Vec<u64>,
        attach_type: u32,
        multi_flags: u32,
        pid: u32,
    },
    /// A perf-event uprobe's event, without its program (see `perf_event::open_uprobe`).
    PerfUprobe { path: CString, kind: u32, config: u64, offset: u64, pid: u32 },
}

/// The requests' first byte.
const UPROBE_MULTI: u8 = 1;
const PERF_UPROBE: u8 = 2;

/// Makes `request` in a helper, and returns the new descriptor, or the call's own error. Where no
/// helper can serve (said once in a warning), memprof makes the call itself.
pub fn make(request: &Request, program: Option<BorrowedFd<'_>>) -> io::Result<OwnedFd> {
    let payload = request.encode();
    let fds: Vec<RawFd> = program.iter().map(AsRawFd::as_raw_fd).collect();
    let ask = |helper: &Helper| -> io::Result<io::Result<OwnedFd>> {
        helper.send(ATTACH, &payload, &fds)?;
        let answer = helper.answer()?;
        match (answer.tag, answer.fds.into_iter().next(), <[u8; 4]>::try_from(answer.payload.as_slice())) {
            (ATTACHED, Some(made), _) => Ok(Ok(made)),
            (FAILED, None, Ok(errno)) => Ok(Err(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)))),
            (tag, ..) => Err(io::Error::other(format!("it answered {tag} to an attach"))),
        }
    };
    match Helper::serve(ask) {
        Some((helper, made)) => {
            helper.keep();
            made
        }
        None => request.make_here(program),
    }
}

/// The helper's side: makes the request memprof sent and answers with its descriptor or error.
/// Returns an error when memprof's end is gone.
pub(super) fn serve(socket: BorrowedFd<'_>, message: rights::Message) -> io::Result<()> {
    let made =
        Request::decode(&message.payload).and_then(|request| request.make_here(message.fds.first().map(AsFd::as_fd)));
    match made {
        // memprof holds its copy before the helper closes its own, as this drops.
        Ok(made) => rights::send(socket, ATTACHED, &[], &[made.as_raw_fd()]),
        Err(err) => rights::send(socket, FAILED, &err.raw_os_error().unwrap_or(libc::EIO).to_ne_bytes(), &[]),
    }
}

impl Request {
    /// Makes the system call in this process.
    fn make_here(&self, program: Option<BorrowedFd<'_>>) -> io::Result<OwnedFd> {
        match self {
            Self::UprobeMulti { path, offsets, cookies, semaphores, attach_type, multi_flags, pid } => {
                let program = program.ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
                uprobe_multi::link_create(program, path, offsets, cookies, semaphores, *attach_type, *multi_flags, *pid)
            }
            Self::PerfUprobe { path, kind, config, offset, pid } => {
                perf_event::open_uprobe(path, *kind, *config, *offset, *pid)
            }
        }
    }

    /// The request as bytes, in this machine's byte order: memprof and its helper are one binary.
    fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        let path = match self {
            Self::UprobeMulti { path, offsets, cookies, semaphores, attach_type, multi_flags, pid } => {
                bytes.push(UPROBE_MULTI);
                for word in [*attach_type, *multi_flags, *pid, offsets.len() as u32, semaphores.len() as u32] {
                    bytes.extend(word.to_ne_bytes());
                }
                bytes.extend(offsets.iter().chain(cookies).chain(semaphores).flat_map(|word| word.to_ne_bytes()));
                path
            }
            Self::PerfUprobe { path, kind, config, offset, pid } => {
                bytes.push(PERF_UPROBE);
                bytes.extend(kind.to_ne_bytes());
                bytes.extend(pid.to_ne_bytes());
                bytes.extend(config.to_ne_bytes());
                bytes.extend(offset.to_ne_bytes());
                path
            }
        };
        bytes.extend(path.as_bytes());
        bytes
    }

    fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut reader = Reader(bytes);
        match reader.take::<1>()? {
            [UPROBE_MULTI] => {
                let (attach_type, multi_flags, pid) = (reader.u32()?, reader.u32()?, reader.u32()?);
                let (count, semaphore_count) = (reader.u32()? as usize, reader.u32()? as usize);
                let offsets = (0..count).map(|_| reader.u64()).collect::<io::Result<_>>()?;
                let cookies = (0..count).map(|_| reader.u64()).collect::<io::Result<_>>()?;
                let semaphores = (0..semaphore_count).map(|_| reader.u64()).collect::<io::Result<_>>()?;
                let path = reader.path()?;
                Ok(Self::UprobeMulti { path, offsets, cookies, semaphores, attach_type, multi_flags, pid })
            }
            [PERF_UPROBE] => {
                let (kind, pid, config, offset) = (reader.u32()?, reader.u32()?, reader.u64()?, reader.u64()?);
                Ok(Self::PerfUprobe { path: reader.path()?, kind, config, offset, pid })
            }
            _ => Err(malformed()),
        }
    }
}

/// Reads a request's fields in order.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let (field, rest) = self.0.split_first_chunk::<N>().ok_or_else(malformed)?;
        self.0 = rest;
        Ok(*field)
    }

    fn u32(&mut self) -> io::Result<u32> {
        self.take().map(u32::from_ne_bytes)
    }

    fn u64(&mut self) -> io::Result<u64> {
        self.take().map(u64::from_ne_bytes)
    }

    /// The rest: a path without its NUL.
    fn path(&mut self) -> io::Result<CString> {
        CString::new(std::mem::take(&mut self.0)).map_err(|_| malformed())
    }
}

fn malformed() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_arrive_as_they_were_sent() {
        let requests = [
            Request::UprobeMulti {
                path: c"/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
                offsets: vec![0x1000, 0x2000],
                cookies: vec![1, 2],
                semaphores: vec![0, 0x3010],
                attach_type: uprobe_multi::ATTACH_TYPE,
                multi_flags: 1,
                pid: 42,
            },
            Request::PerfUprobe { path: c"/bin/true".into(), kind: 9, config: 1 << 32 | 1, offset: 0x40, pid: 7 },
        ];
        for request in requests {
            assert_eq!(Request::decode(&request.encode()).unwrap(), request);
        }
    }

    #[test]
    fn a_request_cut_short_is_refused() {
        let request = Request::PerfUprobe { path: c"/bin/true".into(), kind: 9, config: 0, offset: 0x40, pid: 7 };
        let bytes = request.encode();
        assert_eq!(Request::decode(&bytes[..20]).unwrap_err().raw_os_error(), Some(libc::EINVAL));
        assert_eq!(Request::decode(&[3]).unwrap_err().raw_os_error(), Some(libc::EINVAL));
    }
}
