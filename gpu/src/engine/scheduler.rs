//! What the next step runs. Each step gives running sequences their next tokens first (a
//! decode token, or the next chunk of a long prompt), then admits waiting ones while the
//! token budget, the sequence limit and the free blocks allow. When blocks run out, the
//! latest-arrived running sequence is preempted: its blocks are freed and it goes back to
//! the head of the queue to be recomputed (its full blocks stay in the prefix cache, so the
//! recompute is mostly a cache hit). Sequences whose blocks are lent to a transfer are never
//! preempted.
//!
//! A model whose layers carry recurrent state (Qwen3.5's linear attention) needs one more
//! resource per sequence: a state slot ([`StateSlots`]). A sequence takes one at admission
//! beside its first blocks and holds it while it runs; it gives it back when it finishes, is
//! aborted, or is preempted. A preempted sequence drops its state with its blocks and is
//! recomputed, exactly as a dense one is: keeping the slot would hold memory for a sequence
//! that is not running and would still leave its KV to recompute. With prefix caching, such
//! a model resumes only at block boundaries whose state was saved ([`Snapshots`] says which
//! and why): the plan then lists the state copies to make before the step, and
//! [`Scheduler::advance`] the ones to make after it.
//!
//! Disaggregated sequences take two other paths. A decode worker's remote-prefill sequence
//! is admitted by reserving blocks for its whole prompt, to be lent to the transfer that
//! fills them; it then waits in no batch. A prefill worker's export sequence reserves its
//! whole prompt at admission too and runs like any other, its blocks lent to the transfer
//! that sends them.
//!
//! The scheduler owns the queues and the block manager and nothing else: no channel, no
//! backend. [`Scheduler::schedule`] returns a [`Plan`] (what runs, who was preempted and
//! admitted, what to lend) and the engine thread carries it out, so scheduling is tested
//! on hand-made queues. A sequence's engine-side parts (its channels, its sampler) ride
//! along as `T`.

use std::collections::{HashMap, VecDeque};

use super::request::SeqId;
use super::snapshots::Snapshots;
use crate::kv_cache::{block_hashes, BlockHash, BlockId, BlockManager};

/// The limits a step is scheduled within.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub enable_prefix_caching: bool,
}

/// How a sequence gets its prompt's KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transfer {
    /// Computed here.
    Local,
    /// Decode side: from a prefill worker, when at least `min_uncached` prompt tokens are not
    /// in the prefix cache here (otherwise computed here).
    Remote { min_uncached: usize },
    /// Prefill side: computed here and sent elsewhere from position `from_pos` on.
    Export { from_pos: usize },
}

/// What the scheduler knows of a sequence.
#[derive(Debug)]
pub(crate) struct SeqState {
    pub id: SeqId,
    /// The prompt, then the tokens generated so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Positions whose K and V are in the sequence's blocks.
    pub num_computed: usize,
    pub blocks: Vec<BlockId>,
    /// Hashes of the full blocks computed so far (registered in the prefix cache).
    pub hashes: Vec<BlockHash>,
    /// Prompt tokens found in the prefix cache at the first admission.
    pub cached_tokens: usize,
    pub admitted_once: bool,
    /// A lease on the blocks is out: they are freed only when it comes back.
    pub lease_out: bool,
    pub transfer: Transfer,
    /// The recurrent-state slot it holds while running, for a model with one.
    pub state_slot: Option<u32>,
    /// The saved state its slot starts from, once it has one: the state after the cached
    /// prefix it resumes at (see [`Snapshots`]).
    pub restore: Option<u32>,
    /// The prefix whose state it saved last while decoding, which its next save replaces.
    pub decode_saved: Option<BlockHash>,
}

impl SeqState {
    pub fn new(id: SeqId, prompt: Vec<u32>, transfer: Transfer) -> SeqState {
        SeqState {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            cached_tokens: 0,
            admitted_once: false,
            lease_out: false,
            transfer,
            state_slot: None,
            restore: None,
            decode_saved: None,
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Forgets its blocks and computed positions (they were released).
    fn reset(&mut self) {
        self.blocks.clear();
        self.hashes.clear();
        self.num_computed = 0;
        self.restore = None;
    }
}

/// A sequence in the scheduler's queues, with the engine's parts of it.
pub(crate) struct Entry<T> {
    pub seq: SeqState,
    pub io: T,
}

/// Where a sequence is after scheduling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Running(usize),
    Awaiting(usize),
    Waiting(usize),
}

/// Blocks to lend to a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lend {
    /// Decode side: the whole prompt's blocks, to be filled from `from_pos` (the first
    /// position the prefix cache does not hold); the sequence waits in `awaiting`.
    Remote { at: usize, from_pos: usize },
    /// Prefill side: the blocks the prompt is computed into, sent from `from_pos`; the first
    /// `computed` positions came from the prefix cache and go at once. The sequence runs.
    Export {
        at: usize,
        from_pos: usize,
        computed: usize,
    },
}

/// One step's schedule.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Plan {
    /// What runs: (index into `running`, tokens), in batch order.
    pub run: Vec<(usize, usize)>,
    /// Sequences preempted to free blocks.
    pub preempted: usize,
    /// Sequences admitted for the first time, and the prompt tokens the prefix cache held.
    pub admitted: Vec<(Place, usize)>,
    /// Blocks to lend.
    pub lend: Vec<Lend>,
    /// Remote-prefill sequences whose prompt is cached well enough here that it is computed
    /// here instead (their transfer is off).
    pub computed_here: Vec<Place>,
    /// Recurrent states to copy before the step, `(from, to)`: saved states into the slots
    /// of sequences that resume after a cached prefix.
    pub restores: Vec<(u32, u32)>,
}

/// The recurrent-state slots of a model with recurrent layers, as ids the backend's slots
/// are indexed by: which are free. A model without such layers has none and needs none.
#[derive(Debug)]
pub(crate) struct StateSlots {
    total: usize,
    /// Free slots; the last one freed is taken first.
    free: Vec<u32>,
}

impl StateSlots {
    pub fn new(total: usize) -> StateSlots {
        StateSlots {
            total,
            free: (0..total as u32).rev().collect(),
        }
    }

    /// Whether sequences need a slot to run.
    pub fn required(&self) -> bool {
        self.total > 0
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }

    fn give_back(&mut self, slot: Option<u32>) {
        if let Some(s) = slot {
            debug_assert!(!self.free.contains(&s), "state slot {s} freed twice");
            self.free.push(s);
        }
    }
}

pub(crate) struct Scheduler<T> {
    pub limits: Limits,
    pub blocks: BlockManager,
    /// Recurrent-state slots (none for a model without recurrent layers).
    pub states: StateSlots,
    /// Saved states for the prefix cache of a model with recurrent layers.
    pub snapshots: Snapshots,
    pub running: Vec<Entry<T>>,
    pub waiting: VecDeque<Entry<T>>,
    /// Decode sequences whose prompt's KV is being transferred in.
    pub awaiting: Vec<Entry<T>>,
    /// Blocks of sequences that ended while a lease on them was out.
    pub held: HashMap<SeqId, Vec<BlockId>>,
}

impl<T> Scheduler<T> {
    #[cfg(test)]
    pub fn new(limits: Limits, num_blocks: usize) -> Scheduler<T> {
        Self::with_state_slots(limits, num_blocks, 0, 0)
    }

    /// A scheduler for a model whose sequences each hold one of `state_slots` recurrent
    /// state slots while they run (0: a model without recurrent layers), with `snapshots`
    /// more slots (ids after those) for the prefix cache's saved states.
    pub fn with_state_slots(
        limits: Limits,
        num_blocks: usize,
        state_slots: usize,
        snapshots: usize,
    ) -> Scheduler<T> {
        Scheduler {
            states: StateSlots::new(state_slots),
            snapshots: Snapshots::new(state_slots as u32, snapshots),
            blocks: BlockManager::new(num_blocks, limits.block_size),
            limits,
            running: Vec::new(),
            waiting: VecDeque::new(),
            awaiting: Vec::new(),
            held: HashMap::new(),
        }
    }

    /// Nothing running or waiting: the engine can sleep until a command comes.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Picks this step's work; see the module docs.
    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.limits.max_num_batched_tokens;
        self.continue_running(&mut plan, &mut budget);
        if plan.preempted == 0 {
            self.admit_waiting(&mut plan, &mut budget);
        }
        plan
    }

    /// Whether sequences resume from the prefix cache and save their states for it: prefix
    /// caching is on and, for a model with recurrent state, there are slots to save in.
    fn reuses_prefixes(&self) -> bool {
        self.limits.enable_prefix_caching && (!self.states.required() || self.snapshots.enabled())
    }

    /// Whether states are saved at block boundaries (see [`Snapshots`]).
    fn saves_states(&self) -> bool {
        self.limits.enable_prefix_caching && self.states.required() && self.snapshots.enabled()
    }

    /// The last block boundary of `s`'s prompt before its last token: where a repeated
    /// prompt resumes, and so where a model with recurrent state saves it.
    fn prompt_boundary(&self, s: &SeqState) -> usize {
        let bs = self.limits.block_size;
        s.prompt_len.saturating_sub(1) / bs * bs
    }

    /// How many of `s`'s next tokens run within `budget`: all that are left if they fit,
    /// stopping at the prompt's boundary where a state is saved there.
    fn chunk(&self, s: &SeqState, budget: usize) -> usize {
        let n = (s.tokens.len() - s.num_computed).min(budget);
        let b = self.prompt_boundary(s);
        if self.saves_states() && s.num_computed < b && b < s.num_computed + n {
            return b - s.num_computed;
        }
        n
    }

    /// Blocks `s` needs beyond its own to compute `n` more positions.
    fn blocks_needed(&self, s: &SeqState, n: usize) -> usize {
        (s.num_computed + n)
            .div_ceil(self.limits.block_size)
            .saturating_sub(s.blocks.len())
    }

    /// The running sequences' next tokens, preempting the latest arrivals for blocks.
    fn continue_running(&mut self, plan: &mut Plan, budget: &mut usize) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let s = &self.running[i].seq;
            let n = self.chunk(s, *budget);
            let need = self.blocks_needed(s, n);
            let mut runnable = true;
            while self.blocks.num_free() < need {
                // The latest arrival goes first; sequences whose blocks are lent out stay.
                let Some(v) = (i..self.running.len())
                    .rev()
                    .find(|&j| !self.running[j].seq.lease_out)
                else {
                    runnable = false;
                    break;
                };
                let victim = self.running.remove(v);
                self.preempt(victim);
                plan.preempted += 1;
                if v == i {
                    runnable = false;
                    break;
                }
            }
            if i >= self.running.len() {
                break;
            }
            if !runnable || self.blocks.num_free() < need {
                i += 1;
                continue;
            }
            for _ in 0..need {
                let b = self.blocks.allocate().expect("checked free blocks");
                self.running[i].seq.blocks.push(b);
            }
            plan.run.push((i, n));
            *budget -= n;
            i += 1;
        }
    }

    /// Frees a running sequence's blocks and state slot and puts it first in line, to be
    /// recomputed from its first token.
    fn preempt(&mut self, mut e: Entry<T>) {
        self.blocks.release(&e.seq.blocks);
        self.states.give_back(e.seq.state_slot.take());
        e.seq.reset();
        self.waiting.push_front(e);
    }

    /// Waiting sequences, in order, while the budget, the sequence limit and the blocks
    /// allow.
    fn admit_waiting(&mut self, plan: &mut Plan, budget: &mut usize) {
        while *budget > 0 && self.running.len() < self.limits.max_num_seqs {
            // A model with recurrent state admits no one without a slot for it (a sequence
            // back from a transfer may hold its own already).
            let needs_slot = self.states.required()
                && self
                    .waiting
                    .front()
                    .is_some_and(|e| e.seq.state_slot.is_none());
            if needs_slot && self.states.num_free() == 0 {
                break;
            }
            let Some(mut e) = self.waiting.pop_front() else {
                break;
            };
            let cached_here = self.reuse_cached_prefix(&mut e.seq);
            let s = &e.seq;
            let n = self.chunk(s, *budget);
            // A transfer needs the whole prompt's blocks from the start, so that it never
            // waits for (or is preempted by) a later allocation.
            let need = match s.transfer {
                Transfer::Local => self.blocks_needed(s, n),
                _ => s
                    .prompt_len
                    .div_ceil(self.limits.block_size)
                    .saturating_sub(s.blocks.len()),
            };
            if self.blocks.num_free() < need {
                self.blocks.release(&e.seq.blocks);
                e.seq.reset();
                self.waiting.push_front(e);
                if cached_here {
                    plan.computed_here.push(Place::Waiting(0));
                }
                break;
            }
            for _ in 0..need {
                e.seq
                    .blocks
                    .push(self.blocks.allocate().expect("checked free blocks"));
            }
            if needs_slot {
                let slot = self.states.take().expect("checked a free slot");
                e.seq.state_slot = Some(slot);
                if let Some(from) = e.seq.restore {
                    plan.restores.push((from, slot));
                }
            }
            let first = !e.seq.admitted_once;
            if first {
                e.seq.admitted_once = true;
                e.seq.cached_tokens = e.seq.num_computed;
            }
            let place = self.place(e, plan, n, budget);
            if first {
                plan.admitted
                    .push((place, self.at(place).seq.cached_tokens));
            }
            if cached_here {
                plan.computed_here.push(place);
            }
        }
    }

    /// At a sequence's admission: the leading blocks the prefix cache holds (all but the
    /// last token's, so the step yields logits). A remote-prefill sequence found cached well
    /// enough is computed here instead; says whether that happened.
    fn reuse_cached_prefix(&mut self, s: &mut SeqState) -> bool {
        if s.blocks.is_empty() && self.reuses_prefixes() {
            let bs = self.limits.block_size;
            let reusable = (s.tokens.len() - 1) / bs;
            let mut hashes = block_hashes(&s.tokens[..reusable * bs], bs);
            if self.states.required() {
                // Cached blocks hold K and V, not the recurrent state after them: resume
                // only at the last cached boundary whose state was saved.
                let cached = self.blocks.cached_prefix_len(&hashes);
                let at = (1..=cached)
                    .rev()
                    .find(|&k| self.snapshots.contains(hashes[k - 1]))
                    .unwrap_or(0);
                hashes.truncate(at);
                s.restore = hashes.last().and_then(|&h| self.snapshots.take_use(h));
            }
            s.blocks = self.blocks.take_cached_prefix(&hashes);
            s.num_computed = s.blocks.len() * bs;
            s.hashes = hashes[..s.blocks.len()].to_vec();
        }
        if let Transfer::Remote { min_uncached } = s.transfer {
            if s.prompt_len - s.num_computed < min_uncached {
                s.transfer = Transfer::Local;
                return true;
            }
        }
        false
    }

    /// Puts an admitted sequence where it goes: lent and waiting for its KV (remote
    /// prefill), or running `n` tokens this step.
    fn place(&mut self, mut e: Entry<T>, plan: &mut Plan, n: usize, budget: &mut usize) -> Place {
        let computed = e.seq.num_computed;
        match e.seq.transfer {
            Transfer::Remote { .. } => {
                // Lent to the transfer; it waits outside every batch until the lease comes
                // back.
                e.seq.lease_out = true;
                self.awaiting.push(e);
                let at = self.awaiting.len() - 1;
                plan.lend.push(Lend::Remote {
                    at,
                    from_pos: computed,
                });
                return Place::Awaiting(at);
            }
            Transfer::Export { from_pos } => {
                e.seq.lease_out = true;
                plan.lend.push(Lend::Export {
                    at: self.running.len(),
                    from_pos,
                    computed,
                });
            }
            Transfer::Local => {}
        }
        self.running.push(e);
        let at = self.running.len() - 1;
        plan.run.push((at, n));
        *budget -= n;
        Place::Running(at)
    }

    pub fn at(&self, place: Place) -> &Entry<T> {
        match place {
            Place::Running(i) => &self.running[i],
            Place::Awaiting(i) => &self.awaiting[i],
            Place::Waiting(i) => &self.waiting[i],
        }
    }

    pub fn at_mut(&mut self, place: Place) -> &mut Entry<T> {
        match place {
            Place::Running(i) => &mut self.running[i],
            Place::Awaiting(i) => &mut self.awaiting[i],
            Place::Waiting(i) => &mut self.waiting[i],
        }
    }

    /// A lend the engine could not make: a remote-prefill sequence prefills here instead
    /// (from the next step); an export fails and is returned for the engine to answer.
    /// `lends` are this plan's, handled from the last one back so that the places of the
    /// others stay valid; `plan.run` loses the failed exports.
    pub fn unlend(&mut self, plan: &mut Plan, failed: &[Lend]) -> Vec<Entry<T>> {
        let mut dropped = Vec::new();
        let mut failed = failed.to_vec();
        failed.sort_by_key(|l| std::cmp::Reverse(lend_index(l)));
        for l in failed {
            match l {
                Lend::Remote { at, .. } => {
                    let mut e = self.awaiting.remove(at);
                    e.seq.lease_out = false;
                    e.seq.transfer = Transfer::Local;
                    self.running.push(e);
                }
                Lend::Export { at, .. } => {
                    let mut e = self.running.remove(at);
                    e.seq.lease_out = false;
                    plan.run.retain(|&(i, _)| i != at);
                    for (i, _) in plan.run.iter_mut() {
                        if *i > at {
                            *i -= 1;
                        }
                    }
                    dropped.push(e);
                }
            }
        }
        dropped
    }

    /// Every block of `s` that is now full and computed goes into the prefix cache.
    pub fn register_full_blocks(&mut self, s: &mut SeqState) {
        register_full_blocks(&mut self.blocks, self.limits, s);
    }

    /// After a step: the planned sequences computed their tokens. Returns the recurrent
    /// states to save now, `(from, to)`: sequences that reached a block boundary whose state
    /// the prefix cache keeps (see [`Snapshots`]).
    pub fn advance(&mut self, plan: &Plan) -> Vec<(u32, u32)> {
        let saves = self.saves_states();
        let mut copies = Vec::new();
        for &(i, n) in &plan.run {
            let b = self.prompt_boundary(&self.running[i].seq);
            let s = &mut self.running[i].seq;
            s.num_computed += n;
            register_full_blocks(&mut self.blocks, self.limits, s);
            let at = s.num_computed;
            if !saves || at == 0 || !at.is_multiple_of(self.limits.block_size) || at < b {
                continue;
            }
            let (Some(slot), Some(&h)) =
                (s.state_slot, s.hashes.get(at / self.limits.block_size - 1))
            else {
                continue;
            };
            // The prompt's boundary is kept; each later one replaces the one before.
            let to = if at == b {
                self.snapshots.save(h, None)
            } else {
                let to = self.snapshots.save(h, s.decode_saved);
                s.decode_saved = Some(h);
                to
            };
            if let Some(to) = to {
                copies.push((slot, to));
            }
        }
        copies
    }

    /// A sequence is done with its blocks: they are freed, or kept while a lease is out.
    /// Its state slot is freed either way.
    pub fn retire(&mut self, s: SeqState) {
        self.states.give_back(s.state_slot);
        if s.lease_out {
            self.held.insert(s.id, s.blocks);
        } else {
            self.blocks.release(&s.blocks);
        }
    }

    /// Takes a sequence out of whichever queue holds it.
    pub fn remove(&mut self, id: SeqId) -> Option<Entry<T>> {
        if let Some(i) = self.waiting.iter().position(|e| e.seq.id == id) {
            return self.waiting.remove(i);
        }
        if let Some(i) = self.running.iter().position(|e| e.seq.id == id) {
            return Some(self.running.remove(i));
        }
        let i = self.awaiting.iter().position(|e| e.seq.id == id)?;
        Some(self.awaiting.remove(i))
    }

    /// A decode sequence waiting for its KV gives its transfer up while its lease is still
    /// out: its lent blocks are held until the lease comes back, and the sequence, reset, is
    /// returned to be prefilled here in blocks of its own.
    pub fn abandon_lease(&mut self, id: SeqId) -> Option<Entry<T>> {
        let i = self.awaiting.iter().position(|e| e.seq.id == id)?;
        let mut e = self.awaiting.remove(i);
        self.held.insert(id, std::mem::take(&mut e.seq.blocks));
        self.states.give_back(e.seq.state_slot.take());
        e.seq.reset();
        e.seq.lease_out = false;
        e.seq.transfer = Transfer::Local;
        Some(e)
    }

    /// The last clone of a sequence's lease is gone: held blocks of a finished sequence are
    /// freed; a decode sequence waiting for its KV is returned, its blocks its own again, to
    /// decode (it landed) or to prefill here (it did not).
    pub fn lease_returned(&mut self, id: SeqId) -> Option<Entry<T>> {
        if let Some(blocks) = self.held.remove(&id) {
            self.blocks.release(&blocks);
            return None;
        }
        if let Some(i) = self.awaiting.iter().position(|e| e.seq.id == id) {
            let mut e = self.awaiting.remove(i);
            e.seq.lease_out = false;
            e.seq.transfer = Transfer::Local;
            return Some(e);
        }
        if let Some(e) = self
            .running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|e| e.seq.id == id)
        {
            e.seq.lease_out = false;
        }
        None
    }

    /// A decode sequence whose prompt's KV is in place continues decoding: into the batch if
    /// there is room, else first in line.
    pub fn resume(&mut self, e: Entry<T>) {
        if self.running.len() < self.limits.max_num_seqs {
            self.running.push(e);
        } else {
            self.waiting.push_front(e);
        }
    }

    /// With nothing running, nothing lent and nothing to wait for, a waiting sequence that
    /// still cannot be scheduled never will be (it cannot happen for requests that passed
    /// the engine's size check); it is returned to be failed rather than spun on.
    pub fn unschedulable(&mut self) -> Option<Entry<T>> {
        let stuck = !self.waiting.is_empty()
            && self.running.is_empty()
            && self.awaiting.is_empty()
            && self.held.is_empty();
        stuck.then(|| self.waiting.pop_front()).flatten()
    }
}

fn lend_index(l: &Lend) -> (bool, usize) {
    match *l {
        Lend::Remote { at, .. } => (false, at),
        Lend::Export { at, .. } => (true, at),
    }
}

/// Records every block of `s` that is now full and computed in the prefix cache.
fn register_full_blocks(blocks: &mut BlockManager, limits: Limits, s: &mut SeqState) {
    let bs = limits.block_size;
    while (s.hashes.len() + 1) * bs <= s.num_computed {
        let k = s.hashes.len();
        let h = BlockHash::chain(s.hashes.last().copied(), &s.tokens[k * bs..(k + 1) * bs]);
        s.hashes.push(h);
        if limits.enable_prefix_caching {
            blocks.register(s.blocks[k], h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_num_seqs: usize, max_num_batched_tokens: usize) -> Limits {
        Limits {
            max_num_seqs,
            max_num_batched_tokens,
            block_size: 4,
            enable_prefix_caching: true,
        }
    }

    /// A sequence of `len` prompt tokens, numbered from `first`.
    fn seq(id: u64, first: u32, len: u32, transfer: Transfer) -> Entry<()> {
        Entry {
            seq: SeqState::new(SeqId(id), (first..first + len).collect(), transfer),
            io: (),
        }
    }

    /// A running sequence with `prompt` tokens, all computed, and `generated` tokens, the
    /// last of which is not computed yet (a decode step is due), its blocks taken from `s`.
    fn decoding(s: &mut Scheduler<()>, id: u64, prompt: u32, generated: u32) -> Entry<()> {
        let mut e = seq(id, 1000 * id as u32, prompt + generated, Transfer::Local);
        e.seq.prompt_len = prompt as usize;
        e.seq.num_computed = e.seq.tokens.len() - 1;
        e.seq.admitted_once = true;
        for _ in 0..e.seq.num_computed.div_ceil(s.limits.block_size) {
            e.seq.blocks.push(s.blocks.allocate().unwrap());
        }
        e
    }

    fn ids<T>(q: impl IntoIterator<Item = T>, f: impl Fn(T) -> SeqId) -> Vec<u64> {
        q.into_iter().map(|e| f(e).0).collect()
    }

    #[test]
    fn running_sequences_go_first_and_a_long_prompt_is_chunked_to_the_budget() {
        let mut s = Scheduler::new(limits(8, 20), 100);
        let (a, b) = (decoding(&mut s, 1, 5, 1), decoding(&mut s, 2, 9, 3));
        s.running.extend([a, b]);
        s.waiting.push_back(seq(3, 0, 30, Transfer::Local));
        let plan = s.schedule();
        assert_eq!(plan.run, [(0, 1), (1, 1), (2, 18)]);
        assert_eq!(plan.admitted, [(Place::Running(2), 0)]);
        // 18 of 30 prompt positions need 5 blocks of 4.
        assert_eq!(s.running[2].seq.blocks.len(), 5);
        s.advance(&plan);
        assert_eq!(s.running[2].seq.num_computed, 18);
        assert_eq!(
            s.running[2].seq.hashes.len(),
            4,
            "the full blocks are cached"
        );
        // The decoding sequences sampled their next tokens.
        for e in &mut s.running[..2] {
            e.seq.tokens.push(7);
        }
        // The rest of the prompt next step, beside the two decode tokens.
        let plan = s.schedule();
        assert_eq!(plan.run, [(0, 1), (1, 1), (2, 12)]);
        assert!(plan.admitted.is_empty());
    }

    #[test]
    fn no_more_sequences_run_than_the_limit() {
        let mut s = Scheduler::new(limits(2, 100), 100);
        for id in 0..3 {
            s.waiting
                .push_back(seq(id, 10 * id as u32, 5, Transfer::Local));
        }
        let plan = s.schedule();
        assert_eq!(plan.run, [(0, 5), (1, 5)]);
        assert_eq!(ids(&s.waiting, |e| e.seq.id), [2]);
    }

    #[test]
    fn blocks_running_out_preempt_the_latest_arrival_but_never_a_lent_sequence() {
        // Three running sequences at a block boundary (each needs one more block), one
        // free block, and one more sequence waiting.
        let mut s = Scheduler::new(limits(8, 100), 7);
        let a = decoding(&mut s, 1, 8, 1);
        let mut b = decoding(&mut s, 2, 8, 1);
        b.seq.lease_out = true;
        let c = decoding(&mut s, 3, 8, 1);
        s.running.extend([a, b, c]);
        s.waiting.push_back(seq(4, 0, 3, Transfer::Local));
        assert_eq!(s.blocks.num_free(), 1);
        let plan = s.schedule();
        // A takes the free block; B is lent, so C gives its blocks up for B.
        assert_eq!(plan.preempted, 1);
        assert_eq!(plan.run, [(0, 1), (1, 1)]);
        assert_eq!(ids(&s.running, |e| e.seq.id), [1, 2]);
        // C waits first in line, to be recomputed; nothing is admitted after a preemption.
        assert_eq!(ids(&s.waiting, |e| e.seq.id), [3, 4]);
        let c = &s.waiting[0].seq;
        assert!(c.blocks.is_empty() && c.num_computed == 0 && c.hashes.is_empty());
        assert!(plan.admitted.is_empty());
    }

    #[test]
    fn a_lent_sequence_is_skipped_not_preempted_when_only_lent_ones_remain() {
        let mut s = Scheduler::new(limits(8, 100), 2);
        let mut a = decoding(&mut s, 1, 8, 1);
        a.seq.lease_out = true;
        s.running.push(a);
        let plan = s.schedule();
        assert_eq!((plan.preempted, plan.run.len()), (0, 0));
        assert_eq!(s.running.len(), 1);
    }

    #[test]
    fn a_remote_prefill_reserves_its_whole_prompt_and_waits_outside_the_batch() {
        let mut s = Scheduler::new(limits(8, 16), 100);
        s.waiting
            .push_back(seq(1, 0, 40, Transfer::Remote { min_uncached: 8 }));
        s.waiting.push_back(seq(2, 100, 30, Transfer::Local));
        let plan = s.schedule();
        assert_eq!(plan.lend, [Lend::Remote { at: 0, from_pos: 0 }]);
        let r = &s.awaiting[0].seq;
        assert!(r.lease_out);
        assert_eq!(r.blocks.len(), 10, "the whole prompt's blocks");
        // It uses none of the step's budget: the next sequence gets all of it.
        assert_eq!(plan.run, [(0, 16)]);
        assert_eq!(
            plan.admitted,
            [(Place::Awaiting(0), 0), (Place::Running(0), 0)]
        );
    }

    #[test]
    fn a_remote_prefill_cached_well_enough_here_is_computed_here() {
        let mut s = Scheduler::new(limits(8, 64), 100);
        // A first sequence leaves the prompt's blocks in the prefix cache.
        s.waiting.push_back(seq(1, 0, 40, Transfer::Local));
        let plan = s.schedule();
        s.advance(&plan);
        let first = s.running.remove(0);
        s.retire(first.seq);
        s.waiting
            .push_back(seq(2, 0, 40, Transfer::Remote { min_uncached: 8 }));
        let plan = s.schedule();
        // All but the last token's block is cached: 36 positions, 4 left to compute.
        assert_eq!(plan.computed_here, [Place::Running(0)]);
        assert_eq!(plan.admitted, [(Place::Running(0), 36)]);
        assert_eq!(plan.run, [(0, 4)]);
        assert!(plan.lend.is_empty());
        assert_eq!(s.running[0].seq.transfer, Transfer::Local);
    }

    #[test]
    fn an_export_reserves_its_whole_prompt_and_runs_in_chunks() {
        let mut s = Scheduler::new(limits(8, 16), 100);
        s.waiting
            .push_back(seq(1, 0, 40, Transfer::Export { from_pos: 8 }));
        let plan = s.schedule();
        assert_eq!(
            plan.lend,
            [Lend::Export {
                at: 0,
                from_pos: 8,
                computed: 0
            }]
        );
        assert_eq!(plan.run, [(0, 16)]);
        assert!(s.running[0].seq.lease_out);
        assert_eq!(s.running[0].seq.blocks.len(), 10);
        s.advance(&plan);
        let plan = s.schedule();
        assert_eq!(plan.run, [(0, 16)]);
        assert!(plan.lend.is_empty());
        assert_eq!(s.running[0].seq.blocks.len(), 10, "no later allocation");
    }

    #[test]
    fn a_sequence_that_does_not_fit_waits_first_and_is_given_up_only_when_nothing_can_free_blocks()
    {
        let mut s = Scheduler::new(limits(8, 64), 3);
        s.waiting.push_back(seq(1, 0, 20, Transfer::Local));
        let plan = s.schedule();
        assert_eq!(plan, Plan::default());
        assert_eq!(ids(&s.waiting, |e| e.seq.id), [1]);
        // Blocks held for a lease may still come back: wait for them.
        s.held.insert(SeqId(9), vec![]);
        assert!(s.unschedulable().is_none());
        s.held.clear();
        assert_eq!(s.unschedulable().map(|e| e.seq.id), Some(SeqId(1)));
    }

    #[test]
    fn a_state_slot_is_taken_at_admission_and_given_back_on_finish_and_preemption() {
        // Two slots for three allowed sequences: the third waits for a slot.
        let mut s = Scheduler::with_state_slots(limits(3, 100), 100, 2, 0);
        for id in 0..3 {
            s.waiting
                .push_back(seq(id, 10 * id as u32, 5, Transfer::Local));
        }
        let plan = s.schedule();
        assert_eq!(plan.run, [(0, 5), (1, 5)]);
        assert_eq!(ids(&s.waiting, |e| e.seq.id), [2]);
        let held: Vec<_> = s.running.iter().map(|e| e.seq.state_slot).collect();
        assert!(held[0].is_some() && held[1].is_some() && held[0] != held[1]);
        assert_eq!(s.states.num_free(), 0);
        // A finished sequence gives its slot back; the waiting one takes it.
        s.advance(&plan);
        let done = s.running.remove(0);
        s.retire(done.seq);
        assert_eq!(s.states.num_free(), 1);
        let plan = s.schedule();
        assert_eq!(plan.admitted, [(Place::Running(1), 0)]);
        assert_eq!(s.running[1].seq.state_slot, held[0]);
        // Nothing reuses cached blocks: they hold no state, and none is saved.
        assert!(plan.admitted.iter().all(|&(_, cached)| cached == 0));
        // A preempted sequence drops its slot with its blocks.
        let victim = s.running.pop().unwrap();
        s.preempt(victim);
        assert_eq!(s.states.num_free(), 1);
        assert_eq!(s.waiting[0].seq.state_slot, None);
    }

    #[test]
    fn blocks_running_out_preempt_and_free_the_victims_state_slot() {
        let mut s = Scheduler::with_state_slots(limits(8, 100), 2, 2, 0);
        let mut a = decoding(&mut s, 1, 4, 1);
        let mut b = decoding(&mut s, 2, 4, 1);
        for e in [&mut a, &mut b] {
            e.seq.state_slot = s.states.take();
        }
        s.running.extend([a, b]);
        // Both need a second block and there are none: the latest arrival goes.
        let plan = s.schedule();
        assert_eq!(plan.preempted, 1);
        assert_eq!(plan.run, [(0, 1)]);
        assert_eq!(s.states.num_free(), 1);
        let b = &s.waiting[0].seq;
        assert_eq!((b.id, b.state_slot, b.num_computed), (SeqId(2), None, 0));
    }

    #[test]
    fn failed_lends_fall_back_or_leave_the_batch() {
        let mut s = Scheduler::new(limits(8, 64), 100);
        s.waiting.push_back(seq(1, 0, 8, Transfer::Local));
        s.waiting
            .push_back(seq(2, 100, 12, Transfer::Export { from_pos: 0 }));
        s.waiting
            .push_back(seq(3, 200, 16, Transfer::Remote { min_uncached: 1 }));
        s.waiting.push_back(seq(4, 300, 4, Transfer::Local));
        let mut plan = s.schedule();
        assert_eq!(plan.run, [(0, 8), (1, 12), (2, 4)]);
        let failed = plan.lend.clone();
        let dropped = s.unlend(&mut plan, &failed);
        // The export leaves the batch (its caller is told); the remote prefill runs here
        // from the next step, its blocks no longer lent.
        assert_eq!(ids(&dropped, |e| e.seq.id), [2]);
        assert!(!dropped[0].seq.lease_out);
        assert_eq!(plan.run, [(0, 8), (1, 4)]);
        assert_eq!(ids(&s.running, |e| e.seq.id), [1, 4, 3]);
        let r = &s.running[2].seq;
        assert_eq!((r.transfer, r.lease_out), (Transfer::Local, false));
        assert!(s.awaiting.is_empty());
    }
}
