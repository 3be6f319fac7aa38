//! The index against one view per worker (`oracle`), alone and under concurrent use.

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
            assert!(holders.len() > 0);
            assert_eq!(holders.workers.len(), holders.states.len());
            assert!(holders.workers.windows(2).all(|p| p[0] < p[1]));
            for (w, s) in holders.iter() {
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
        let holders = Holders {
            states: vec![State::Held; ws.len()],
            workers: ws.clone(),
        };
        let mut queries: Vec<u32> = (0..rng.below(40)).map(|_| rng.below(600) as u32).collect();
        queries.sort_unstable();
        queries.dedup();
        let mut at = 0;
        for q in queries {
            let want = ws.binary_search(&q).ok().map(|_| State::Held);
            assert_eq!(holders.seek(&mut at, q), want, "{q} in {ws:?}");
            assert!(at <= holders.len());
        }
    }
}

/// `top_hits` for a random `k`, `also`, `keep` and `from` against every worker's hits
/// (`want`): each answer exact, every listed worker with a run there, and of the others
/// kept, `k` whose runs none left out beats.
fn check_top_hits(
    index: &KvIndex,
    want: &[(u32, usize, usize)],
    hs: &[u64],
    now: Instant,
    rng: &mut SplitMix,
) {
    let k = rng.below(5) as usize;
    let mut also: Vec<u32> = (0..rng.below(4)).map(|_| rng.below(8) as u32).collect();
    also.sort_unstable();
    also.dedup();
    let odd = rng.below(3);
    let keep = |w: u32| odd == 0 || u64::from(w % 2) == odd - 1;
    let from = rng.below(10) as usize;
    let got = index.top_hits(hs, now, k, &also, keep, from);
    assert!(got.windows(2).all(|p| p[0].0 < p[1].0), "{got:?}");
    for g in &got {
        assert!(want.contains(g), "{g:?} not in {want:?}");
    }
    let listed = |w: u32| also.binary_search(&w).is_ok();
    let in_got = |w: u32| got.iter().any(|g| g.0 == w);
    for w in want.iter().filter(|w| listed(w.0)) {
        assert!(in_got(w.0), "{w:?} of {also:?} missing from {got:?}");
    }
    let others: Vec<_> = want.iter().filter(|w| !listed(w.0) && keep(w.0)).collect();
    let taken: Vec<_> = got.iter().filter(|g| !listed(g.0)).collect();
    assert!(taken.iter().all(|g| keep(g.0)), "{taken:?}");
    assert_eq!(
        taken.len(),
        k.min(others.len()),
        "{hs:?}: {taken:?} of {others:?}"
    );
    let shortest = taken.iter().map(|g| g.2).min().unwrap_or(usize::MAX);
    for o in others.iter().filter(|o| !in_got(o.0)) {
        assert!(o.2 <= shortest, "{o:?} left out for {taken:?}");
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
                check_top_hits(&index.index, &want, &hs, now, &mut rng);
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
fn answers_match(index: &KvIndex, views: &[KvView], chains: &[Vec<u64>], now: Instant) -> usize {
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
                    let mut kvs: Vec<WorkerKv> = ids.iter().map(|_| WorkerKv::default()).collect();
                    let mut views: Vec<KvView> = ids.iter().map(|_| KvView::default()).collect();
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
