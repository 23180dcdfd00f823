//! The one thread that detaches the probes of processes that exited, so that the caller goes on
//! at once. One thread, not one per process: detaching walks every process that maps the file
//! under the kernel's locks, and a thread per process only made them wait on each other (the
//! daemon ran 1,270 threads, 926 blocked in `uprobe_unregister_nosync`).

use std::{
    sync::mpsc::{self, Sender},
    thread::JoinHandle,
};

use crate::kernel::probes::Attachment;

#[derive(Debug)]
pub struct Detacher {
    queue: Sender<Attachment>,
    thread: JoinHandle<()>,
}

impl Detacher {
    pub fn spawn() -> std::io::Result<Self> {
        let (queue, detaching) = mpsc::channel::<Attachment>();
        let thread = std::thread::Builder::new().name("detacher".into()).spawn(move || {
            while let Ok(mut attachment) = detaching.recv() {
                // Everything queued meanwhile, at once: links closed together share the
                // kernel's grace periods.
                while let Ok(more) = detaching.try_recv() {
                    attachment.merge(more);
                }
                drop(attachment);
            }
        })?;
        Ok(Self { queue, thread })
    }

    /// Detaches `attachment` in the background.
    pub fn detach(&self, attachment: Attachment) {
        // The thread lives as long as `self`: sending cannot fail.
        let _ = self.queue.send(attachment);
    }

    /// Returns once everything queued is detached.
    pub fn finish(self) {
        drop(self.queue);
        let _ = self.thread.join();
    }

    /// For the end of `attach` and `run` with perf-event links: returns at once. A child forked
    /// here holds a copy of every descriptor still open and exits at once; memprof's exit closes
    /// its own. Whichever of the two exits closes a link last makes the kernel's slow release of
    /// its probe, so memprof's exit waits for only part of them. No signal interrupts an exit:
    /// the releases complete whatever kills memprof. Without a child (fork failed), waits as
    /// `finish` does.
    pub fn hand_over(self) {
        // SAFETY: fork has no preconditions. The child of this multi-threaded process calls
        // only async-signal-safe functions (close, _exit): its standard streams go first, so
        // that nobody reading memprof's output waits for the child.
        match unsafe { libc::fork() } {
            0 => unsafe {
                libc::close(0);
                libc::close(1);
                libc::close(2);
                libc::_exit(0)
            },
            -1 => self.finish(),
            // The thread goes on dropping what is queued, each a reference only, until memprof
            // exits.
            _ => drop(self.queue),
        }
    }
}
