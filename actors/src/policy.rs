//! Routing as a pure choice over a snapshot of the workers: the router builds a
//! [`Candidate`] per routable worker and a policy picks one. Nothing here does I/O, so each
//! policy is tested on hand-made snapshots.
//!
//! - `round-robin`: the next worker in turn.
//! - `least-loaded`: the least expected time, in seconds, the request costs the cluster
//!   there: its own prompt wait and prefill, its decode (output tokens times the step time
//!   with it in the batch), plus what it costs the sequences already there (the slower
//!   steps its place in the batch makes). Step
//!   time comes from the worker's own fit of `base + per_seq * batch` over its recent
//!   steps; beyond its batch limit a request waits for a slot. On a device where batching
//!   is nearly free, a fast node takes more than its speed's share, as it should; where
//!   each sequence costs its share of the node, work splits by speed. A worker that has not
//!   decoded yet is given the slowest measured worker's step (by the router), or, with none
//!   measured, taken as serving its sequences in turn at its declared rate.
//! - `power-of-two`: two workers drawn at random, the lesser of their least-loaded costs.
//!   The router builds candidates for those two only, so a pick costs the same with 8
//!   workers or 800; balance is close to least-loaded's once there are many workers.
//! - `prefix`: KV-aware: least-loaded's cost with only the prompt's uncached part to
//!   compute. What a worker caches comes from the worker itself (the router's
//!   [`KvIndex`](crate::kv_index::KvIndex), fed by every worker's store and evict events).
//!   A cache hit may not unbalance the cluster past a bound, measured in time like the
//!   cost: a worker's backlog is what the request would spend there apart from computing
//!   its own prompt (the prompts queued ahead, its decode in that batch, the wait for a
//!   slot). Workers whose backlog exceeds the lowest by more than `max_imbalance`
//!   (relative), and that hold more than two requests beyond the least-loaded worker's,
//!   are not candidates. Requests alone do not count against a worker where batching
//!   them is nearly free; queued prompts, slower steps and a full batch do.

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
    /// Its decode step in seconds, `step_base + step_per_seq * batch`, as it measured it;
    /// both 0 until it has decoded.
    pub step_base: f64,
    pub step_per_seq: f64,
    /// Sequences it runs at once (0: unknown, no limit assumed).
    pub max_running: f64,
}

/// What a policy knows of the request.
#[derive(Clone, Copy, Debug)]
pub struct RequestShape {
    pub prompt_tokens: usize,
    pub block_size: usize,
    /// Tokens it is expected to generate (at least 1).
    pub output_tokens: usize,
}

/// Tuning of the `prefix` policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefixTuning {
    /// A worker is a candidate only while its backlog (the expected time a request spends
    /// there apart from computing its own prompt) is at most `1 + max_imbalance` times the
    /// lowest among the workers (or it holds at most two requests more than the
    /// least-loaded one).
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
        Policy::LeastLoaded | Policy::PowerOfTwo => {
            argmin(cands, turn, |c| cost(policy, c, req), |_| true)
        }
        Policy::Prefix => {
            let floor = cands
                .iter()
                .map(|c| backlog(c, req))
                .fold(f64::INFINITY, f64::min);
            // An infinite bound is none (also where the lowest backlog is 0).
            let bound = if tuning.max_imbalance.is_finite() {
                floor * (1.0 + tuning.max_imbalance.max(0.0))
            } else {
                f64::INFINITY
            };
            let fewest = cands.iter().map(|c| c.load).fold(f64::INFINITY, f64::min);
            // Out only when unbalanced both relatively and by whole requests, so a near-idle
            // cluster is not split over timing noise.
            argmin(
                cands,
                turn,
                |c| cost(policy, c, req),
                |c| backlog(c, req) <= bound || c.load <= fewest + IMBALANCE_SLACK,
            )
        }
    }
}

/// Seconds the request would spend on this worker apart from computing its own prompt:
/// the prompts queued ahead of it, its decode in that batch, the wait for a slot. What the
/// prefix policy's imbalance bound compares: it grows with the work a worker holds only as
/// far as that work slows a newcomer there.
fn backlog(c: &Candidate, req: RequestShape) -> f64 {
    expected_time(c, 0.0, req.output_tokens.max(1) as f64)
}

/// The least a sequence is taken to add to a decode step, relative to the step's fixed
/// part (0.2%: 16 µs on an 8 ms step).
const MIN_SLOPE: f64 = 0.002;

/// Seconds the request costs the cluster on this worker when `uncached` of its prompt
/// tokens must be computed: its own wait, prefill and decode, and the time it adds to the
/// sequences already there.
fn expected_time(c: &Candidate, uncached: f64, out: f64) -> f64 {
    let n = c.load.max(0.0);
    let limit = if c.max_running >= 1.0 {
        c.max_running
    } else {
        f64::INFINITY
    };
    // The prompts queued ahead of it, then its own. (Its prefill also stalls the
    // sequences decoding there; that delays their tokens, not anyone's first token, and
    // weighing it made cache hits look dearer than they are.)
    let prompt = (c.queued_prompt_tokens + uncached) / c.prefill_rate.max(1e-9);
    let measured = c.step_base > 0.0 || c.step_per_seq > 0.0;
    if !measured {
        // Served in turn at the declared per-sequence rate.
        return prompt + out * (n + 1.0) / c.capacity.max(1e-9);
    }
    let batch = (n + 1.0).min(limit);
    // A fit that saw one batch size only says nothing of the slope; a step never gets
    // cheaper with more sequences, and a small floor keeps equal workers sharing equally
    // instead of one taking everything on a timing-noise difference in their bases.
    let per_seq = c.step_per_seq.max(c.step_base * MIN_SLOPE);
    let step = c.step_base + per_seq * batch;
    // Each of the others there runs a little slower while it decodes.
    let slowdown = per_seq * (batch - 1.0);
    // Past the batch limit it waits for a slot; slots free as sequences finish.
    let queue = if n + 1.0 > limit {
        (n + 1.0 - limit) / limit * out * step
    } else {
        0.0
    };
    prompt + out * (step + slowdown) + queue
}

/// What a policy minimises for a candidate (round-robin has no cost: 0).
pub fn cost(policy: Policy, c: &Candidate, req: RequestShape) -> f64 {
    let out = req.output_tokens.max(1) as f64;
    match policy {
        Policy::RoundRobin => 0.0,
        Policy::LeastLoaded | Policy::PowerOfTwo => expected_time(c, req.prompt_tokens as f64, out),
        Policy::Prefix => {
            let cached = (c.cached_blocks * req.block_size).min(req.prompt_tokens);
            expected_time(c, (req.prompt_tokens - cached) as f64, out)
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
    // From `start` to the end, then from the front (no division per candidate).
    for i in (start..n).chain(0..start) {
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
/// forgotten after [`PENDING_FOR`] or when the worker reports them). The router keeps a
/// [`KvIndex`](crate::kv_index::KvIndex) instead, which answers the same for every worker at
/// once; this one-worker form is what it is tested against.
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
            step_base: 0.0,
            step_per_seq: 0.0,
            max_running: 0.0,
        }
    }

    /// As `c`, with a measured decode step of 10 ms + 0.5 ms per sequence: batching is
    /// cheap there.
    fn batched(load: f64, cached_blocks: usize) -> Candidate {
        Candidate {
            step_base: 0.010,
            step_per_seq: 0.0005,
            ..c(load, 100.0, cached_blocks)
        }
    }

    /// Speed `speed` on the sim's default timing (8 ms + 0.1 ms per sequence per step),
    /// prompts free, no batch limit.
    fn sim(speed: f64, base_ms: f64, per_seq_ms: f64) -> Candidate {
        Candidate {
            step_base: base_ms / 1e3 / speed,
            step_per_seq: per_seq_ms / 1e3 / speed,
            prefill_rate: 1e12,
            ..c(0.0, 100.0, 0)
        }
    }

    /// Each pick adds one request; how many each worker got.
    fn assign(policy: Policy, cs: &mut [Candidate], n: u64) -> Vec<usize> {
        let mut counts = vec![0; cs.len()];
        for t in 0..n {
            let i = pick_(policy, cs, t).unwrap();
            counts[i] += 1;
            cs[i].load += 1.0;
        }
        counts
    }

    #[test]
    fn least_loaded_packs_a_fast_node_where_batching_is_nearly_free() {
        // 1x and 3x on 8 ms + 0.1 ms per sequence: 48 sequences all on the 3x node step in
        // 4.3 ms, faster than one alone on the 1x node (8.1 ms).
        let mut cs = vec![sim(1.0, 8.0, 0.1), sim(3.0, 8.0, 0.1)];
        assert_eq!(assign(Policy::LeastLoaded, &mut cs, 48), [0, 48]);
        // Where each sequence costs more than the step's fixed part, work splits by speed.
        let mut cs = vec![sim(1.0, 1.0, 1.0), sim(3.0, 1.0, 1.0)];
        let counts = assign(Policy::LeastLoaded, &mut cs, 400);
        assert!((290..=310).contains(&counts[1]), "{counts:?}");
        // Equal nodes share equally.
        let mut cs = vec![sim(2.0, 8.0, 0.1); 4];
        assert_eq!(assign(Policy::LeastLoaded, &mut cs, 40), [10; 4]);
    }

    #[test]
    fn equal_workers_with_flat_fits_share_despite_noise_in_their_bases() {
        // Both fits saw one batch size (no slope); their bases differ by timing noise.
        let mut cs = vec![sim(1.0, 8.0, 0.0), sim(1.0, 8.05, 0.0)];
        let counts = assign(Policy::LeastLoaded, &mut cs, 40);
        assert!((17..=23).contains(&counts[0]), "{counts:?}");
        // A node three times as fast still takes everything (its step at 40 is 2.9 ms).
        let mut cs = vec![sim(1.0, 8.0, 0.0), sim(3.0, 8.0, 0.0)];
        assert_eq!(assign(Policy::LeastLoaded, &mut cs, 40), [0, 40]);
    }

    #[test]
    fn least_loaded_stops_packing_at_the_batch_limit() {
        // 3x and 1x, flat steps, four sequences at once each: past four, requests wait for
        // a slot on the fast node until that wait outweighs the slow node's step.
        let mut cs = vec![sim(1.0, 12.0, 0.0), sim(3.0, 12.0, 0.0)];
        for cand in cs.iter_mut() {
            cand.max_running = 4.0;
        }
        let counts = assign(Policy::LeastLoaded, &mut cs, 16);
        assert!(counts[0] >= 1 && counts[1] > counts[0], "{counts:?}");
        let unlimited = assign(
            Policy::LeastLoaded,
            &mut [sim(1.0, 12.0, 0.0), sim(3.0, 12.0, 0.0)],
            16,
        );
        assert_eq!(unlimited, [0, 16]);
    }

    #[test]
    fn least_loaded_weighs_the_prompt_against_the_queue() {
        // Same steps; one node has 2000 prompt tokens queued (2 s at 1000 tokens/s).
        let mut busy = batched(0.0, 0);
        busy.queued_prompt_tokens = 2000.0;
        let cs = vec![busy, batched(3.0, 0)];
        assert_eq!(pick_(Policy::LeastLoaded, &cs, 0), Some(1));
        // Each sequence in a batch slows the step a little: with equal queues, the emptier
        // node wins.
        let mut cs = vec![batched(20.0, 0), batched(2.0, 0)];
        for cand in cs.iter_mut() {
            cand.prefill_rate = 500.0;
        }
        assert_eq!(pick_(Policy::LeastLoaded, &cs, 0), Some(1));
    }

    /// 8 blocks of 16 tokens, 16 tokens out.
    const SHAPE: RequestShape = RequestShape {
        prompt_tokens: 128,
        block_size: 16,
        output_tokens: 16,
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
        // Not yet measured: served in turn at the declared rate, prompts free.
        let mut cs = vec![c(0.0, 100.0, 0), c(0.0, 300.0, 0)];
        for cand in cs.iter_mut() {
            cand.prefill_rate = 1e12;
        }
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
        let cs = vec![batched(1.0, 0), batched(1.0, 8)];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(1));
        // A little more load does not move a cached conversation: 128 uncached tokens take
        // 128 ms, one more sequence in the batch about 16 ms over the answer.
        let cs = vec![batched(0.0, 0), batched(1.0, 8)];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(1));
        // Prompt work already queued there outweighs the hit.
        let mut busy = batched(1.0, 8);
        busy.queued_prompt_tokens = 400.0;
        let cs = vec![batched(1.0, 0), busy];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(0));
        // A fast prefill makes the hit worth little: the decode term decides.
        let mut fast = vec![batched(0.0, 0), batched(3.0, 8)];
        fast[0].prefill_rate = 1e6;
        fast[1].prefill_rate = 1e6;
        assert_eq!(pick_(Policy::Prefix, &fast, 0), Some(0));
    }

    #[test]
    fn prefix_hits_may_not_unbalance_the_cluster_past_the_bound() {
        // Every request shares a prefix only worker 1 holds; with slow prefill (100 tokens
        // per second) the hit is worth 1.28 s. Each sequence adds 0.5 ms to a 10 ms step
        // and slows the others as much: with n there, a request's 16 tokens take
        // 16 * (10.5 + n) ms, so the hit outweighs up to 80 more requests.
        let share = |max_imbalance: f64| {
            let mut cs = vec![batched(0.0, 0), batched(0.0, 8)];
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
        assert_eq!(share(f64::INFINITY), [0, 60]);
        // Backlog at most twice the other's: 10.5 + n <= 2 (10.5 + m), n + m = 60.
        let [a, b] = share(1.0);
        assert!((17..=18).contains(&a), "{a}/{b}");
        // A stricter bound shares more evenly: 10.5 + n <= 1.2 (10.5 + m).
        let [a, b] = share(0.2);
        assert!((26..=27).contains(&a), "{a}/{b}");
    }

    #[test]
    fn a_conversation_keeps_its_cache_where_batching_more_requests_is_cheap() {
        // Slow prefill (100 tokens per second): the 128 cached tokens are worth 1.28 s,
        // more than any wait below, so where the holder is left out it is the bound's doing.
        let slow = |load: f64, cached: usize| Candidate {
            prefill_rate: 100.0,
            ..batched(load, cached)
        };
        // The holder runs six sequences, the other one: six times the requests, but a
        // newcomer's 16 tokens take 264 ms there against 184 ms, well inside the bound.
        let cs = vec![slow(1.0, 0), slow(6.0, 8)];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(1));
        // A full batch there (four at once; a slot frees as one of them ends) makes the
        // newcomer's wait 0.65 s, past twice the other's.
        let mut full = slow(12.0, 8);
        full.max_running = 4.0;
        let cs = vec![slow(1.0, 0), full];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(0));
        // So do prompts queued there: 50 tokens, 0.5 s.
        let mut queued = slow(4.0, 8);
        queued.queued_prompt_tokens = 50.0;
        let cs = vec![slow(1.0, 0), queued.clone()];
        assert_eq!(pick_(Policy::Prefix, &cs, 0), Some(0));
        // Unbounded, both would keep the conversation.
        let unbounded = PrefixTuning { max_imbalance: 1e9 };
        let cs = vec![slow(1.0, 0), queued];
        assert_eq!(pick(Policy::Prefix, &cs, SHAPE, 0, unbounded), Some(1));
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
