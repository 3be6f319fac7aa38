//! The one-worker form of the prefix index: what the [`KvIndex`](super::KvIndex) must
//! answer for every worker at once, kept here as the index's test oracle.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use super::PENDING_FOR;

/// What one worker's prefix cache holds, as its router knows it: the block hashes the
/// worker reported storing and not yet evicting (exact, from its events), plus the blocks
/// of prompts just sent there, which it will store once it has computed them (`pending`,
/// forgotten after [`PENDING_FOR`] or when the worker reports them). The router keeps a
/// [`KvIndex`](super::KvIndex) instead, which answers the same for every worker at
/// once; this one-worker form is what it is tested against.
#[derive(Default)]
pub struct KvView {
    /// A snapshot has arrived: `held` is the worker's own account.
    pub synced: bool,
    held: HashSet<u64>,
    pending: HashMap<u64, Instant>,
    pending_order: VecDeque<(Instant, u64)>,
}

/// Pending hashes remembered per worker at most.
const MAX_PENDING: usize = 65_536;

impl KvView {
    /// Applies a batch of the worker's events; a snapshot replaces everything known.
    pub fn apply(&mut self, snapshot: bool, stored: &[u64], removed: &[u64]) {
        if snapshot {
            self.held.clear();
            self.synced = true;
        }
        for h in removed {
            self.held.remove(h);
        }
        for &h in stored {
            self.held.insert(h);
            self.pending.remove(&h);
        }
    }

    /// The worker was lost: nothing it held can be counted on.
    pub fn clear(&mut self) {
        *self = KvView::default();
    }

    /// Leading blocks of `hashes` held: (reported by the worker, counting pending too).
    pub fn leading_hits(&self, hashes: &[u64], now: Instant) -> (usize, usize) {
        let held = hashes.iter().take_while(|h| self.held.contains(h)).count();
        let with_pending = held
            + hashes[held..]
                .iter()
                .take_while(|h| {
                    self.held.contains(h)
                        || self.pending.get(h).is_some_and(|&t| now < t + PENDING_FOR)
                })
                .count();
        (held, with_pending)
    }

    /// Records that a prompt with these block hashes was sent to the worker.
    pub fn expect(&mut self, hashes: &[u64], now: Instant) {
        while let Some(&(t, h)) = self.pending_order.front() {
            if now < t + PENDING_FOR && self.pending.len() < MAX_PENDING {
                break;
            }
            self.pending_order.pop_front();
            if self.pending.get(&h) == Some(&t) {
                self.pending.remove(&h);
            }
        }
        for &h in hashes {
            if !self.held.contains(&h) {
                self.pending.insert(h, now);
                self.pending_order.push_back((now, h));
            }
        }
    }

    /// Hashes the worker reported holding.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kv_view_is_the_workers_account_plus_what_was_just_sent() {
        let t0 = Instant::now();
        let mut v = KvView::default();
        assert!(!v.synced);
        v.apply(true, &[1, 2, 3], &[]);
        assert!(v.synced);
        assert_eq!(v.leading_hits(&[1, 2, 3, 4], t0), (3, 3));
        // Sent there: pending until the worker reports it, or for PENDING_FOR.
        v.expect(&[1, 2, 3, 4, 5], t0);
        assert_eq!(v.leading_hits(&[1, 2, 3, 4, 5], t0), (3, 5));
        assert_eq!(v.leading_hits(&[1, 2, 3, 4, 5], t0 + PENDING_FOR), (3, 3));
        // Evicted by the worker: the chain breaks there.
        v.apply(false, &[4], &[2]);
        assert_eq!(v.leading_hits(&[1, 2, 3, 4], t0), (1, 1));
        assert_eq!(v.held(), 3);
        // A snapshot replaces everything.
        v.apply(true, &[9], &[]);
        assert_eq!(v.leading_hits(&[1], t0), (0, 0));
        assert_eq!(v.leading_hits(&[9], t0), (1, 1));
        v.clear();
        assert!(!v.synced);
        assert_eq!(v.held(), 0);
    }

    #[test]
    fn pending_blocks_stay_bounded() {
        let t0 = Instant::now();
        let mut v = KvView::default();
        for h in 0..(3 * MAX_PENDING as u64) {
            v.expect(&[h], t0);
        }
        assert!(v.pending.len() <= MAX_PENDING + 1);
        assert!(v.pending_order.len() <= MAX_PENDING + 1);
    }
}
