//! Which workers hold which KV blocks, across the cluster: one map from block hash to its
//! holders, so a prefix-aware router finds every worker's leading cache hits for a prompt by
//! walking the prompt's blocks once, in time proportional to those blocks and their holders,
//! instead of asking each worker's own set. What it answers is exactly what one
//! `KvView` per worker (its test oracle) would: blocks a worker reported storing, plus
//! those of prompts just sent there, pending until reported or until [`PENDING_FOR`] passes.
//!
//! The map is split into [`SHARDS`] shards, each behind its own lock, and every operation
//! holds one shard's lock for one block at a time: a pick walking a prompt's blocks never
//! waits behind a whole batch of another worker's events (or behind a thread preempted in
//! the middle of one), only, at worst, behind one block's update in the same shard. Each
//! worker's own bookkeeping ([`WorkerKv`]) is kept by its owner, beside its link, in two
//! parts with a lock each: what it reported (taken by its events) and what was sent there
//! (taken by the picks that choose it), so a pick never waits for that worker's events.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// A block's holders, sorted by worker id. Most blocks have a few, so a sorted vector beats
/// a set in both memory and lookups.
#[derive(Default)]
struct Holders(Vec<(u32, State)>);

impl Holders {
    fn find(&self, worker: u32) -> Result<usize, usize> {
        self.0.binary_search_by_key(&worker, |&(w, _)| w)
    }

    fn get(&self, worker: u32) -> Option<State> {
        self.find(worker).ok().map(|i| self.0[i].1)
    }

    /// Sets the worker's state, returning the one it replaced.
    fn set(&mut self, worker: u32, state: State) -> Option<State> {
        match self.find(worker) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, state)),
            Err(i) => {
                self.0.insert(i, (worker, state));
                None
            }
        }
    }
}

/// The state of `worker` in `holders` (sorted by worker), searching from `*at` and leaving
/// `*at` there for a later, larger worker: galloping, so a walk over many workers costs
/// about the two lists' lengths, and one over a few workers in a long list stays
/// logarithmic.
fn seek(holders: &[(u32, State)], at: &mut usize, worker: u32) -> Option<State> {
    let rest = &holders[*at..];
    let mut step = 1;
    while step < rest.len() && rest[step].0 < worker {
        step *= 2;
    }
    let window = &rest[step / 2..rest.len().min(step + 1)];
    let k = step / 2 + window.partition_point(|&(w, _)| w < worker);
    *at += k;
    match holders.get(*at) {
        Some(&(w, state)) if w == worker => Some(state),
        _ => None,
    }
}

/// Removes the worker from the block's holders when `what` accepts its state, and the block
/// itself once nobody holds it, so the map only keeps blocks somebody has.
fn remove_holder(
    blocks: &mut HashMap<u64, Holders, BlockHashing>,
    hash: u64,
    worker: u32,
    what: impl Fn(State) -> bool,
) -> Option<State> {
    let Entry::Occupied(mut e) = blocks.entry(hash) else {
        return None;
    };
    let holders = e.get_mut();
    let i = holders.find(worker).ok()?;
    let state = holders.0[i].1;
    if !what(state) {
        return None;
    }
    holders.0.remove(i);
    if holders.0.is_empty() {
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

type Blocks = HashMap<u64, Holders, BlockHashing>;

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

    fn remove(&self, hash: u64, worker: u32, what: impl Fn(State) -> bool) -> Option<State> {
        remove_holder(&mut self.shard(hash).write(), hash, worker, what)
    }

    /// Sets the worker's state for the block, returning the one it replaced.
    fn set(&self, hash: u64, worker: u32, state: State) -> Option<State> {
        self.shard(hash)
            .write()
            .entry(hash)
            .or_default()
            .set(worker, state)
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
            let shard = self.shard(h);
            if shard.read().get(&h).and_then(|hs| hs.get(worker)) == Some(State::Held) {
                continue;
            }
            let mut blocks = shard.write();
            let holders = blocks.entry(h).or_default();
            match holders.get(worker) {
                // Its events stored it meanwhile.
                Some(State::Held) => continue,
                Some(State::Pending(_)) => {}
                None => {
                    w.pending_count.fetch_add(1, Ordering::Relaxed);
                }
            }
            holders.set(worker, State::Pending(now));
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
        let mut out = Vec::new();
        // Workers whose run with pending goes on: index in `out`, and whether their held
        // run goes on too.
        let mut alive = Vec::new();
        {
            let shard = self.shard(h0).read();
            let Some(first) = shard.get(&h0) else {
                return Vec::new();
            };
            out.reserve(first.0.len());
            alive.reserve(first.0.len());
            for &(w, s) in &first.0 {
                if s.live(now) {
                    alive.push((out.len(), s == State::Held));
                    out.push((w, 0, 0));
                }
            }
        }
        for (i, h) in hashes.iter().enumerate().skip(1) {
            if alive.is_empty() {
                return out;
            }
            let shard = self.shard(*h).read();
            let holders = shard.get(h).map_or(&[][..], |hs| &hs.0[..]);
            // Both lists are sorted by worker: one cursor walks the holders.
            let mut at = 0;
            alive.retain_mut(|(o, in_held)| {
                let hit: &mut (u32, usize, usize) = &mut out[*o];
                match seek(holders, &mut at, hit.0) {
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
mod tests {
    use super::oracle::KvView;
    use super::*;
    use std::time::Duration;

    /// A tiny deterministic PRNG.
    struct SplitMix(u64);

    impl SplitMix {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// What the per-worker views say, in `leading_hits`' form.
    fn reference(views: &[KvView], hashes: &[u64], now: Instant) -> Vec<(u32, usize, usize)> {
        views
            .iter()
            .enumerate()
            .map(|(w, v)| {
                let (held, with_pending) = v.leading_hits(hashes, now);
                (w as u32, held, with_pending)
            })
            .filter(|&(_, _, p)| p > 0)
            .collect()
    }

    /// The index with one [`WorkerKv`] per worker id, as a router keeps them beside its
    /// links.
    #[derive(Default)]
    struct Table {
        index: KvIndex,
        workers: Vec<WorkerKv>,
    }

    impl Table {
        fn kv(workers: &mut Vec<WorkerKv>, worker: u32) -> &mut WorkerKv {
            let i = worker as usize;
            if workers.len() <= i {
                workers.resize_with(i + 1, WorkerKv::default);
            }
            &mut workers[i]
        }

        fn apply(&mut self, worker: u32, snapshot: bool, stored: &[u64], removed: &[u64]) {
            let w = Self::kv(&mut self.workers, worker);
            self.index.apply(worker, w, snapshot, stored, removed);
        }

        fn expect(&mut self, worker: u32, hashes: &[u64], now: Instant) {
            let w = Self::kv(&mut self.workers, worker);
            self.index.expect(worker, w, hashes, now);
        }

        fn clear_worker(&mut self, worker: u32) {
            let w = Self::kv(&mut self.workers, worker);
            self.index.clear_worker(worker, w);
        }

        fn leading_hits(&self, hashes: &[u64], now: Instant) -> Vec<(u32, usize, usize)> {
            self.index.leading_hits(hashes, now)
        }

        fn synced(&self, worker: u32) -> bool {
            self.workers
                .get(worker as usize)
                .is_some_and(|w| w.synced())
        }

        fn held(&self, worker: u32) -> usize {
            self.workers.get(worker as usize).map_or(0, |w| w.held())
        }

        fn block_count(&self) -> usize {
            self.index.shards.iter().map(|s| s.read().len()).sum()
        }
    }

    /// The map and the per-worker bookkeeping agree, every block is in its own shard, and
    /// no block is kept for nobody.
    fn check_consistent(table: &Table) {
        let mut held = vec![0; table.workers.len()];
        let mut pending = vec![0; table.workers.len()];
        for shard in table.index.shards.iter() {
            for (h, holders) in shard.read().iter() {
                assert!(std::ptr::eq(table.index.shard(*h), shard));
                assert!(!holders.0.is_empty());
                assert!(holders.0.windows(2).all(|p| p[0].0 < p[1].0));
                for &(w, s) in &holders.0 {
                    let w = w as usize;
                    match s {
                        State::Held => {
                            assert!(table.workers[w].held.lock().blocks.contains(h));
                            held[w] += 1;
                        }
                        State::Pending(_) => pending[w] += 1,
                    }
                }
            }
        }
        for (i, w) in table.workers.iter().enumerate() {
            assert_eq!((w.held(), w.pending()), (held[i], pending[i]));
        }
    }

    /// Hashes of a random kind: a prefix of one of a few chains (so workers share
    /// prefixes), sometimes with a random tail, or random ones; all from 0..64.
    fn hashes(rng: &mut SplitMix, chains: &[Vec<u64>]) -> Vec<u64> {
        let mut out = match rng.below(4) {
            0 => Vec::new(),
            _ => {
                let c = &chains[rng.below(chains.len() as u64) as usize];
                c[..rng.below(c.len() as u64 + 1) as usize].to_vec()
            }
        };
        for _ in 0..rng.below(4) {
            out.push(rng.below(64));
        }
        out
    }

    #[test]
    fn seeking_in_order_finds_what_a_search_finds() {
        let mut rng = SplitMix(11);
        for _ in 0..2_000 {
            let len = rng.below(300) as usize;
            let mut ws: Vec<u32> = (0..len).map(|_| rng.below(600) as u32).collect();
            ws.sort_unstable();
            ws.dedup();
            let holders: Vec<(u32, State)> = ws.iter().map(|&w| (w, State::Held)).collect();
            let mut queries: Vec<u32> = (0..rng.below(40)).map(|_| rng.below(600) as u32).collect();
            queries.sort_unstable();
            queries.dedup();
            let mut at = 0;
            for q in queries {
                let want = holders
                    .binary_search_by_key(&q, |h| h.0)
                    .ok()
                    .map(|_| State::Held);
                assert_eq!(seek(&holders, &mut at, q), want, "{q} in {ws:?}");
                assert!(at <= holders.len());
            }
        }
    }

    #[test]
    fn matches_one_view_per_worker() {
        const WORKERS: u32 = 8;
        let mut rng = SplitMix(7);
        let chains: Vec<Vec<u64>> = (0..5)
            .map(|_| (0..12).map(|_| rng.below(64)).collect())
            .collect();
        let t0 = Instant::now();
        let mut t = t0;
        let mut index = Table::default();
        let mut views: Vec<KvView> = (0..WORKERS).map(|_| KvView::default()).collect();
        let mut nonempty = 0;
        for step in 0..40_000 {
            let w = rng.below(WORKERS as u64) as u32;
            let v = &mut views[w as usize];
            match rng.below(100) {
                0..=29 => {
                    let snapshot = rng.below(8) == 0;
                    let stored = hashes(&mut rng, &chains);
                    let removed = hashes(&mut rng, &chains);
                    index.apply(w, snapshot, &stored, &removed);
                    v.apply(snapshot, &stored, &removed);
                }
                30..=54 => {
                    let hs = hashes(&mut rng, &chains);
                    index.expect(w, &hs, t);
                    v.expect(&hs, t);
                }
                55..=56 => {
                    index.clear_worker(w);
                    v.clear();
                }
                57..=69 => t += Duration::from_millis(rng.below(3_000)),
                _ => {
                    let hs = hashes(&mut rng, &chains);
                    // Around the pending deadline too.
                    let now = match rng.below(6) {
                        0 => t + PENDING_FOR,
                        1 => t + PENDING_FOR - Duration::from_nanos(1),
                        2 => t + Duration::from_secs(12),
                        _ => t + Duration::from_millis(rng.below(2_000)),
                    };
                    let want = reference(&views, &hs, now);
                    nonempty += usize::from(!want.is_empty());
                    assert_eq!(index.leading_hits(&hs, now), want, "step {step}, {hs:?}");
                }
            }
            for (w, v) in views.iter().enumerate() {
                assert_eq!(index.synced(w as u32), v.synced, "step {step}");
                assert_eq!(index.held(w as u32), v.held(), "step {step}");
            }
            check_consistent(&index);
        }
        // The comparisons were not all of empty answers.
        assert!(nonempty > 3_000, "{nonempty}");
        // Nothing is kept for blocks nobody has.
        for v in &mut views {
            v.clear();
        }
        for w in 0..WORKERS {
            index.clear_worker(w);
        }
        assert_eq!(index.block_count(), 0);
    }

    /// The index answers 2,000 random queries at `now` as the views do; returns how many
    /// answers were not empty.
    fn answers_match(
        index: &KvIndex,
        views: &[KvView],
        chains: &[Vec<u64>],
        now: Instant,
    ) -> usize {
        let mut rng = SplitMix(5);
        let mut nonempty = 0;
        for _ in 0..2_000 {
            let hs = hashes(&mut rng, chains);
            let want = reference(views, &hs, now);
            nonempty += usize::from(!want.is_empty());
            assert_eq!(index.leading_hits(&hs, now), want, "{hs:?}");
        }
        nonempty
    }

    /// Workers' events and expectations from several threads at once, with picks reading
    /// all along: no update is lost or half-seen, and the index ends as the workers' own
    /// views say.
    #[test]
    fn concurrent_writers_and_readers_agree_with_the_views() {
        const THREADS: u32 = 4;
        const PER_THREAD: u32 = 3;
        let index = KvIndex::default();
        let mut rng = SplitMix(23);
        let chains: Vec<Vec<u64>> = (0..4)
            .map(|_| (0..10).map(|_| rng.below(64)).collect())
            .collect();
        let t0 = Instant::now();
        let done = std::sync::atomic::AtomicBool::new(false);
        let (mut kvs, views, reads) = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut rng = SplitMix(99);
                let mut reads = 0u64;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let hs = hashes(&mut rng, &chains);
                    let hits = index.leading_hits(&hs, t0);
                    assert!(hits.windows(2).all(|p| p[0].0 < p[1].0), "{hits:?}");
                    for &(w, held, with_pending) in &hits {
                        assert!(w < THREADS * PER_THREAD);
                        assert!(0 < with_pending && held <= with_pending);
                        assert!(with_pending <= hs.len());
                    }
                    reads += 1;
                }
                reads
            });
            let writers: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (index, chains) = (&index, &chains);
                    scope.spawn(move || {
                        let mut rng = SplitMix(1000 + u64::from(t));
                        let ids: Vec<u32> = (0..PER_THREAD).map(|k| t * PER_THREAD + k).collect();
                        let mut kvs: Vec<WorkerKv> =
                            ids.iter().map(|_| WorkerKv::default()).collect();
                        let mut views: Vec<KvView> =
                            ids.iter().map(|_| KvView::default()).collect();
                        for _ in 0..20_000 {
                            let k = rng.below(u64::from(PER_THREAD)) as usize;
                            let (w, kv, v) = (ids[k], &mut kvs[k], &mut views[k]);
                            match rng.below(10) {
                                0..=4 => {
                                    let snapshot = rng.below(10) == 0;
                                    let stored = hashes(&mut rng, chains);
                                    let removed = hashes(&mut rng, chains);
                                    index.apply(w, kv, snapshot, &stored, &removed);
                                    v.apply(snapshot, &stored, &removed);
                                }
                                5..=8 => {
                                    let hs = hashes(&mut rng, chains);
                                    index.expect(w, kv, &hs, t0);
                                    v.expect(&hs, t0);
                                }
                                _ => {
                                    index.clear_worker(w, kv);
                                    v.clear();
                                }
                            }
                        }
                        (kvs, views)
                    })
                })
                .collect();
            let (mut kvs, mut views) = (Vec::new(), Vec::new());
            for w in writers {
                let (k, v) = w.join().unwrap();
                kvs.extend(k);
                views.extend(v);
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            (kvs, views, reader.join().unwrap())
        });
        assert!(reads > 0);
        let nonempty = answers_match(&index, &views, &chains, t0);
        assert!(nonempty > 500, "{nonempty}");
        let table = Table {
            index,
            workers: std::mem::take(&mut kvs),
        };
        check_consistent(&table);
    }

    /// Each worker's events on one thread and the picks that choose it on another, as a
    /// router runs them: the map, the held sets and the pending counts stay in step, and
    /// what each worker holds in the end is what its events alone say.
    #[test]
    fn events_and_picks_of_one_worker_on_two_threads_stay_consistent() {
        const WORKERS: u32 = 3;
        let index = KvIndex::default();
        let mut rng = SplitMix(31);
        let chains: Vec<Vec<u64>> = (0..4)
            .map(|_| (0..10).map(|_| rng.below(64)).collect())
            .collect();
        let kvs: Vec<WorkerKv> = (0..WORKERS).map(|_| WorkerKv::default()).collect();
        let t0 = Instant::now();
        let views = std::thread::scope(|scope| {
            let (index, chains, kvs) = (&index, &chains, &kvs);
            let mut events = Vec::new();
            for w in 0..WORKERS {
                let kv = &kvs[w as usize];
                events.push(scope.spawn(move || {
                    let mut rng = SplitMix(500 + u64::from(w));
                    let mut view = KvView::default();
                    for _ in 0..20_000 {
                        let snapshot = rng.below(20) == 0;
                        let stored = hashes(&mut rng, chains);
                        let removed = hashes(&mut rng, chains);
                        index.apply(w, kv, snapshot, &stored, &removed);
                        view.apply(snapshot, &stored, &removed);
                    }
                    view
                }));
                scope.spawn(move || {
                    let mut rng = SplitMix(700 + u64::from(w));
                    for i in 0..20_000u64 {
                        let hs = hashes(&mut rng, chains);
                        // Time moves on, so expiry runs alongside the events too.
                        index.expect(w, kv, &hs, t0 + Duration::from_millis(i));
                    }
                });
            }
            events
                .into_iter()
                .map(|e| e.join().unwrap())
                .collect::<Vec<_>>()
        });
        let table = Table {
            index,
            workers: kvs,
        };
        check_consistent(&table);
        // Long after every expectation has lapsed: what the events left.
        let late = t0 + Duration::from_secs(3_600);
        let nonempty = answers_match(&table.index, &views, &chains, late);
        assert!(nonempty > 200, "{nonempty}");
        for (w, v) in views.iter().enumerate() {
            assert_eq!(table.held(w as u32), v.held());
        }
    }

    #[test]
    fn the_chain_breaks_at_an_evicted_block() {
        let t0 = Instant::now();
        let mut index = Table::default();
        index.apply(0, true, &[1, 2, 3, 4], &[]);
        index.apply(1, true, &[1, 2, 3, 4], &[]);
        index.apply(1, false, &[], &[3]);
        assert_eq!(
            index.leading_hits(&[1, 2, 3, 4, 5], t0),
            vec![(0, 4, 4), (1, 2, 2)]
        );
        // A later block held does not count past the gap.
        assert_eq!(index.leading_hits(&[3, 4], t0), vec![(0, 2, 2)]);
        assert_eq!(index.leading_hits(&[9, 1], t0), vec![]);
        assert_eq!(index.leading_hits(&[], t0), vec![]);
        assert_eq!((index.held(0), index.held(1), index.held(7)), (4, 3, 0));
    }

    #[test]
    fn a_snapshot_replaces_what_the_worker_held() {
        let t0 = Instant::now();
        let mut index = Table::default();
        assert!(!index.synced(0));
        index.apply(0, false, &[1, 2, 3], &[]);
        assert!(!index.synced(0));
        index.apply(0, true, &[7, 8], &[]);
        assert!(index.synced(0));
        assert_eq!(index.leading_hits(&[1, 2, 3], t0), vec![]);
        assert_eq!(index.leading_hits(&[7, 8, 9], t0), vec![(0, 2, 2)]);
        assert_eq!(index.held(0), 2);
        // But not what is pending there.
        index.expect(0, &[7, 8, 9], t0);
        index.apply(0, true, &[7], &[]);
        assert_eq!(index.leading_hits(&[7, 8, 9], t0), vec![(0, 1, 1)]);
        index.expect(0, &[7, 8, 9], t0);
        index.apply(0, true, &[7], &[]);
        assert_eq!(index.leading_hits(&[7, 8, 9], t0), vec![(0, 1, 3)]);
    }

    #[test]
    fn expired_pending_no_longer_counts() {
        let t0 = Instant::now();
        let mut index = Table::default();
        index.apply(2, true, &[1, 2], &[]);
        index.expect(2, &[1, 2, 3, 4], t0);
        index.expect(5, &[1, 2], t0);
        let q = [1, 2, 3, 4, 5];
        assert_eq!(index.leading_hits(&q, t0), vec![(2, 2, 4), (5, 0, 2)]);
        let late = t0 + PENDING_FOR - Duration::from_millis(1);
        assert_eq!(index.leading_hits(&q, late), vec![(2, 2, 4), (5, 0, 2)]);
        assert_eq!(index.leading_hits(&q, t0 + PENDING_FOR), vec![(2, 2, 2)]);
        // Reported stored: held, for good.
        index.apply(2, false, &[3], &[]);
        assert_eq!(index.leading_hits(&q, t0 + PENDING_FOR), vec![(2, 3, 3)]);
        // Expired entries go with the worker's next expectation, and their blocks with them.
        index.expect(5, &[], t0 + PENDING_FOR);
        index.expect(2, &[], t0 + PENDING_FOR);
        assert_eq!(index.block_count(), 3);
        assert_eq!(index.workers[2].pending() + index.workers[5].pending(), 0);
    }

    #[test]
    fn clear_worker_forgets_it() {
        let t0 = Instant::now();
        let mut index = Table::default();
        index.apply(3, true, &[1, 2], &[]);
        index.expect(3, &[1, 2, 3], t0);
        index.apply(4, true, &[1], &[]);
        index.clear_worker(3);
        assert!(!index.synced(3));
        assert_eq!(index.held(3), 0);
        assert_eq!(index.leading_hits(&[1, 2, 3], t0), vec![(4, 1, 1)]);
        assert_eq!(index.block_count(), 1);
        index.clear_worker(4);
        index.clear_worker(60);
        assert_eq!(index.block_count(), 0);
        // The slot is usable again.
        index.expect(3, &[1], t0);
        assert_eq!(index.leading_hits(&[1, 2], t0), vec![(3, 0, 1)]);
    }

    #[test]
    fn pending_stays_bounded_per_worker() {
        let t0 = Instant::now();
        let mut index = Table::default();
        let mut view = KvView::default();
        let n = 3 * MAX_PENDING_PER_WORKER as u64;
        for h in 0..n {
            index.expect(1, &[h], t0);
            view.expect(&[h], t0);
        }
        index.expect(2, &[0, 1], t0);
        let w = &index.workers[1];
        assert!(w.pending() <= MAX_PENDING_PER_WORKER + 1);
        assert!(w.pending.lock().len() <= MAX_PENDING_PER_WORKER + 1);
        // Blocks dropped from worker 1 leave the map, except those worker 2 has.
        assert_eq!(index.block_count(), w.pending() + 2);
        // The newest are kept, as the worker's own view keeps them.
        for q in [vec![n - 1], vec![0], vec![1], vec![n - 10, n - 9, n - 8]] {
            let (held, with_pending) = view.leading_hits(&q, t0);
            let got = index.leading_hits(&q, t0);
            let got1 = got.iter().find(|&&(w, _, _)| w == 1);
            assert_eq!(
                got1.map_or((0, 0), |&(_, h, p)| (h, p)),
                (held, with_pending)
            );
        }
        assert_eq!(index.leading_hits(&[0, 1], t0), vec![(2, 0, 2)]);
        assert_eq!(index.leading_hits(&[n - 2, n - 1], t0), vec![(1, 0, 2)]);
    }
}
