//! Which workers hold which KV blocks, across the cluster: one map from block hash to its
//! holders, so a prefix-aware router finds every worker's leading cache hits for a prompt by
//! walking the prompt's blocks once, in time proportional to those blocks and their holders,
//! instead of asking each worker's own set. What it answers is exactly what one
//! `KvView` per worker (its test oracle) would: blocks a worker reported storing, plus
//! those of prompts just sent there, pending until reported or until [`PENDING_FOR`] passes.
//! Where thousands of workers hold a prompt's prefix (a system prompt every request shares),
//! [`KvIndex::top_hits`] answers for a pick's few candidates without visiting every holder.
//!
//! The map is split into [`SHARDS`] shards, each behind its own lock, and every operation
//! holds one shard's lock for one block at a time: a pick walking a prompt's blocks never
//! waits behind a whole batch of another worker's events (or behind a thread preempted in
//! the middle of one), only, at worst, behind one block's update in the same shard; and a
//! reader holds a shard's lock only to take a reference to the block's holders, which it
//! walks unlocked (a writer copies holders a reader still has). Each
//! worker's own bookkeeping ([`WorkerKv`]) is kept by its owner, beside its link, in two
//! parts with a lock each: what it reported (taken by its events) and what was sent there
//! (taken by the picks that choose it), so a pick never waits for that worker's events.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

#[cfg(test)]
mod oracle;

/// How long blocks of a prompt sent to a worker count as held there before the worker
/// says so: the time a request may queue and prefill.
pub const PENDING_FOR: Duration = Duration::from_secs(5);

/// Pending hashes remembered per worker at most (the oldest go first).
pub const MAX_PENDING_PER_WORKER: usize = 65_536;

/// Shards of the block map (a power of two).
pub const SHARDS: usize = 64;

/// Where a block stands on one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// The worker reported storing it.
    Held,
    /// Part of a prompt sent there at this time, not yet reported.
    Pending(Instant),
}

impl State {
    /// Counts toward the run that includes pending blocks.
    fn live(self, now: Instant) -> bool {
        match self {
            State::Held => true,
            State::Pending(t) => now < t + PENDING_FOR,
        }
    }
}

/// A block's holders, sorted by worker id. Most blocks have a few, so sorted vectors beat a
/// set in both memory and lookups; the ids apart from the states, so a search through
/// thousands of holders (a prompt prefix the whole cluster shares) reads a quarter of the
/// memory.
#[derive(Clone, Default)]
struct Holders {
    workers: Vec<u32>,
    /// Each worker's, in the same order.
    states: Vec<State>,
}

/// A block nobody holds.
static NOBODY: Holders = Holders {
    workers: Vec::new(),
    states: Vec::new(),
};

impl Holders {
    fn find(&self, worker: u32) -> Result<usize, usize> {
        self.workers.binary_search(&worker)
    }

    fn get(&self, worker: u32) -> Option<State> {
        self.find(worker).ok().map(|i| self.states[i])
    }

    fn len(&self) -> usize {
        self.workers.len()
    }

    fn iter(&self) -> impl Iterator<Item = (u32, State)> + '_ {
        self.workers
            .iter()
            .copied()
            .zip(self.states.iter().copied())
    }

    /// Sets the worker's state, returning the one it replaced.
    fn set(&mut self, worker: u32, state: State) -> Option<State> {
        match self.find(worker) {
            Ok(i) => Some(std::mem::replace(&mut self.states[i], state)),
            Err(i) => {
                self.workers.insert(i, worker);
                self.states.insert(i, state);
                None
            }
        }
    }

    fn remove(&mut self, i: usize) {
        self.workers.remove(i);
        self.states.remove(i);
    }

    /// The state of `worker`, searching from `*at` and leaving `*at` there for a later,
    /// larger worker: galloping, so a walk over many workers costs about the two lists'
    /// lengths, and one over a few workers in a long list stays logarithmic.
    fn seek(&self, at: &mut usize, worker: u32) -> Option<State> {
        let rest = &self.workers[*at..];
        let mut step = 1;
        while step < rest.len() && rest[step] < worker {
            step *= 2;
        }
        let window = &rest[step / 2..rest.len().min(step + 1)];
        *at += step / 2 + window.partition_point(|&w| w < worker);
        match self.workers.get(*at) {
            Some(&w) if w == worker => Some(self.states[*at]),
            _ => None,
        }
    }
}

/// Removes the worker from the block's holders when `what` accepts its state, and the block
/// itself once nobody holds it, so the map only keeps blocks somebody has.
fn remove_holder(
    blocks: &mut Blocks,
    hash: u64,
    worker: u32,
    what: impl Fn(State) -> bool,
) -> Option<State> {
    let Entry::Occupied(mut e) = blocks.entry(hash) else {
        return None;
    };
    let i = e.get().find(worker).ok()?;
    let state = e.get().states[i];
    if !what(state) {
        return None;
    }
    let holders = Arc::make_mut(e.get_mut());
    holders.remove(i);
    if holders.len() == 0 {
        e.remove();
    }
    Some(state)
}

/// One worker's bookkeeping, for snapshots, losses and expiry; lookups go through the map.
/// Its owner keeps it and passes it, always with the same worker id, to the [`KvIndex`]
/// calls that change that worker's blocks.
///
/// A worker's entry in a block is changed only under that block's shard lock, and only by
/// a call holding one of the parts here: events (`held`) turn it held or take it away,
/// picks (`pending`) make it pending unless it is held, so neither undoes the other.
#[derive(Default)]
pub struct WorkerKv {
    held: Mutex<Held>,
    /// When each pending block was expected, oldest first; an entry whose block has since
    /// been stored or expected again is stale and skipped.
    pending: Mutex<VecDeque<(Instant, u64)>>,
    /// How many blocks the worker has pending in the map: raised under the block's shard
    /// lock as the entry is made, so it is never lowered first.
    pending_count: AtomicUsize,
}

/// What a worker reported.
#[derive(Default)]
struct Held {
    /// A snapshot has arrived: `blocks` is the worker's own account.
    synced: bool,
    blocks: HashSet<u64>,
}

/// Block hashes are public (any router computes them from the prompt), so the map is keyed
/// per index as std's is; a folded multiply is enough mixing for values that are already
/// hashes, and much cheaper than SipHash on the routing path.
#[derive(Clone)]
struct BlockHashing {
    seed: u64,
    mul: u64,
}

impl Default for BlockHashing {
    fn default() -> Self {
        let s = RandomState::new();
        BlockHashing {
            seed: s.hash_one(0u64),
            mul: s.hash_one(1u64) | 1,
        }
    }
}

impl BuildHasher for BlockHashing {
    type Hasher = BlockHasher;
    fn build_hasher(&self) -> BlockHasher {
        BlockHasher {
            acc: self.seed,
            mul: self.mul,
        }
    }
}

struct BlockHasher {
    acc: u64,
    mul: u64,
}

impl Hasher for BlockHasher {
    fn write_u64(&mut self, n: u64) {
        let p = ((self.acc ^ n) as u128) * (self.mul as u128);
        self.acc = (p as u64) ^ ((p >> 64) as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }

    fn finish(&self) -> u64 {
        self.acc
    }
}

/// Each block's holders behind an `Arc`: a reader holds its shard's lock only to take a
/// reference, and walks the holders after letting go, so a reader preempted mid-walk holds
/// up no writer (and, through the writer, no other reader). A writer changes them in place,
/// or a copy while a reader still has them.
type Blocks = HashMap<u64, Arc<Holders>, BlockHashing>;

/// The cluster's KV blocks and who holds them. Worker ids are dense slots chosen by the
/// caller; each worker's [`WorkerKv`] goes with its id.
pub struct KvIndex {
    shards: Box<[RwLock<Blocks>]>,
    /// Keyed apart from the shards' own hashing, so the keys of one shard still spread
    /// over its table.
    spread: BlockHashing,
}

impl Default for KvIndex {
    fn default() -> Self {
        KvIndex {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            spread: BlockHashing::default(),
        }
    }
}

impl KvIndex {
    fn shard(&self, hash: u64) -> &RwLock<Blocks> {
        &self.shards[(self.spread.hash_one(hash) >> (64 - SHARDS.trailing_zeros())) as usize]
    }

    /// The block's holders as they are now.
    fn holders(&self, hash: u64) -> Option<Arc<Holders>> {
        self.shard(hash).read().get(&hash).cloned()
    }

    fn remove(&self, hash: u64, worker: u32, what: impl Fn(State) -> bool) -> Option<State> {
        remove_holder(&mut self.shard(hash).write(), hash, worker, what)
    }

    /// Sets the worker's state for the block, returning the one it replaced.
    fn set(&self, hash: u64, worker: u32, state: State) -> Option<State> {
        Arc::make_mut(self.shard(hash).write().entry(hash).or_default()).set(worker, state)
    }

    /// A batch of one worker's events; a snapshot replaces everything that worker held (not
    /// its pending).
    pub fn apply(
        &self,
        worker: u32,
        w: &WorkerKv,
        snapshot: bool,
        stored: &[u64],
        removed: &[u64],
    ) {
        let mut held = w.held.lock();
        if snapshot {
            for h in held.blocks.drain() {
                self.remove(h, worker, |_| true);
            }
            held.synced = true;
        }
        for h in removed {
            if held.blocks.remove(h) {
                self.remove(*h, worker, |_| true);
            }
        }
        for &h in stored {
            // Stored again (a worker may report a block it holds): only this worker's events
            // change its held entries, and they wait for `held`, so no write lock is needed.
            if held.blocks.contains(&h)
                && self.holders(h).and_then(|hs| hs.get(worker)) == Some(State::Held)
            {
                continue;
            }
            if let Some(State::Pending(_)) = self.set(h, worker, State::Held) {
                w.pending_count.fetch_sub(1, Ordering::Relaxed);
            }
            held.blocks.insert(h);
        }
    }

    /// The worker was lost: forget all it held and had pending, and its synced flag.
    pub fn clear_worker(&self, worker: u32, w: &WorkerKv) {
        let mut held = w.held.lock();
        let mut pending = w.pending.lock();
        for h in held.blocks.drain() {
            self.remove(h, worker, |_| true);
        }
        // Every pending block has an entry in the order (the one that set its time).
        for (_, h) in pending.drain(..) {
            self.remove(h, worker, |s| s != State::Held);
        }
        *held = Held::default();
        *pending = VecDeque::new();
        w.pending_count.store(0, Ordering::Relaxed);
    }

    /// A prompt with these block hashes was sent to `worker`: those it does not hold become
    /// pending until reported stored, or [`PENDING_FOR`] passes. Expired pending blocks are
    /// dropped here, and the oldest too past [`MAX_PENDING_PER_WORKER`].
    pub fn expect(&self, worker: u32, w: &WorkerKv, hashes: &[u64], now: Instant) {
        let mut order = w.pending.lock();
        while let Some(&(t, h)) = order.front() {
            let count = w.pending_count.load(Ordering::Relaxed);
            if now < t + PENDING_FOR && count < MAX_PENDING_PER_WORKER {
                break;
            }
            order.pop_front();
            if self.remove(h, worker, |s| s == State::Pending(t)).is_some() {
                w.pending_count.fetch_sub(1, Ordering::Relaxed);
            }
        }
        for &h in hashes {
            // A block it holds (the shared prefix that drew the pick, usually) needs no
            // write lock, so picks reading that hot block are not held up by this one.
            if self.holders(h).and_then(|hs| hs.get(worker)) == Some(State::Held) {
                continue;
            }
            let mut blocks = self.shard(h).write();
            let holders = blocks.entry(h).or_default();
            match holders.get(worker) {
                // Its events stored it meanwhile.
                Some(State::Held) => continue,
                Some(State::Pending(_)) => {}
                None => {
                    w.pending_count.fetch_add(1, Ordering::Relaxed);
                }
            }
            Arc::make_mut(holders).set(worker, State::Pending(now));
            drop(blocks);
            order.push_back((now, h));
        }
    }

    /// For every worker whose leading run is non-empty: `(worker, held, with_pending)`, where
    /// `held` counts the leading hashes the worker reported storing and `with_pending` those
    /// held or pending and unexpired (never less than `held`). Workers not listed have
    /// `(0, 0)`. Sorted by worker id.
    ///
    /// Walks `hashes` in order with the workers whose run goes on, and stops when none does.
    /// Each block is read under its shard's lock alone, so the answer is each block's state
    /// as the walk passed it.
    pub fn leading_hits(&self, hashes: &[u64], now: Instant) -> Vec<(u32, usize, usize)> {
        let Some(&h0) = hashes.first() else {
            return Vec::new();
        };
        let Some(first) = self.holders(h0) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut alive = Vec::new();
        {
            out.reserve(first.len());
            alive.reserve(first.len());
            for (w, s) in first.iter() {
                if s.live(now) {
                    alive.push((out.len(), s == State::Held));
                    out.push((w, 0, 0));
                }
            }
        }
        self.walk_on(hashes, now, out, alive)
    }

    /// [`leading_hits`](Self::leading_hits) of the listed workers alone (sorted by id).
    fn runs_of(&self, hashes: &[u64], now: Instant, workers: &[u32]) -> Vec<(u32, usize, usize)> {
        let (Some(&h0), false) = (hashes.first(), workers.is_empty()) else {
            return Vec::new();
        };
        let Some(first) = self.holders(h0) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut alive = Vec::new();
        {
            let mut at = 0;
            for &w in workers {
                match first.seek(&mut at, w) {
                    Some(s) if s.live(now) => {
                        alive.push((out.len(), s == State::Held));
                        out.push((w, 0, 0));
                    }
                    _ => {}
                }
            }
        }
        self.walk_on(hashes, now, out, alive)
    }

    /// The walk past the first block: `out` holds the workers whose run includes it, in
    /// worker order, and `alive` the index in `out` of each whose run goes on with pending,
    /// and whether its held run goes on too.
    fn walk_on(
        &self,
        hashes: &[u64],
        now: Instant,
        mut out: Vec<(u32, usize, usize)>,
        mut alive: Vec<(usize, bool)>,
    ) -> Vec<(u32, usize, usize)> {
        for (i, h) in hashes.iter().enumerate().skip(1) {
            if alive.is_empty() {
                return out;
            }
            let holders = self.holders(*h);
            let holders = holders.as_deref().unwrap_or(&NOBODY);
            // Both lists are sorted by worker: one cursor walks the holders.
            let mut at = 0;
            alive.retain_mut(|(o, in_held)| {
                let hit: &mut (u32, usize, usize) = &mut out[*o];
                match holders.seek(&mut at, hit.0) {
                    Some(State::Held) => true,
                    Some(s) if s.live(now) => {
                        if *in_held {
                            hit.1 = i;
                            *in_held = false;
                        }
                        true
                    }
                    _ => {
                        if *in_held {
                            hit.1 = i;
                        }
                        hit.2 = i;
                        false
                    }
                }
            });
        }
        for (o, in_held) in alive {
            if in_held {
                out[o].1 = hashes.len();
            }
            out[o].2 = hashes.len();
        }
        out
    }

    /// The leading hits, as [`leading_hits`](Self::leading_hits) gives them, of a few
    /// workers: each in `also` (sorted by id) whose run is not empty, and of the others that
    /// `keep` accepts, the `k` with the longest runs counting pending blocks (of equal runs,
    /// those met first in a block's holders from position `from` on, round the list).
    /// Sorted by worker id.
    ///
    /// However many workers hold the prompt's blocks, this costs about `k` plus `also`
    /// workers' walks: it goes back from the prompt's last block, and a holder of block `i`
    /// not met further on has a run of `i + 1` blocks at most, so once `k` runs reach that
    /// far, no holder further up can beat them.
    pub fn top_hits(
        &self,
        hashes: &[u64],
        now: Instant,
        k: usize,
        also: &[u32],
        keep: impl Fn(u32) -> bool,
        from: usize,
    ) -> Vec<(u32, usize, usize)> {
        let mut out = self.runs_of(hashes, now, also);
        // The runs of every worker met, and the workers met (sorted).
        let mut found: Vec<(u32, usize, usize)> = Vec::new();
        let mut met: Vec<u32> = Vec::new();
        for i in (0..hashes.len()).rev() {
            let mut long = found.iter().filter(|r| r.2 > i).count();
            if long >= k {
                break;
            }
            let Some(holders) = self.holders(hashes[i]) else {
                continue;
            };
            let n = holders.len();
            // Positions of block i's holders looked at so far, from `from` round.
            let mut scanned = 0;
            while long < k && scanned < n {
                let mut batch = Vec::with_capacity(k - long);
                while scanned < n && batch.len() < k - long {
                    let at = (from + scanned) % n;
                    let (w, s) = (holders.workers[at], holders.states[at]);
                    scanned += 1;
                    if !s.live(now) || also.binary_search(&w).is_ok() {
                        continue;
                    }
                    let Err(at) = met.binary_search(&w) else {
                        continue;
                    };
                    met.insert(at, w);
                    if keep(w) {
                        batch.push(w);
                    }
                }
                batch.sort_unstable();
                // Not met further on: nothing past block i counts for them.
                for run in self.runs_of(&hashes[..=i], now, &batch) {
                    long += usize::from(run.2 > i);
                    found.push(run);
                }
            }
        }
        if found.len() > k {
            found.select_nth_unstable_by(k, |a, b| b.2.cmp(&a.2));
            found.truncate(k);
        }
        out.extend(found);
        out.sort_unstable_by_key(|r| r.0);
        out
    }
}

impl WorkerKv {
    /// A snapshot has arrived from the worker since it was created or cleared.
    pub fn synced(&self) -> bool {
        self.held.lock().synced
    }

    /// Hashes the worker reported holding.
    pub fn held(&self) -> usize {
        self.held.lock().blocks.len()
    }

    /// Its blocks pending in the map.
    #[cfg(test)]
    fn pending(&self) -> usize {
        self.pending_count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests;
