//! The scheduler with saved recurrent states (see `snapshots`): where chunks stop, which
//! states are saved, and where a sequence resumes.

use super::request::SeqId;
use super::scheduler::{Entry, Limits, Place, Scheduler, SeqState, Transfer};

const BS: usize = 4;

/// Two running slots (ids 0, 1) and `saved` snapshot slots after them; blocks of 4 tokens.
fn sched(saved: usize) -> Scheduler<()> {
    let limits = Limits {
        max_num_seqs: 4,
        max_num_batched_tokens: 100,
        block_size: BS,
        enable_prefix_caching: true,
    };
    Scheduler::with_state_slots(limits, 100, 2, saved)
}

fn entry(id: u64, prompt: Vec<u32>) -> Entry<()> {
    Entry {
        seq: SeqState::new(SeqId(id), prompt, Transfer::Local),
        io: (),
    }
}

/// What ran (index, tokens) and the state copies after it (from, to).
type Stepped = (Vec<(usize, usize)>, Vec<(u32, u32)>);

/// Runs one step and returns what ran and the states saved after it; every sequence that
/// sampled gets `next` appended.
fn step(s: &mut Scheduler<()>, next: u32) -> Stepped {
    let plan = s.schedule();
    let saved = s.advance(&plan);
    for &(i, _) in &plan.run {
        let seq = &mut s.running[i].seq;
        if seq.num_computed == seq.tokens.len() {
            seq.tokens.push(next);
        }
    }
    (plan.run, saved)
}

#[test]
fn a_prompt_stops_at_its_last_boundary_and_its_state_is_saved_there() {
    let mut s = sched(2);
    s.waiting.push_back(entry(1, (0..10).collect()));
    // 10 tokens: the boundary before the last token is 8; the chunk stops there.
    let (run, saved) = step(&mut s, 0);
    assert_eq!(run, [(0, 8)]);
    let slot = s.running[0].seq.state_slot.unwrap();
    assert_eq!(saved.len(), 1);
    assert_eq!(saved[0].0, slot);
    assert!((2..4).contains(&saved[0].1), "a snapshot slot: {saved:?}");
    // The rest of the prompt saves nothing (10 is no boundary).
    let (run, saved) = step(&mut s, 50);
    assert_eq!((run, saved), (vec![(0, 2)], vec![]));
    assert_eq!(s.snapshots.len(), 1);
}

#[test]
fn decode_boundaries_replace_each_other_and_keep_the_prompts() {
    let mut s = sched(3);
    s.waiting.push_back(entry(1, (0..6).collect()));
    let (_, prompt_save) = step(&mut s, 0); // 0..4, saved
    step(&mut s, 60); // 4..6, samples 60
    step(&mut s, 61); // 6 (computed 7), samples 61
    let (_, first) = step(&mut s, 62); // 7 → computed 8: a decode boundary
    assert_eq!(first.len(), 1);
    for t in 63..66 {
        let (_, none) = step(&mut s, t);
        assert!(none.is_empty());
    }
    let (_, second) = step(&mut s, 66); // computed 12
    assert_eq!(second.len(), 1);
    assert_eq!(
        second[0].1, first[0].1,
        "the later boundary takes the earlier one's slot"
    );
    assert_ne!(second[0].1, prompt_save[0].1);
    assert_eq!(
        s.snapshots.len(),
        2,
        "the prompt's and the latest decode boundary's"
    );
}

#[test]
fn a_shared_prefix_resumes_at_its_saved_state_and_saves_its_own_boundary() {
    let mut s = sched(2);
    let first: Vec<u32> = (0..10).collect();
    s.waiting.push_back(entry(1, first.clone()));
    let (_, saved) = step(&mut s, 0);
    let snap = saved[0].1;
    step(&mut s, 90);
    // The second prompt shares the first 10 tokens and goes on: blocks 0 and 1 (to 8) are
    // cached with the state after them; block 2 (8..12) was the first's own.
    let mut second = first.clone();
    second.extend(20..25);
    s.waiting.push_back(entry(2, second));
    let plan = s.schedule();
    assert_eq!(plan.admitted, [(Place::Running(1), 8)]);
    let slot = s.running[1].seq.state_slot.unwrap();
    assert_eq!(plan.restores, [(snap, slot)]);
    // From 8 to its own boundary at 12, which it saves.
    assert!(plan.run.contains(&(1, 4)), "{:?}", plan.run);
    let saved = s.advance(&plan);
    assert!(saved.iter().any(|&(from, _)| from == slot), "{saved:?}");
}

#[test]
fn cached_blocks_without_a_saved_state_are_not_resumed() {
    // No snapshot slots: prefix caching cannot resume anything for this model.
    let mut s = sched(0);
    let p: Vec<u32> = (0..10).collect();
    s.waiting.push_back(entry(1, p.clone()));
    let (run, saved) = step(&mut s, 0);
    assert_eq!(
        (run, saved),
        (vec![(0, 10)], vec![]),
        "no chunk stops, nothing saved"
    );
    s.waiting.push_back(entry(2, p));
    let plan = s.schedule();
    assert_eq!(plan.admitted, [(Place::Running(1), 0)]);
    assert!(plan.restores.is_empty());

    // With snapshots, but the saved state's blocks evicted: nothing resumes either.
    let mut s = sched(1);
    let p: Vec<u32> = (100..110).collect();
    s.waiting.push_back(entry(1, p.clone()));
    step(&mut s, 0);
    let done = s.running.remove(0);
    s.retire(done.seq);
    // Every block taken (the cached ones last, evicted) and given back uncached.
    let all: Vec<_> = std::iter::from_fn(|| s.blocks.allocate()).collect();
    s.blocks.release(&all);
    s.waiting.push_back(entry(2, p));
    assert_eq!(s.snapshots.len(), 1, "the state is still saved");
    let plan = s.schedule();
    assert_eq!(plan.admitted, [(Place::Running(0), 0)]);
    assert!(plan.restores.is_empty());
}
