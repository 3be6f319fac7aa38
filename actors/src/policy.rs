//! Routing as a pure choice over a snapshot of the workers: the router builds a
//! [`Candidate`] per routable worker and a policy picks one. Nothing here does I/O, so each
//! policy is tested on hand-made snapshots.
//!
//! - `round-robin`: the next worker in turn.
//! - `least-loaded`: the smallest expected wait, `(load + 1) / capacity`, where load is the
//!   worker's reported queue plus the requests this router sent since that report, and
//!   capacity is the worker's measured generation rate per sequence (its declared one until
//!   measured). A node three times faster ends up holding three times the work.
//! - `power-of-two`: two workers drawn at random, the lesser of their least-loaded costs.
//!   The router builds candidates for those two only, so a pick costs the same with 8
//!   workers or 800; balance is close to least-loaded's once there are many workers.
//! - `prefix`: KV-aware, in time. A worker's cost is the seconds until the request's first
//!   token there (its queued prompt tokens plus the request's uncached ones, over its
//!   measured prefill rate) plus least-loaded's wait. What a worker caches comes from the
//!   worker itself ([`KvView`], fed by its store and evict events). A cache hit may not
//!   unbalance the cluster past a bound: workers whose least-loaded cost exceeds the
//!   lowest by more than `max_imbalance` (relative), and that hold more than two requests
//!   beyond the least-loaded worker's, are not candidates.

use std::collections::{HashMap, HashSet, VecDeque};
use std::str::FromStr;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastLoaded,
    PowerOfTwo,
    Prefix,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round-robin" | "rr" => Ok(Policy::RoundRobin),
            "least-loaded" => Ok(Policy::LeastLoaded),
            "power-of-two" | "p2c" => Ok(Policy::PowerOfTwo),
            "prefix" | "kv" => Ok(Policy::Prefix),
            other => Err(format!(
                "unknown routing policy '{other}' (round-robin, least-loaded, power-of-two, prefix)"
            )),
        }
    }
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoaded => "least-loaded",
            Policy::PowerOfTwo => "power-of-two",
            Policy::Prefix => "prefix",
        }
    }
}

/// One routable worker as a policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Requests queued or running there, as far as this router knows.
    pub load: f64,
    /// Generated tokens per second one sequence gets there (> 0).
    pub capacity: f64,
    /// How many of the request's leading KV blocks the worker holds (or will, for blocks
    /// of requests just sent there).
    pub cached_blocks: usize,
    /// Prompt tokens this router sent there that are not computed yet (no first token).
    pub queued_prompt_tokens: f64,
    /// Prompt tokens per second it computes (> 0).
    pub prefill_rate: f64,
}

/// What a policy knows of the request.
#[derive(Clone, Copy, Debug)]
pub struct RequestShape {
    pub prompt_tokens: usize,
    pub block_size: usize,
}

/// Tuning of the `prefix` policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefixTuning {
    /// A worker is a candidate only while its least-loaded cost is at most
    /// `1 + max_imbalance` times the lowest among the workers.
    pub max_imbalance: f64,
}

impl Default for PrefixTuning {
    fn default() -> Self {
        PrefixTuning { max_imbalance: 1.0 }
    }
}

/// Requests a worker may hold beyond the least-loaded one's before the imbalance bound
/// applies to it.
const IMBALANCE_SLACK: f64 = 2.0;

/// Picks an index into `cands`; `turn` is the round-robin counter (and, for power-of-two,
/// the draw's seed). `None` when empty. For power-of-two, `cands` are the two drawn ones.
pub fn pick(
    policy: Policy,
    cands: &[Candidate],
    req: RequestShape,
    turn: u64,
    tuning: PrefixTuning,
) -> Option<usize> {
    if cands.is_empty() {
        return None;
    }
    match policy {
        Policy::RoundRobin => Some((turn % cands.len() as u64) as usize),
        Policy::LeastLoaded | Policy::PowerOfTwo => argmin(cands, turn, least_loaded, |_| true),
        Policy::Prefix => {
            let floor = cands.iter().map(least_loaded).fold(f64::INFINITY, f64::min);
            let bound = floor * (1.0 + tuning.max_imbalance.max(0.0));
            let fewest = cands.iter().map(|c| c.load).fold(f64::INFINITY, f64::min);
            // Out only when unbalanced both relatively and by whole requests, so a worker
            // not yet measured (its declared capacity) or a near-idle cluster is not split.
            argmin(
                cands,
                turn,
                |c| cost(policy, c, req),
                |c| least_loaded(c) <= bound || c.load <= fewest + IMBALANCE_SLACK,
            )
        }
    }
}

/// least-loaded's expected wait: seconds for every sequence there to get one more token,
/// were they served in turn.
fn least_loaded(c: &Candidate) -> f64 {
    (c.load + 1.0) / c.capacity.max(1e-9)
}

/// What a policy minimises for a candidate (round-robin has no cost: 0).
pub fn cost(policy: Policy, c: &Candidate, req: RequestShape) -> f64 {
    match policy {
        Policy::RoundRobin => 0.0,
        Policy::LeastLoaded | Policy::PowerOfTwo => least_loaded(c),
        Policy::Prefix => {
            let cached = (c.cached_blocks * req.block_size).min(req.prompt_tokens);
            let uncached = (req.prompt_tokens - cached) as f64;
            (c.queued_prompt_tokens + uncached) / c.prefill_rate.max(1e-9) + least_loaded(c)
        }
    }
}

/// Two distinct indices below `n` (one when `n` is 1), drawn from `seed`.
pub fn two_choices(n: usize, seed: u64) -> Vec<usize> {
    let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    };
    match n {
        0 => vec![],
        1 => vec![0],
        _ => {
            let a = (next() % n as u64) as usize;
            let b = (a + 1 + (next() % (n as u64 - 1)) as usize) % n;
            vec![a, b]
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

/// The lowest cost among those `admit` lets in; ties broken by starting the scan at
/// `turn`, so equal workers share.
fn argmin(
    cands: &[Candidate],
    turn: u64,
    cost: impl Fn(&Candidate) -> f64,
    admit: impl Fn(&Candidate) -> bool,
) -> Option<usize> {
    let n = cands.len();
    let start = (turn % n as u64) as usize;
    let mut best: Option<(usize, f64)> = None;
    for k in 0..n {
        let i = (start + k) % n;
        if !admit(&cands[i]) {
            continue;
        }
        let c = cost(&cands[i]);
        if best.is_none_or(|(_, b)| c < b) {
            best = Some((i, c));
        }
    }
    best.map(|(i, _)| i)
}

/// What one worker's prefix cache holds, as its router knows it: the block hashes the
/// worker reported storing and not yet evicting (exact, from its events), plus the blocks
/// of prompts just sent there, which it will store once it has computed them (`pending`,
/// forgotten after [`PENDING_FOR`] or when the worker reports them).
#[derive(Default)]
pub struct KvView {
    /// A snapshot has arrived: `held` is the worker's own account.
    pub synced: bool,
    held: HashSet<u64>,
    pending: HashMap<u64, Instant>,
    pending_order: VecDeque<(Instant, u64)>,
}

/// How long blocks of a prompt sent to a worker count as held there before the worker
/// says so: the time a request may queue and prefill.
pub const PENDING_FOR: Duration = Duration::from_secs(5);

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

    /// A worker with `load` requests, per-sequence `capacity`, holding `cached_blocks` of
    /// the request's blocks, computing 1000 prompt tokens per second with none queued.
    fn c(load: f64, capacity: f64, cached_blocks: usize) -> Candidate {
        Candidate {
            load,
            capacity,
            cached_blocks,
            queued_prompt_tokens: 0.0,
            prefill_rate: 1000.0,
        }
    }

    /// 8 blocks of 16 tokens.
    const SHAPE: RequestShape = RequestShape {
        prompt_tokens: 128,
        block_size: 16,
    };

    fn pick_(policy: Policy, cs: &[Candidate], turn: u64) -> Option<usize> {
        pick(policy, cs, SHAPE, turn, PrefixTuning::default())
    }

    #[test]
    fn policies_parse_and_reject_unknown_names() {
        assert_eq!("least-loaded".parse::<Policy>(), Ok(Policy::LeastLoaded));
        assert_eq!("power-of-two".parse::<Policy>(), Ok(Policy::PowerOfTwo));
        assert!("fastest"
            .parse::<Policy>()
            .unwrap_err()
            .contains("power-of-two"));
    }

    #[test]
    fn round_robin_cycles() {
        let cs = vec![c(9.0, 1.0, 0); 3];
        let picks: Vec<_> = (0..6)
            .map(|t| pick_(Policy::RoundRobin, &cs, t).unwrap())
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert_eq!(pick_(Policy::RoundRobin, &[], 0), None);
    }

    /// Simulates assignment: each pick adds one request; a 3x node ends with ~3x the work.
    #[test]
    fn least_loaded_shares_by_capacity() {
        let mut cs = vec![c(0.0, 100.0, 0), c(0.0, 300.0, 0)];
        let mut counts = [0; 2];
        for t in 0..400 {
            let i = pick_(Policy::LeastLoaded, &cs, t).unwrap();
            counts[i] += 1;
            cs[i].load += 1.0;
        }
        assert!((295..=305).contains(&counts[1]), "{counts:?}");
    }

    #[test]
    fn least_loaded_prefers_the_idle_worker() {
        let cs = vec![c(5.0, 100.0, 0), c(0.0, 100.0, 0), c(2.0, 100.0, 0)];
        assert_eq!(pick_(Policy::LeastLoaded, &cs, 0), Some(1));
    }

    #[test]
    fn two_choices_are_distinct_and_cover_every_worker() {
        let mut seen = HashSet::new();
        for seed in 0..2000 {
            let d = two_choices(64, seed);
            assert_eq!(d.len(), 2);
            assert_ne!(d[0], d[1]);
            assert!(d.iter().all(|&i| i < 64));
            seen.extend(d);
        }
        assert_eq!(seen.len(), 64);
        assert_eq!(two_choices(1, 5), [0]);
        assert!(two_choices(0, 5).is_empty());
    }

    /// Power of two choices over 256 equal workers: the fullest ends close to the mean,
    /// where one random choice would leave it far above.
    #[test]
    fn power_of_two_keeps_the_fullest_worker_near_the_mean() {
        let n = 256;
        let mut two = vec![c(0.0, 100.0, 0); n];
        let mut one = vec![0u32; n];
        for t in 0..(8 * n as u64) {
            let d = two_choices(n, t);
            let pair = [two[d[0]].clone(), two[d[1]].clone()];
            let k = pick_(Policy::PowerOfTwo, &pair, t).unwrap();
            two[d[k]].load += 1.0;
            one[d[0]] += 1;
        }
        let max_two = two.iter().map(|c| c.load).fold(0.0, f64::max);
        let max_one = *one.iter().max().unwrap() as f64;
        assert!(max_two <= 12.0, "mean 8, fullest {max_two}");
        assert!(max_one > max_two, "one choice {max_one}, two {max_two}");
    }

    #[test]
    fn prefix_follows_the_cache_until_waiting_outweighs_it() {
        // Equal load: the worker holding the prefix wins.
        let cs = vec![c(1.0, 100.0, 0), c(1.0, 100.0, 8)];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(1));
        // A little more load does not move a cached conversation: 128 uncached tokens take
        // 128 ms, one more request 10 ms.
        let cs = vec![c(0.0, 100.0, 0), c(1.0, 100.0, 8)];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(1));
        // Prompt work already queued there outweighs the hit.
        let mut busy = c(1.0, 100.0, 8);
        busy.queued_prompt_tokens = 400.0;
        let cs = vec![c(1.0, 100.0, 0), busy];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(0));
        // A fast prefill makes the hit worth little: least-loaded's term decides.
        let mut fast = vec![c(0.0, 100.0, 0), c(3.0, 100.0, 8)];
        fast[0].prefill_rate = 1e6;
        fast[1].prefill_rate = 1e6;
        assert_eq!(pick_(Policy::Prefix, &fast, 0), Some(0));
    }

    #[test]
    fn prefix_hits_may_not_unbalance_the_cluster_past_the_bound() {
        // Every request shares a prefix only worker 1 holds; with slow prefill (100 tokens
        // per second) the hit is worth 1.28 s, far more than any queue here.
        let share = |max_imbalance: f64| {
            let mut cs = vec![c(0.0, 100.0, 0), c(0.0, 100.0, 8)];
            for cand in cs.iter_mut() {
                cand.prefill_rate = 100.0;
            }
            let tuning = PrefixTuning { max_imbalance };
            let mut counts = [0; 2];
            for t in 0..60 {
                let i = pick(Policy::Prefix, &cs, SHAPE, t, tuning).unwrap();
                counts[i] += 1;
                cs[i].load += 1.0;
            }
            counts
        };
        // Unbounded, the holder takes everything.
        assert_eq!(share(1e9), [0, 60]);
        // At most twice the other's cost: (load + 1) <= 2 (other + 1).
        let [a, b] = share(1.0);
        assert!((19..=21).contains(&a), "{a}/{b}");
        // A stricter bound shares more evenly.
        let [a, b] = share(0.2);
        assert!((26..=28).contains(&a), "{a}/{b}");
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
