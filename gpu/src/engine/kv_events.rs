//! Which prefixes an engine's cache holds, published for routers that route by it.
//!
//! The engine hands the hub every step's stores and evictions ([`KvEvent`]). The hub keeps
//! the set of held block hashes and forwards each batch to every subscriber. A subscriber
//! starts from a snapshot of that set taken under the same lock as its registration, so the
//! snapshot followed by the batches it receives is exactly the engine's cache, in order.
//! A subscriber that falls [`MAX_QUEUED_BATCHES`] behind is dropped; it sees its channel
//! close and subscribes again, starting from a fresh snapshot.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::kv_cache::KvEvent;

/// Batches a subscriber may have unread before it is dropped (and must resubscribe).
pub const MAX_QUEUED_BATCHES: usize = 4096;

#[derive(Default)]
pub struct KvEventHub {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    held: HashSet<u64>,
    subscribers: Vec<mpsc::Sender<Arc<[KvEvent]>>>,
    stored: u64,
    removed: u64,
}

impl KvEventHub {
    /// Applies a step's events and passes them on.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        for e in &events {
            match *e {
                KvEvent::Stored(h) => {
                    g.held.insert(h.0);
                    g.stored += 1;
                }
                KvEvent::Removed(h) => {
                    g.held.remove(&h.0);
                    g.removed += 1;
                }
            }
        }
        let batch: Arc<[KvEvent]> = events.into();
        g.subscribers.retain(|s| s.try_send(batch.clone()).is_ok());
    }

    /// The held hashes now, and every change after them.
    pub fn subscribe(&self) -> (Vec<u64>, mpsc::Receiver<Arc<[KvEvent]>>) {
        let (tx, rx) = mpsc::channel(MAX_QUEUED_BATCHES);
        let mut g = self.inner.lock();
        g.subscribers.push(tx);
        (g.held.iter().copied().collect(), rx)
    }

    /// Hashes held, and stores and evictions so far.
    pub fn counts(&self) -> (usize, u64, u64) {
        let g = self.inner.lock();
        (g.held.len(), g.stored, g.removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::BlockHash;

    #[test]
    fn a_snapshot_and_the_batches_after_it_rebuild_the_set() {
        let hub = KvEventHub::default();
        let h = |x| BlockHash(x);
        hub.publish(vec![KvEvent::Stored(h(1)), KvEvent::Stored(h(2))]);
        let (snap, mut rx) = hub.subscribe();
        hub.publish(vec![KvEvent::Removed(h(1)), KvEvent::Stored(h(3))]);
        let mut set: HashSet<u64> = snap.into_iter().collect();
        while let Ok(b) = rx.try_recv() {
            for e in b.iter() {
                match *e {
                    KvEvent::Stored(x) => set.insert(x.0),
                    KvEvent::Removed(x) => set.remove(&x.0),
                };
            }
        }
        assert_eq!(set, HashSet::from([2, 3]));
        assert_eq!(hub.counts(), (2, 3, 1));
    }

    #[test]
    fn a_subscriber_that_falls_behind_is_dropped() {
        let hub = KvEventHub::default();
        let (_, mut rx) = hub.subscribe();
        for i in 0..=MAX_QUEUED_BATCHES as u64 {
            hub.publish(vec![KvEvent::Stored(BlockHash(i))]);
        }
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(n, MAX_QUEUED_BATCHES);
        // Closed: it must subscribe again for a fresh snapshot.
        assert!(matches!(
            rx.try_recv(),
            Err(mpsc::error::TryRecvError::Disconnected)
        ));
    }
}
