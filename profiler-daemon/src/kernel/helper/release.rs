//! The last close of probe links, made by the helper: memprof gives it copies of the links, closes
//! its own, and then has the helper close its copies. If memprof dies first, the helper closes
//! them at the end of its socket.

use std::{os::fd::RawFd, sync::Mutex};

use super::{rights, Helper, CLOSE, CLOSED, HOLD};

/// Threads that close links together. A fixed few: each close of a uprobe_multi link walks every
/// process that maps the file under the kernel's locks, so more threads only wait on each other
/// (threads per process and per link made the daemon run 1,270 threads, 926 of them blocked there).
const CLOSERS: usize = 8;

/// Copies of links a helper holds, until `release`.
pub struct Holder(Helper);

impl Holder {
    /// Gives a helper copies of `links` (descriptors the caller owns). None when no helper could
    /// take them (said in a warning): the caller then closes the links itself.
    pub fn give(links: &[RawFd]) -> Option<Self> {
        let hold = |helper: &Helper| {
            links.chunks(rights::MOST_PER_MESSAGE).try_for_each(|chunk| helper.send(HOLD, &[], chunk))
        };
        Helper::serve(hold).map(|(helper, ())| Self(helper))
    }

    /// Once the caller has closed its own copies: has the helper close its copies, and returns
    /// when it has.
    pub fn release(self) {
        let helper = self.0;
        match helper.send(CLOSE, &[], &[]).and_then(|()| helper.answer()) {
            Ok(answer) if answer.tag == CLOSED => helper.keep(),
            // Killed meanwhile, say: its exit closed them.
            outcome => {
                let why = outcome.map_or_else(|err| err.to_string(), |answer| format!("it answered {}", answer.tag));
                tracing::warn!("memprof's helper that closes probe links ended before it said it closed them: {why}");
                helper.end();
            }
        }
    }
}

/// Closes (drops) `items` on at most `CLOSERS` threads, and returns when all are closed:
/// uprobe_multi links closed at once share their grace periods, and perf-event uprobes, which
/// each wait for theirs under a kernel-wide mutex, at least leave the waiting to the threads.
pub fn close_together<T: Send>(items: Vec<T>) {
    let count = items.len();
    let queue = Mutex::new(items);
    let next = || queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop();
    std::thread::scope(|scope| {
        for _ in 0..CLOSERS.min(count) {
            scope.spawn(|| {
                while let Some(item) = next() {
                    drop(item);
                }
            });
        }
    });
}
