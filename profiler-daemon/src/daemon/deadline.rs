//! A connection's socket with a deadline on writes that make no progress, and why hyper ended a
//! connection, for `memprof_http_refused_total`.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::Sleep,
};

use super::server::Refusal;

/// Why hyper ended a connection, when it was a limit (a client that hangs up is not refused).
pub fn classify(err: &hyper::Error, state: &State) -> Option<Refusal> {
    if state.write_timed_out.load(Ordering::Relaxed) {
        Some(Refusal::WriteTimeout)
    } else if err.is_timeout() {
        Some(if state.reading_request.load(Ordering::Relaxed) { Refusal::HeaderTimeout } else { Refusal::IdleTimeout })
    } else if err.is_parse_too_large() {
        Some(Refusal::HeaderTooLarge)
    } else if err.is_parse() {
        Some(Refusal::Malformed)
    } else {
        None
    }
}

/// What the socket saw, for `classify`.
#[derive(Debug, Default)]
pub struct State {
    /// Bytes arrived since the last answer was written: a request is under way.
    reading_request: AtomicBool,
    write_timed_out: AtomicBool,
}

/// The socket, with a deadline on writes that make no progress: hyper has no write timeout, and a
/// client that never reads its answer would hold its connection slot for ever.
pub struct Deadline<S> {
    inner: S,
    timeout: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
    state: Arc<State>,
}

impl<S> Deadline<S> {
    pub fn new(inner: S, timeout: Duration, state: Arc<State>) -> Self {
        Self { inner, timeout, stalled: None, state }
    }

    /// `poll` is a write's outcome: a stall longer than the timeout becomes an error.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let timeout = self.timeout;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stalled.as_mut().poll(cx).is_ready() {
            self.state.write_timed_out.store(true, Ordering::Relaxed);
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the client stopped reading")));
        }
        Poll::Pending
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Deadline<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.state.reading_request.store(true, Ordering::Relaxed);
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Deadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(poll, Poll::Ready(Ok(_))) {
            self.state.reading_request.store(false, Ordering::Relaxed);
        }
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(poll, Poll::Ready(Ok(_))) {
            self.state.reading_request.store(false, Ordering::Relaxed);
        }
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, poll)
    }
}
