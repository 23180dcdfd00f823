//! The HTTP listener's connection slots (`max_connections`, and the socket's trusted ones). A
//! connection that finds none free asks the oldest connection holding one to close once its
//! answer is sent: a client that keeps its connections alive with a request every few seconds,
//! never idle for `header_timeout`, would otherwise hold every slot and keep Prometheus's
//! scrapes waiting for as long as it liked. The oldest goes first: Prometheus's connection for
//! a scrape is opened anew at each (it idles longer than `header_timeout` between them).

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
};

use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

/// A pool of connection slots.
#[derive(Clone)]
pub struct Seats {
    free: Arc<Semaphore>,
    /// One per connection holding a slot, oldest first: sending asks it to give its slot up.
    holders: Arc<Mutex<VecDeque<oneshot::Sender<()>>>>,
    count: usize,
}

/// A slot held, and the request to give it up.
pub struct Seat {
    pub _slot: OwnedSemaphorePermit,
    pub give_up: oneshot::Receiver<()>,
}

impl Seats {
    pub fn new(count: usize) -> Self {
        Self { free: Arc::new(Semaphore::new(count)), holders: Arc::default(), count }
    }

    /// A free slot; else `waits` is called, the oldest connection is asked to give its slot up,
    /// and this one waits for a slot.
    pub async fn take(&self, waits: impl FnOnce()) -> Seat {
        let slot = match self.free.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                waits();
                self.ask_the_oldest();
                self.free.clone().acquire_owned().await.expect("the semaphore is never closed")
            }
        };
        let (ask, give_up) = oneshot::channel();
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        // Connections that ended leave their sender behind until asked; dropped in bulk.
        if holders.len() >= 2 * self.count {
            holders.retain(|holder| !holder.is_closed());
        }
        holders.push_back(ask);
        Seat { _slot: slot, give_up }
    }

    fn ask_the_oldest(&self) {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(holder) = holders.pop_front() {
            if holder.send(()).is_ok() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_waiting_for_a_slot_has_the_oldest_give_its_up() {
        let seats = Seats::new(2);
        let mut first = seats.take(|| panic!("a slot is free")).await;
        let mut second = seats.take(|| panic!("a slot is free")).await;
        let waited = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waiting = tokio::spawn({
            let (seats, waited) = (seats.clone(), waited.clone());
            async move { seats.take(|| waited.store(true, std::sync::atomic::Ordering::Relaxed)).await }
        });
        // The oldest is asked; the second is not.
        (&mut first.give_up).await.expect("asked to give up");
        assert!(second.give_up.try_recv().is_err());
        assert!(waited.load(std::sync::atomic::Ordering::Relaxed));
        drop(first);
        let _third = waiting.await.unwrap();
    }
}
