//! Engines on a shared driver (`shared`): the same tokens as on threads of their own, each
//! step's modelled time waited out, transfers told of every layer, aborts mid-step.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::transfer_tests::{small_spec, timed_sim, BLOCKS, VOCAB};
use super::*;
use crate::backend::sim::{SimBackend, SimTiming};
use crate::sampler::SamplingParams;

const DECODE_STEP: Duration = Duration::from_millis(3);

fn sim(timing: SimTiming) -> Box<SimBackend> {
    Box::new(timed_sim(timing, small_spec()))
}

/// Decode steps take `DECODE_STEP`; prompt tokens 100 us each.
fn timed() -> SimTiming {
    SimTiming {
        prefill_per_token: Duration::from_micros(100),
        decode_base: DECODE_STEP,
        decode_per_seq: Duration::ZERO,
        speed: 1.0,
    }
}

fn cfg(max_num_batched_tokens: usize) -> EngineConfig {
    EngineConfig {
        max_model_len: 100,
        block_size: 4,
        max_num_batched_tokens,
        ..Default::default()
    }
}

fn request(seed: u32, n: usize) -> Request {
    Request {
        prompt: (0..9 + seed % 7).map(|t| (t * 7 + seed) % 60).collect(),
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: n,
            ignore_eos: true,
            ..Default::default()
        },
    }
}

fn all_free(h: &EngineHandle) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if h.stats.free_blocks.load(Ordering::Relaxed) == BLOCKS {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn many_engines_on_two_threads_answer_as_engines_on_their_own_and_wait_out_the_model() {
    let pool = Arc::new(EnginePool::new(2));
    const ENGINES: u32 = 120;
    const TOKENS: usize = 8;
    let handles: Vec<EngineHandle> = (0..ENGINES)
        .map(|_| pool.spawn(sim(timed()), cfg(64), vec![], VOCAB))
        .collect();
    assert_eq!(pool.len(), ENGINES as usize);
    // Every engine busy at once, each from a thread of the test's.
    let runs: Vec<_> = handles
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let h = h.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut sub = h.submit(request(i as u32, TOKENS)).unwrap();
                let out = tests::drain(&mut sub);
                (out, started.elapsed())
            })
        })
        .collect();
    for (i, run) in runs.into_iter().enumerate() {
        let (out, took) = run.join().unwrap();
        // The same engine on a thread of its own, its time not modelled.
        let alone = spawn(sim(SimTiming::zero()), cfg(64), vec![], VOCAB);
        let want = tests::drain(&mut alone.submit(request(i as u32, TOKENS)).unwrap());
        assert_eq!(out, want, "engine {i}");
        // One prefill step, then a decode step for each token after the first; a step
        // that started late is paid back by the next ones, by `MAX_OWED` at most.
        let modelled = DECODE_STEP * (TOKENS as u32 - 1);
        assert!(
            took + super::shared::MAX_OWED >= modelled,
            "engine {i} answered in {took:?}, under the {modelled:?} its steps model"
        );
    }
    for h in &handles {
        assert!(all_free(h));
    }
}

#[test]
fn a_deferred_export_reports_every_layer_at_each_chunks_end() {
    let pool = EnginePool::new(1);
    // Chunks of 8 tokens: a 21-token prompt is computed in three steps.
    let h = pool.spawn(sim(timed()), cfg(8), vec![], VOCAB);
    let prompt: Vec<u32> = (0..21).map(|t| (t * 5 + 1) % 60).collect();
    let mut req = request(0, 1);
    req.prompt = prompt.clone();
    let (mut sub, mut ev) = h.submit_export(req.clone(), 4).unwrap();
    let first = tests::drain(&mut sub);
    let ExportEvent::Ready { lease, .. } = ev.blocking_recv().unwrap() else {
        panic!("Ready comes first");
    };
    let mut seen = vec![Vec::new(); 3];
    while let Ok(e) = ev.try_recv() {
        if let ExportEvent::Layer { layer, upto } = e {
            seen[layer].push(upto);
        }
    }
    for s in &seen {
        assert_eq!(s, &[8, 16, 21], "each layer reported after each chunk");
    }
    let alone = spawn(sim(SimTiming::zero()), cfg(8), vec![], VOCAB);
    assert_eq!(first, tests::drain(&mut alone.submit(req).unwrap()));
    drop(lease);
    assert!(all_free(&h));
}

#[test]
fn a_request_dropped_while_its_step_is_timed_frees_its_blocks() {
    let pool = EnginePool::new(1);
    let slow = SimTiming {
        decode_base: Duration::from_millis(50),
        ..timed()
    };
    let h = pool.spawn(sim(slow), cfg(64), vec![], VOCAB);
    let mut sub = h.submit(request(3, 50)).unwrap();
    // Its first token, then it is dropped in the middle of a 50 ms decode step.
    assert!(matches!(
        sub.events.blocking_recv(),
        Some(SeqEvent::Token { .. })
    ));
    assert!(h.stats.free_blocks.load(Ordering::Relaxed) < BLOCKS);
    drop(sub);
    assert!(all_free(&h), "the abort was read after the step");
    // The engine serves on.
    let mut again = h.submit(request(4, 2)).unwrap();
    assert_eq!(tests::drain(&mut again).len(), 2);
}
