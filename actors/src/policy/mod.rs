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

mod cost;
mod prefill;

use std::str::FromStr;

use cost::{backlog, expected_time};

pub use cost::{Candidate, RequestShape};
pub use prefill::{pick_prefill, PrefillCandidate};

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

#[cfg(test)]
mod tests;
