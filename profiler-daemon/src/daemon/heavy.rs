//! The answers that cost: a process's HTML report, flame graph, pprof profiles and JSON report.
//! Each is built off the async thread, so `/metrics` and the other light answers never wait
//! behind one; at most `MAX_BUILDS` at once, so their memory is bounded whatever the number of
//! clients; and once an interval: the requests for one answer in one interval share the bytes
//! the first built. The JSON report, which has every frame of every stack, is streamed instead.

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::Frame;
use tokio::sync::{mpsc, OnceCell, OwnedSemaphorePermit, Semaphore};

use super::view::TargetView;

/// Answers built (or streamed) at once: each holds up to the stacks a page holds (see
/// `format::page`) and its output.
pub const MAX_BUILDS: usize = 2;
/// How long a request waits for its turn before it is answered 503.
const TURN_WAIT: Duration = Duration::from_secs(30);
/// Bytes of JSON sent at a time, and chunks waiting for a slow client.
const CHUNK: usize = 64 * 1024;
const CHUNKS_QUEUED: usize = 4;

/// A process's answers of one interval, built on first request.
#[derive(Debug, Default)]
pub struct Built {
    pub html: OnceCell<Bytes>,
    pub flamegraph: OnceCell<Bytes>,
    pub heap: OnceCell<Bytes>,
    pub allocs: OnceCell<Bytes>,
}

#[derive(Debug, thiserror::Error)]
pub enum Busy {
    #[error("memprof is building {MAX_BUILDS} other answers; try again in a few seconds")]
    NoTurn,
    #[error("building the answer failed; see memprof's log")]
    Failed,
}

/// Turns to build heavy answers, shared by every connection.
#[derive(Clone)]
pub struct Builder {
    turns: Arc<Semaphore>,
}

impl Default for Builder {
    fn default() -> Self {
        Self { turns: Arc::new(Semaphore::new(MAX_BUILDS)) }
    }
}

impl Builder {
    async fn turn(&self) -> Result<OwnedSemaphorePermit, Busy> {
        match tokio::time::timeout(TURN_WAIT, self.turns.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(Busy::NoTurn),
        }
    }

    /// The bytes in `cell`, built by `build` on a blocking thread by the interval's first request.
    pub async fn once(
        &self,
        cell: &OnceCell<Bytes>,
        build: impl FnOnce() -> Vec<u8> + Send + 'static,
    ) -> Result<Bytes, Busy> {
        cell.get_or_try_init(|| async {
            let _turn = self.turn().await?;
            tokio::task::spawn_blocking(|| in_background(build)).await.map(Bytes::from).map_err(|_| Busy::Failed)
        })
        .await
        .cloned()
    }

    /// `target`'s report as JSON, serialized on a blocking thread as the client reads it: the
    /// daemon holds a few chunks of it at a time, not the whole.
    pub async fn json(&self, target: Arc<TargetView>) -> Result<Streamed, Busy> {
        let turn = self.turn().await?;
        let (sender, chunks) = mpsc::channel(CHUNKS_QUEUED);
        tokio::task::spawn_blocking(move || {
            lower_priority();
            let mut writer = io::BufWriter::with_capacity(CHUNK, Chunks(sender));
            // An error is a client gone: the stream ends with it.
            if serde_json::to_writer(&mut writer, &target.report).is_ok() {
                let _ = io::Write::write_all(&mut writer, b"\n");
                let _ = io::Write::flush(&mut writer);
            }
        });
        Ok(Streamed { chunks, _turn: turn })
    }
}

fn in_background<T>(build: impl FnOnce() -> T) -> T {
    lower_priority();
    build()
}

/// Heavy answers take what CPU is left: with `MAX_BUILDS` of them on a 2-core host, `/metrics`
/// waited long behind them at equal priority
/// (docs: performance.md#measurements-behind-design-choices). Nice 10 on this
/// (blocking pool) thread only; the pool's other work, password checks, may keep it.
fn lower_priority() {
    // SAFETY: plain syscalls on the calling thread.
    unsafe {
        let thread = libc::gettid() as libc::id_t;
        if libc::setpriority(libc::PRIO_PROCESS, thread, 10) != 0 {
            tracing::debug!("setpriority: {}", io::Error::last_os_error());
        }
    }
}

/// Sends what is written as chunks to a `Streamed` body, waiting while its queue is full.
struct Chunks(mpsc::Sender<Bytes>);

impl io::Write for Chunks {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.blocking_send(Bytes::copy_from_slice(buf)).map_err(|_| io::ErrorKind::BrokenPipe)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A response body fed by `Chunks`; holds its build turn until sent or dropped.
pub struct Streamed {
    chunks: mpsc::Receiver<Bytes>,
    _turn: OwnedSemaphorePermit,
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.chunks.poll_recv(cx).map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes))))
    }
}
