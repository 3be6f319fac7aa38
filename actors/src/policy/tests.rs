use std::collections::HashSet;

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
