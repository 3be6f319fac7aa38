//! Routing as a pure choice over a snapshot of the workers: the router builds a
//! [`Candidate`] per routable worker and a policy picks one. Nothing here does I/O, so each
//! policy is tested on hand-made snapshots.
//!
//! - `round-robin`: the next worker in turn.
//! - `least-loaded`: the smallest expected wait, `(load + 1) / capacity`, where load is the
//!   worker's reported queue plus the requests this router sent since that report, and
//!   capacity is the worker's measured generation rate (its declared one until measured).
//!   A node three times faster ends up holding three times the work.
//! - `prefix`: KV-aware. The cost of a worker is the prompt tokens it would have to prefill
//!   (those past its cached leading blocks, as far as this router has sent them there) plus
//!   the tokens it already holds for other requests (prompt + max_tokens of each request this
//!   router has in flight there), over its capacity. A conversation stays where its history
//!   is cached until that worker holds more than a cache miss would cost elsewhere.

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastLoaded,
    Prefix,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round-robin" | "rr" => Ok(Policy::RoundRobin),
            "least-loaded" => Ok(Policy::LeastLoaded),
            "prefix" | "kv" => Ok(Policy::Prefix),
            other => Err(format!(
                "unknown routing policy '{other}' (round-robin, least-loaded, prefix)"
            )),
        }
    }
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoaded => "least-loaded",
            Policy::Prefix => "prefix",
        }
    }
}

/// One routable worker as a policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Requests queued or running there, as far as this router knows.
    pub load: f64,
    /// Generated tokens per second the worker can sustain (> 0).
    pub capacity: f64,
    /// How many of the request's leading KV blocks the worker is believed to hold.
    pub cached_blocks: usize,
    /// Tokens (prompt + max_tokens) of the requests in flight there.
    pub tokens_in_flight: f64,
}

/// What a policy knows of the request.
#[derive(Clone, Copy, Debug)]
pub struct RequestShape {
    pub prompt_blocks: usize,
    pub block_size: usize,
}

/// Picks an index into `cands`; `turn` is the round-robin counter. `None` when empty.
pub fn pick(policy: Policy, cands: &[Candidate], req: RequestShape, turn: u64) -> Option<usize> {
    if cands.is_empty() {
        return None;
    }
    match policy {
        Policy::RoundRobin => Some((turn % cands.len() as u64) as usize),
        _ => argmin(cands, turn, |c| cost(policy, c, req)),
    }
}

/// What a policy minimises for a candidate (round-robin has no cost: 0).
pub fn cost(policy: Policy, c: &Candidate, req: RequestShape) -> f64 {
    match policy {
        Policy::RoundRobin => 0.0,
        Policy::LeastLoaded => (c.load + 1.0) / c.capacity.max(1e-9),
        Policy::Prefix => {
            let uncached = req.prompt_blocks.saturating_sub(c.cached_blocks) * req.block_size;
            (uncached as f64 + c.tokens_in_flight) / c.capacity.max(1e-9)
        }
    }
}

/// A prefill node as the disaggregation choice sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrefillCandidate {
    /// Prompts queued there (its report, plus those this router sent since).
    pub queued: f64,
    /// Prompt tokens it holds or has been sent and not finished.
    pub tokens_queued: f64,
    /// Prompt tokens per second it computes when busy (0 until measured).
    pub tokens_per_s: f64,
    /// KV room, in tokens.
    pub free_tokens: f64,
}

/// Before a prefill node has been measured, its rate is taken as this (prompt tokens per
/// second); the least expected wait then falls back to the fewest queued tokens.
const UNMEASURED_PREFILL_RATE: f64 = 1000.0;

/// The prefill node with the least expected wait for a prompt of `tokens` uncached tokens,
/// among those with room: fewer than `max_queue` prompts queued and KV for the prompt.
pub fn pick_prefill(cands: &[PrefillCandidate], tokens: usize, max_queue: usize) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, c) in cands.iter().enumerate() {
        if c.queued >= max_queue as f64 || c.free_tokens < tokens as f64 {
            continue;
        }
        let rate = if c.tokens_per_s > 0.0 {
            c.tokens_per_s
        } else {
            UNMEASURED_PREFILL_RATE
        };
        let wait = (c.tokens_queued + tokens as f64) / rate;
        if best.is_none_or(|(_, b)| wait < b) {
            best = Some((i, wait));
        }
    }
    best.map(|(i, _)| i)
}

/// The lowest cost; ties broken by starting the scan at `turn`, so equal workers share.
fn argmin(cands: &[Candidate], turn: u64, cost: impl Fn(&Candidate) -> f64) -> Option<usize> {
    let n = cands.len();
    let start = (turn % n as u64) as usize;
    let mut best: Option<(usize, f64)> = None;
    for k in 0..n {
        let i = (start + k) % n;
        let c = cost(&cands[i]);
        if best.is_none_or(|(_, b)| c < b) {
            best = Some((i, c));
        }
    }
    best.map(|(i, _)| i)
}

/// Which prompt block hashes the router has sent to each worker: an approximation of what
/// each worker caches, bounded per worker (least recently routed hashes are forgotten
/// first), so router memory stays fixed however many prompts pass through.
pub struct PrefixIndex {
    per_worker: usize,
    workers: HashMap<String, WorkerBlocks>,
}

struct WorkerBlocks {
    /// hash → the tick it was last routed at.
    last_seen: HashMap<u64, u64>,
    /// (tick, hash) in routing order; stale entries are skipped when evicting.
    order: VecDeque<(u64, u64)>,
    tick: u64,
}

impl PrefixIndex {
    pub fn new(per_worker: usize) -> PrefixIndex {
        PrefixIndex {
            per_worker: per_worker.max(1),
            workers: HashMap::new(),
        }
    }

    /// How many of `hashes` (a prompt's chained block hashes, in order) lead `worker`'s set.
    pub fn leading_hits(&self, worker: &str, hashes: &[u64]) -> usize {
        let Some(w) = self.workers.get(worker) else {
            return 0;
        };
        hashes
            .iter()
            .take_while(|h| w.last_seen.contains_key(h))
            .count()
    }

    /// Records that `hashes` were routed to `worker`.
    pub fn record(&mut self, worker: &str, hashes: &[u64]) {
        let cap = self.per_worker;
        let w = self
            .workers
            .entry(worker.to_string())
            .or_insert_with(|| WorkerBlocks {
                last_seen: HashMap::new(),
                order: VecDeque::new(),
                tick: 0,
            });
        for &h in hashes {
            w.tick += 1;
            w.last_seen.insert(h, w.tick);
            w.order.push_back((w.tick, h));
        }
        while w.last_seen.len() > cap {
            let Some((t, h)) = w.order.pop_front() else {
                break;
            };
            if w.last_seen.get(&h) == Some(&t) {
                w.last_seen.remove(&h);
            }
        }
        // Stale (re-routed) entries could make `order` grow past its live set; compact.
        if w.order.len() > 4 * cap {
            let live = &w.last_seen;
            w.order.retain(|(t, h)| live.get(h) == Some(t));
        }
    }

    pub fn forget(&mut self, worker: &str) {
        self.workers.remove(worker);
    }

    /// Hashes held for `worker` (for tests and metrics).
    pub fn len(&self, worker: &str) -> usize {
        self.workers.get(worker).map_or(0, |w| w.last_seen.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(load: f64, capacity: f64, cached_blocks: usize) -> Candidate {
        Candidate {
            load,
            capacity,
            cached_blocks,
            // Requests of 100 tokens each.
            tokens_in_flight: load * 100.0,
        }
    }

    const SHAPE: RequestShape = RequestShape {
        prompt_blocks: 8,
        block_size: 16,
    };

    #[test]
    fn policies_parse_and_reject_unknown_names() {
        assert_eq!("least-loaded".parse::<Policy>(), Ok(Policy::LeastLoaded));
        assert!("fastest"
            .parse::<Policy>()
            .unwrap_err()
            .contains("round-robin"));
    }

    #[test]
    fn round_robin_cycles() {
        let cs = vec![c(9.0, 1.0, 0); 3];
        let picks: Vec<_> = (0..6)
            .map(|t| pick(Policy::RoundRobin, &cs, SHAPE, t).unwrap())
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert_eq!(pick(Policy::RoundRobin, &[], SHAPE, 0), None);
    }

    /// Simulates assignment: each pick adds one request; a 3x node ends with ~3x the work.
    #[test]
    fn least_loaded_shares_by_capacity() {
        let mut cs = vec![c(0.0, 100.0, 0), c(0.0, 300.0, 0)];
        let mut counts = [0; 2];
        for t in 0..400 {
            let i = pick(Policy::LeastLoaded, &cs, SHAPE, t).unwrap();
            counts[i] += 1;
            cs[i].load += 1.0;
        }
        assert!((295..=305).contains(&counts[1]), "{counts:?}");
    }

    #[test]
    fn least_loaded_prefers_the_idle_worker() {
        let cs = vec![c(5.0, 100.0, 0), c(0.0, 100.0, 0), c(2.0, 100.0, 0)];
        assert_eq!(pick(Policy::LeastLoaded, &cs, SHAPE, 0), Some(1));
    }

    #[test]
    fn prefix_follows_the_cache_until_load_outweighs_it() {
        // Equal load: the worker holding the prefix wins.
        let cs = vec![c(1.0, 100.0, 0), c(1.0, 100.0, 8)];
        assert_eq!(pick(Policy::Prefix, &cs, SHAPE, 0), Some(1));
        // A little more load does not move a cached conversation (8 blocks = 128 tokens).
        let cs = vec![c(0.0, 100.0, 0), c(1.0, 100.0, 8)];
        assert_eq!(pick(Policy::Prefix, &cs, SHAPE, 0), Some(1));
        // The cached worker is swamped: the idle one wins despite the prefill.
        let cs = vec![c(0.0, 100.0, 0), c(4.0, 100.0, 8)];
        assert_eq!(pick(Policy::Prefix, &cs, SHAPE, 0), Some(0));
    }

    #[test]
    fn prefill_goes_to_the_least_expected_wait_among_those_with_room() {
        let c = |queued: f64, tokens_queued: f64, rate: f64, free: f64| PrefillCandidate {
            queued,
            tokens_queued,
            tokens_per_s: rate,
            free_tokens: free,
        };
        // Twice as fast with twice the queue: equal waits; the faster one with less wins.
        let cs = vec![c(1.0, 1000.0, 1000.0, 1e6), c(2.0, 1500.0, 2000.0, 1e6)];
        assert_eq!(pick_prefill(&cs, 500, 8), Some(1));
        // A full queue or no KV room rules a node out.
        let cs = vec![c(8.0, 0.0, 1000.0, 1e6), c(0.0, 5000.0, 1000.0, 1e6)];
        assert_eq!(pick_prefill(&cs, 500, 8), Some(1));
        let cs = vec![c(0.0, 0.0, 1000.0, 400.0)];
        assert_eq!(pick_prefill(&cs, 500, 8), None);
        assert_eq!(pick_prefill(&[], 500, 8), None);
    }

    #[test]
    fn prefix_index_counts_leading_hits_and_stays_bounded() {
        let mut ix = PrefixIndex::new(100);
        ix.record("w1", &[1, 2, 3, 4]);
        assert_eq!(ix.leading_hits("w1", &[1, 2, 3, 9, 4]), 3);
        assert_eq!(ix.leading_hits("w1", &[9, 1]), 0);
        assert_eq!(ix.leading_hits("w2", &[1]), 0);
        for h in 1000..5000 {
            ix.record("w1", &[h]);
        }
        assert_eq!(ix.len("w1"), 100);
        // The oldest went first; the newest stay.
        assert_eq!(ix.leading_hits("w1", &[1]), 0);
        assert_eq!(ix.leading_hits("w1", &[4999, 4998]), 2);
        // Re-routing refreshes a hash so it outlives newer-but-older-touched ones.
        ix.record("w1", &[4901]);
        for h in 6000..6099 {
            ix.record("w1", &[h]);
        }
        assert_eq!(ix.leading_hits("w1", &[4901]), 1);
        ix.forget("w1");
        assert_eq!(ix.len("w1"), 0);
    }
}
