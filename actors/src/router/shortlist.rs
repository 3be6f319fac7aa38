//! Picks over thousands of workers. Costing every worker for every request is a pass over
//! all of them (about 100 ns each: 1 ms a pick at 10,000). From [`SHORTLIST_FROM`] workers
//! on, `least-loaded` and `prefix` cost a shortlist instead: the [`SHORTLIST_LEN`] cheapest
//! workers for the requests of late, chosen from all of them every [`REFRESH`] by a task of
//! the router's, plus (prefix) the few workers with the longest runs of the prompt's leading
//! blocks, found without visiting every holder (`KvIndex::top_hits`). A pick
//! reads the shortlisted workers' live load, so requests it sends move the next pick on at
//! once; a worker whose load fell meanwhile joins the list within one refresh, far less
//! than the interval at which workers report their load.
//!
//! Where none of the shortlist can take the request (its context is too long for them, or
//! all were tried), the pick scans every worker as below the threshold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use super::links::WorkerLink;
use crate::policy::{Policy, RequestShape};

/// Workers from which picks cost a shortlist.
pub(crate) const SHORTLIST_FROM: usize = 512;
/// Workers on the shortlist.
pub(crate) const SHORTLIST_LEN: usize = 64;
/// How often the shortlist is chosen again.
pub(crate) const REFRESH: Duration = Duration::from_millis(10);

/// The cheapest workers for the requests of late; empty while picks scan every worker.
/// Chosen by `Picker::refresh_shortlist`, read by `Picker::choose`.
#[derive(Default)]
pub(crate) struct Shortlist {
    list: RwLock<Arc<Listed>>,
    /// The last pick's request shape (prompt tokens << 32 | output tokens): what the list
    /// is ordered for.
    shape: AtomicU64,
    /// Turns of the refresh: equal workers take turns on the list.
    turn: AtomicU64,
}

impl Shortlist {
    /// The current list, if picks use one.
    pub(crate) fn current(&self) -> Option<Arc<Listed>> {
        Some(self.list.read().clone()).filter(|l| !l.is_empty())
    }

    /// Puts a new list in place.
    pub(crate) fn set(&self, links: Vec<Arc<WorkerLink>>) {
        let mut slots: Vec<u32> = links.iter().map(|w| w.hot.slot).collect();
        slots.sort_unstable();
        *self.list.write() = Arc::new(Listed { links, slots });
    }

    /// The refresh's turn: where equal workers start from.
    pub(crate) fn next_turn(&self) -> usize {
        self.turn.fetch_add(1, Ordering::Relaxed) as usize
    }

    /// Remembers what a pick was for, which the next list is ordered by.
    pub(crate) fn saw(&self, prompt_tokens: usize, output_tokens: usize) {
        let packed = (prompt_tokens.min(u32::MAX as usize) as u64) << 32
            | output_tokens.min(u32::MAX as usize) as u64;
        self.shape.store(packed, Ordering::Relaxed);
    }

    pub(crate) fn shape(&self, block_size: usize) -> RequestShape {
        let packed = self.shape.load(Ordering::Relaxed);
        RequestShape {
            prompt_tokens: (packed >> 32) as usize,
            block_size,
            output_tokens: (packed as u32 as usize).max(1),
        }
    }
}

/// The shortlisted workers, and their slots in order, for the picks that look holders of a
/// prompt's blocks up among them (sorted once a refresh, not once a pick).
#[derive(Default)]
pub(crate) struct Listed {
    links: Vec<Arc<WorkerLink>>,
    pub(crate) slots: Vec<u32>,
}

impl std::ops::Deref for Listed {
    type Target = [Arc<WorkerLink>];
    fn deref(&self) -> &Self::Target {
        &self.links
    }
}

/// Whether `policy` picks from a shortlist at scale.
pub(crate) fn uses_shortlist(policy: Policy) -> bool {
    matches!(policy, Policy::LeastLoaded | Policy::Prefix)
}

/// The workers by their slot in the prefix index, for the holders of a prompt's blocks.
pub(crate) fn by_slot(list: &[Arc<WorkerLink>]) -> HashMap<u32, Arc<WorkerLink>> {
    list.iter().map(|w| (w.hot.slot, w.clone())).collect()
}
