//! The engine end to end on backends with no math: what it schedules, what every sequence
//! is sent, and its limits.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::*;
use crate::backend::error::{BackendError, StateError};
use crate::backend::{Backend, ForwardBatch};
use crate::error::{EngineError, Result};
use crate::sampler::SamplingParams;

/// Per step: each sequence's (start position, tokens, wants logits).
type StepLog = Arc<Mutex<Vec<Vec<(usize, usize, bool)>>>>;

/// A backend with no math: the next token is `(last token + position) % vocab`, so
/// outputs depend on the whole schedule being right; it records every batch's shape.
struct Recorder {
    blocks: usize,
    vocab: usize,
    log: StepLog,
}

impl Backend for Recorder {
    fn device(&self) -> String {
        "test".into()
    }
    fn num_blocks(&self) -> usize {
        self.blocks
    }
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        self.log.lock().unwrap().push(
            batch
                .seqs
                .iter()
                .map(|s| (s.start_pos, s.tokens.len(), s.want_logits))
                .collect(),
        );
        Ok(batch
            .seqs
            .iter()
            .filter(|s| s.want_logits)
            .map(|s| {
                let last = *s.tokens.last().unwrap() as usize;
                let pos = s.start_pos + s.tokens.len() - 1;
                let mut l = vec![0.0; self.vocab];
                l[(last + pos) % self.vocab] = 10.0;
                l
            })
            .collect())
    }
}

fn expected(prompt: &[u32], n: usize, vocab: usize) -> Vec<u32> {
    let mut toks = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = ((*toks.last().unwrap() as usize + toks.len() - 1) % vocab) as u32;
        toks.push(t);
        out.push(t);
    }
    out
}

/// Every token of a finished submission.
pub(super) fn drain(sub: &mut Submission) -> Vec<u32> {
    let mut out = Vec::new();
    loop {
        match sub.events.blocking_recv().expect("event") {
            SeqEvent::Token {
                sampled, finish, ..
            } => {
                out.push(sampled.token);
                if finish.is_some() {
                    sub.finished();
                    return out;
                }
            }
            SeqEvent::Failed(m) => panic!("{m}"),
        }
    }
}

/// Logits that leave sampling at temperature 1 genuinely random: a small wave over the
/// vocabulary that shifts with the last token and the position.
struct Flat {
    vocab: usize,
}

impl Backend for Flat {
    fn device(&self) -> String {
        "flat".into()
    }
    fn num_blocks(&self) -> usize {
        64
    }
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        Ok(batch
            .seqs
            .iter()
            .filter(|s| s.want_logits)
            .map(|s| {
                let last = *s.tokens.last().unwrap() as usize;
                let pos = s.start_pos + s.tokens.len() - 1;
                (0..self.vocab)
                    .map(|i| ((i * 7 + last * 3 + pos) % 11) as f32 * 0.1)
                    .collect()
            })
            .collect())
    }
}

/// A seeded sequence continued elsewhere (its tokens so far appended to the prompt and
/// the generator's spent draws skipped) goes on exactly as it would have.
#[test]
fn a_seeded_sequence_resumed_with_its_draws_continues_identically() {
    let vocab = 50;
    let h = spawn(
        Box::new(Flat { vocab }),
        EngineConfig {
            max_model_len: 128,
            block_size: 4,
            ..Default::default()
        },
        vec![],
        vocab,
    );
    let params = |max_tokens: usize, resume_draws: u64| SamplingParams {
        temperature: 1.0,
        seed: Some(42),
        max_tokens,
        ignore_eos: true,
        resume_draws,
        ..Default::default()
    };
    let prompt: Vec<u32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let run = |prompt: Vec<u32>, p: SamplingParams| {
        let mut sub = h.submit(Request { prompt, params: p }).unwrap();
        drain(&mut sub)
    };
    let whole = run(prompt.clone(), params(30, 0));
    assert_eq!(
        whole,
        run(prompt.clone(), params(30, 0)),
        "seeded runs repeat"
    );
    let cut = 12;
    let resumed_prompt = [&prompt[..], &whole[..cut]].concat();
    let rest = run(resumed_prompt.clone(), params(30 - cut, cut as u64));
    assert_eq!(rest, whole[cut..]);
    // Without skipping the draws the continuation is another one: the test can fail.
    let naive = run(resumed_prompt, params(30 - cut, 0));
    assert_ne!(naive, whole[cut..]);
}

/// A backend that keeps no host-visible KV.
pub(super) struct NoHostKv;

impl Backend for NoHostKv {
    fn device(&self) -> String {
        "nohost".into()
    }
    fn num_blocks(&self) -> usize {
        8
    }
    fn forward(&mut self, _: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        Ok(vec![])
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn admission_refuses_only_beyond_running_plus_waiting() {
    let vocab = 97;
    let cfg = EngineConfig {
        max_model_len: 64,
        max_num_seqs: 2,
        max_num_batched_tokens: 64,
        block_size: 4,
        max_waiting: 2,
        enable_prefix_caching: false,
    };
    let h = spawn(
        Box::new(Recorder {
            blocks: 64,
            vocab,
            log: Arc::new(Mutex::new(Vec::new())),
        }),
        cfg,
        vec![],
        vocab,
    );
    let req = || Request {
        prompt: vec![1, 2, 3],
        params: greedy(6),
    };
    let full = |r: Result<Submission>| matches!(r, Err(EngineError::QueueFull { .. }));
    for round in 0..20 {
        // Four at once, before the engine thread has seen any: two run, two wait.
        let mut subs: Vec<Submission> = (0..4)
            .map(|i| {
                h.submit(req())
                    .unwrap_or_else(|e| panic!("round {round}, request {i}: {e}"))
            })
            .collect();
        assert!(full(h.submit(req())), "round {round}: a fifth has no place");
        // A finished request frees its place as soon as its last token is read.
        drain(&mut subs[0]);
        subs[0] = h.submit(req()).expect("the finished request's place");
        // So does a dropped one.
        subs.pop();
        subs.push(h.submit(req()).expect("the dropped request's place"));
        assert!(full(h.submit(req())));
        for s in &mut subs {
            drain(s);
        }
    }
}

/// `Recorder` on a backend that takes at most `.1` tokens a step (as CUDA's prefill grid).
struct Capped(Recorder, usize);

impl Backend for Capped {
    fn device(&self) -> String {
        self.0.device()
    }
    fn num_blocks(&self) -> usize {
        self.0.num_blocks()
    }
    fn max_step_tokens(&self) -> Option<usize> {
        Some(self.1)
    }
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        self.0.forward(batch)
    }
}

#[test]
fn the_step_budget_is_capped_at_what_the_backend_takes() {
    let log = StepLog::default();
    let vocab = 97;
    let cfg = EngineConfig {
        max_model_len: 64,
        max_num_seqs: 2,
        max_num_batched_tokens: 64,
        block_size: 4,
        max_waiting: 4,
        enable_prefix_caching: false,
    };
    let backend = Capped(
        Recorder {
            blocks: 64,
            vocab,
            log: log.clone(),
        },
        5,
    );
    let h = spawn(Box::new(backend), cfg, vec![], vocab);
    let prompt: Vec<u32> = (1..=23).collect();
    let mut sub = h
        .submit(Request {
            prompt: prompt.clone(),
            params: greedy(4),
        })
        .unwrap();
    assert_eq!(drain(&mut sub), expected(&prompt, 4, vocab));
    let steps = log.lock().unwrap();
    assert!(
        steps.len() >= 5,
        "a 23-token prompt in steps of 5: {steps:?}"
    );
    for step in steps.iter() {
        let tokens: usize = step.iter().map(|s| s.1).sum();
        assert!(tokens <= 5, "a step of {tokens} tokens: {steps:?}");
    }
}

#[test]
fn budgets_chunking_and_preemption_keep_outputs_exact() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let vocab = 97;
    let cfg = EngineConfig {
        max_model_len: 256,
        max_num_seqs: 3,
        max_num_batched_tokens: 20,
        block_size: 4,
        max_waiting: 100,
        enable_prefix_caching: true,
    };
    // 24 blocks of 4 tokens cannot hold five 50-token sequences at once.
    let h = spawn(
        Box::new(Recorder {
            blocks: 24,
            vocab,
            log: log.clone(),
        }),
        cfg,
        vec![],
        vocab,
    );
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| (0..(13 + 7 * i)).map(|t| (t * 3 + i) as u32 % 90).collect())
        .collect();
    let mut subs: Vec<Submission> = prompts
        .iter()
        .map(|p| {
            h.submit(Request {
                prompt: p.clone(),
                params: greedy(25),
            })
            .unwrap()
        })
        .collect();
    for (p, sub) in prompts.iter().zip(subs.iter_mut()) {
        assert_eq!(drain(sub), expected(p, 25, vocab));
    }
    let log = log.lock().unwrap();
    for step in log.iter() {
        assert!(step.len() <= 3, "max_num_seqs exceeded: {step:?}");
        assert!(
            step.iter().map(|s| s.1).sum::<usize>() <= 20,
            "token budget exceeded: {step:?}"
        );
    }
    assert!(
        log.iter()
            .any(|s| s.iter().any(|&(start, n, want)| start > 0 && n > 1 && want)),
        "a prompt was chunked"
    );
    assert!(
        h.stats.preemptions.load(Ordering::Relaxed) > 0,
        "blocks ran out, so something was preempted"
    );
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        h.stats.free_blocks.load(Ordering::Relaxed),
        24,
        "every block is free again"
    );
}

#[test]
fn prefix_cache_skips_computed_blocks_and_eos_stops() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let vocab = 50;
    let cfg = EngineConfig {
        block_size: 4,
        max_model_len: 100,
        ..Default::default()
    };
    let h = spawn(
        Box::new(Recorder {
            blocks: 64,
            vocab,
            log: log.clone(),
        }),
        cfg,
        vec![],
        vocab,
    );
    let prompt: Vec<u32> = (0..18).collect();
    let mut a = h
        .submit(Request {
            prompt: prompt.clone(),
            params: greedy(3),
        })
        .unwrap();
    let first = drain(&mut a);
    let mut b = h
        .submit(Request {
            prompt: prompt.clone(),
            params: greedy(3),
        })
        .unwrap();
    assert_eq!(drain(&mut b), first);
    let log = log.lock().unwrap();
    // The second run's prefill starts after the 4 cached blocks (16 tokens).
    let second_prefill = log.iter().rev().find(|s| s[0].1 > 1).unwrap();
    assert_eq!(second_prefill[0], (16, 2, true));
    assert_eq!(h.stats.prefix_hits.load(Ordering::Relaxed), 16);
    drop(log);
    // A stop token ends the sequence with reason Stop.
    let stop = expected(&prompt, 2, vocab)[1];
    let mut c = h
        .submit(Request {
            prompt,
            params: SamplingParams {
                stop_token_ids: vec![stop],
                ..greedy(10)
            },
        })
        .unwrap();
    assert_eq!(drain(&mut c).len(), 2);
}

#[test]
fn oversized_requests_are_refused_with_both_lengths() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let cfg = EngineConfig {
        max_model_len: 32,
        block_size: 4,
        ..Default::default()
    };
    let h = spawn(
        Box::new(Recorder {
            blocks: 64,
            vocab: 10,
            log,
        }),
        cfg,
        vec![],
        10,
    );
    let e = h
        .submit(Request {
            prompt: vec![1; 30],
            params: greedy(5),
        })
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("30") && e.contains('5') && e.contains("32"),
        "{e}"
    );
    let e = h
        .submit(Request {
            prompt: vec![11],
            params: greedy(1),
        })
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("vocabulary"), "{e}");
}

/// Guided sequences batched with free ones, sampled at temperature 1 over logits that do
/// not care for the grammar: each guided output is one its grammar allows and ends there
/// (the mask leaves only eos once the grammar is complete); the free ones are untouched.
#[test]
fn guided_sequences_follow_their_grammars_in_a_mixed_batch() {
    use crate::guided::{grammar, Guide, LazyGuides};
    let tok = Arc::new(
        crate::tokenizer::TextTokenizer::from_files(&crate::embedded::default_tokenizer(), &[])
            .unwrap(),
    );
    let vocab = tok.vocab_size();
    let eos = tok.eos_ids().to_vec();
    let h = spawn(
        Box::new(Flat { vocab }),
        EngineConfig {
            max_model_len: 256,
            block_size: 4,
            ..Default::default()
        },
        eos.clone(),
        vocab,
    );
    // Without a tokenizer the engine cannot follow a grammar, and says so.
    let choice = Guide::new(&grammar::choice(&["thee".into(), "thou art".into()]));
    let req = |seed: u64, guide: Option<Guide>| Request {
        prompt: vec![5, 6, 7],
        params: SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens: 40,
            ignore_eos: true,
            guide,
            ..Default::default()
        },
    };
    let e = h
        .submit(req(1, Some(choice.clone())))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("grammar"), "{e}");
    let h = h.with_guides(Arc::new(LazyGuides::new(tok.clone(), vocab)));
    let rx = Guide::new(&grammar::regex("[0-9]{2,4}-[a-z]{3}"));
    let mut subs = Vec::new();
    for seed in 0..4 {
        subs.push(("choice", h.submit(req(seed, Some(choice.clone()))).unwrap()));
        subs.push(("regex", h.submit(req(seed, Some(rx.clone()))).unwrap()));
        subs.push(("free", h.submit(req(seed, None)).unwrap()));
    }
    for (kind, mut s) in subs {
        let out = drain(&mut s);
        let text = tok.decode(&out, true).unwrap();
        match kind {
            "choice" => assert!(text == "thee" || text == "thou art", "{text:?}"),
            "regex" => {
                let (d, w) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
                assert!((2..=4).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit()));
                assert!(
                    w.len() == 3 && w.bytes().all(|b| b.is_ascii_lowercase()),
                    "{text:?}"
                );
            }
            _ => assert_eq!(out.len(), 40, "a free sequence runs to max_tokens"),
        }
        if kind != "free" {
            assert!(
                out.len() < 40,
                "{kind} did not end with its grammar: {text:?}"
            );
        }
    }
    // A replay the grammar does not allow is refused at submission.
    let bad = Guide {
        replay: 2,
        ..rx.clone()
    };
    assert!(h.submit(req(9, Some(bad))).is_err());
}

/// A backend with a recurrent state and no math: each state slot remembers the tokens it
/// has run, and the next token is a hash of them. It fails the step if a slot is shared
/// within a batch, or continued by a chunk that does not start where it left off, so
/// outputs are exact only if every sequence keeps its own state from its first token on.
struct Recurrent {
    blocks: usize,
    vocab: usize,
    /// The running slots, then `saved` snapshot slots.
    slots: Vec<Vec<u32>>,
    saved: usize,
    /// Most slots held at once.
    most: Arc<Mutex<usize>>,
}

fn recurrent_next(history: &[u32], vocab: usize) -> u32 {
    let h = history
        .iter()
        .fold(7u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64));
    (h % vocab as u64) as u32
}

impl Backend for Recurrent {
    fn device(&self) -> String {
        "recurrent".into()
    }
    fn num_blocks(&self) -> usize {
        self.blocks
    }
    fn num_state_slots(&self) -> usize {
        self.slots.len() - self.saved
    }
    fn num_state_snapshots(&self) -> usize {
        self.saved
    }
    fn copy_state(&mut self, from: u32, to: u32) -> Result<()> {
        self.slots[to as usize] = self.slots[from as usize].clone();
        Ok(())
    }
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for (seq, s) in batch.seqs.iter().enumerate() {
            let slot = s.state_slot.expect("a slot for every sequence") as usize;
            if seen.contains(&slot) {
                let slots = self.num_state_slots();
                let slot = s.state_slot;
                return Err(StateError::NotOwn { seq, slot, slots }.into());
            }
            seen.push(slot);
            let state = &mut self.slots[slot];
            if s.start_pos == 0 {
                state.clear();
            }
            if state.len() != s.start_pos {
                return Err(BackendError::Invariant(
                    "a state slot continued at a position other than its length",
                )
                .into());
            }
            state.extend_from_slice(s.tokens);
            if s.want_logits {
                let mut l = vec![0.0; self.vocab];
                l[recurrent_next(state, self.vocab) as usize] = 10.0;
                out.push(l);
            }
        }
        let mut most = self.most.lock().unwrap();
        *most = (*most).max(seen.len());
        Ok(out)
    }
}

fn recurrent_expected(prompt: &[u32], n: usize, vocab: usize) -> Vec<u32> {
    let mut toks = prompt.to_vec();
    for _ in 0..n {
        toks.push(recurrent_next(&toks, vocab));
    }
    toks.split_off(prompt.len())
}

/// State slots under chunking, a slot limit below `max_num_seqs`, and preemption for
/// blocks: every sequence's state continues exactly, no more run than there are slots,
/// nothing resumes from the prefix cache (prefix caching is turned off), and every slot is
/// free at the end.
#[test]
fn state_slots_under_admission_and_preemption_keep_outputs_exact() {
    let vocab = 97;
    let most = Arc::new(Mutex::new(0));
    let cfg = EngineConfig {
        max_model_len: 256,
        max_num_seqs: 4,
        max_num_batched_tokens: 20,
        block_size: 4,
        max_waiting: 100,
        enable_prefix_caching: true,
    };
    // 20 blocks of 4 tokens cannot hold three 45-token sequences; 3 slots for 4 seqs.
    let h = spawn(
        Box::new(Recurrent {
            blocks: 20,
            vocab,
            slots: vec![Vec::new(); 3],
            saved: 0,
            most: most.clone(),
        }),
        cfg,
        vec![],
        vocab,
    );
    assert!(!h.info.config.enable_prefix_caching);
    assert_eq!(h.info.num_state_slots, 3);
    // Two of each prompt: equal prefixes must not share state either.
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            (0..(13 + 4 * (i / 2)))
                .map(|t| (t * 5 + i / 2) as u32 % 90)
                .collect()
        })
        .collect();
    let mut subs: Vec<Submission> = prompts
        .iter()
        .map(|p| {
            h.submit(Request {
                prompt: p.clone(),
                params: greedy(30),
            })
            .unwrap()
        })
        .collect();
    for (p, sub) in prompts.iter().zip(subs.iter_mut()) {
        assert_eq!(drain(sub), recurrent_expected(p, 30, vocab));
    }
    assert!(*most.lock().unwrap() <= 3, "more sequences ran than slots");
    assert!(
        h.stats.preemptions.load(Ordering::Relaxed) > 0,
        "blocks ran out, so something was preempted"
    );
    assert_eq!(h.stats.prefix_hits.load(Ordering::Relaxed), 0);
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(h.stats.free_state_slots.load(Ordering::Relaxed), 3);
    assert_eq!(h.stats.free_blocks.load(Ordering::Relaxed), 20);
}

/// Saved states under the same load, with prefixes shared between requests: sequences
/// resume at cached prefixes (the backend's slot must then hold exactly the prefix's
/// tokens, or the step fails), outputs stay those of a fresh computation, and the hits are
/// counted.
#[test]
fn saved_states_resume_shared_prefixes_exactly() {
    let vocab = 97;
    let cfg = EngineConfig {
        max_model_len: 256,
        max_num_seqs: 3,
        max_num_batched_tokens: 20,
        block_size: 4,
        max_waiting: 100,
        enable_prefix_caching: true,
    };
    let h = spawn(
        Box::new(Recurrent {
            blocks: 40,
            vocab,
            slots: vec![Vec::new(); 3 + 16],
            saved: 16,
            most: Arc::new(Mutex::new(0)),
        }),
        cfg,
        vec![],
        vocab,
    );
    assert!(h.info.config.enable_prefix_caching);
    assert_eq!(
        (h.info.num_state_slots, h.info.num_state_snapshots),
        (3, 16)
    );
    // One system prompt, several questions; then a second turn of the first.
    let system: Vec<u32> = (0..21).map(|t| (t * 7 % 90) as u32).collect();
    let ask = |q: u32| {
        let mut p = system.clone();
        p.extend((0..3 + q).map(|t| 50 + q + t));
        p
    };
    let first = ask(0);
    let answer = drain(
        &mut h
            .submit(Request {
                prompt: first.clone(),
                params: greedy(12),
            })
            .unwrap(),
    );
    assert_eq!(answer, recurrent_expected(&first, 12, vocab));
    let mut turn = first.clone();
    turn.extend(&answer);
    turn.extend([3, 1, 4]);
    let prompts: Vec<Vec<u32>> = std::iter::once(turn).chain((1..5).map(ask)).collect();
    let mut subs: Vec<Submission> = prompts
        .iter()
        .map(|p| {
            h.submit(Request {
                prompt: p.clone(),
                params: greedy(10),
            })
            .unwrap()
        })
        .collect();
    for (p, sub) in prompts.iter().zip(subs.iter_mut()) {
        assert_eq!(drain(sub), recurrent_expected(p, 10, vocab));
    }
    // The second turn resumes at the first answer's last boundary (32 of its 39 tokens),
    // each question after the system prompt's last full block (20 of its 21 tokens).
    assert_eq!(h.stats.prefix_hits.load(Ordering::Relaxed), 32 + 4 * 20);
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(h.stats.free_state_slots.load(Ordering::Relaxed), 3);
    assert!(h.stats.saved_states.load(Ordering::Relaxed) > 0);
}
