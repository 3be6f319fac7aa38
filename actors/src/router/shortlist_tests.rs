//! The shortlist picks at scale cost (see `shortlist`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::RwLock;

use super::choice::{can_take, Picker, Wanted, MAX_HOLDERS};
use super::links::Workers;
use super::shortlist::*;
use super::stats::PickTimes;
use crate::kv_index::KvIndex;
use crate::policy::{Policy, PrefixTuning};
use kvmesh_discovery::{NodeRecord, Role};

pub(super) fn record(i: usize, max_model_len: usize) -> NodeRecord {
    NodeRecord {
        node_id: format!("w{i:05}"),
        cluster: "c".into(),
        roles: vec![Role::Worker],
        quic_addr: "127.0.0.1:1".into(),
        http_url: None,
        model: "m".into(),
        device: "sim".into(),
        capacity_tokens_per_s: 100.0,
        max_model_len,
        block_size: 16,
        cert_sha256: String::new(),
        version: String::new(),
        started_unix_ms: 0,
        kv_layout: None,
        kv_tcp_addr: None,
        kv_transports: Vec::new(),
        draining: false,
        model_fingerprint: None,
    }
}

/// `n` workers up, worker `i` with `load(i)` requests of this router's; the last one
/// alone takes long contexts. Their blocks go to `index`.
fn workers(n: usize, index: &Arc<KvIndex>, load: impl Fn(usize) -> i64) -> RwLock<Workers> {
    let slot = AtomicU32::new(0);
    let mut w = Workers::default();
    for i in 0..n {
        let long = if i == n - 1 { 4096 } else { 512 };
        let link = Arc::new(super::membership::new_link(&record(i, long), index, &slot));
        link.hot.up.store(true, Ordering::Relaxed);
        link.hot.outstanding.store(load(i), Ordering::Relaxed);
        w.by_id.insert(link.record.node_id.clone(), link);
    }
    w.list = w.by_id.values().cloned().collect();
    w.by_slot = by_slot(&w.list);
    RwLock::new(w)
}

/// What a picker borrows besides the workers.
#[derive(Default)]
struct Parts {
    index: Arc<KvIndex>,
    picks: PickTimes,
    shortlist: Shortlist,
}

impl Parts {
    fn picker<'a>(&'a self, workers: &'a RwLock<Workers>, policy: Policy) -> Picker<'a> {
        Picker {
            workers,
            index: &self.index,
            policy,
            tuning: PrefixTuning::default(),
            picks: &self.picks,
            shortlist: &self.shortlist,
        }
    }
}

fn wanted<'a>(length: usize, tried: &'a HashSet<String>) -> Wanted<'a> {
    Wanted {
        hashes: &[],
        prompt_tokens: 32,
        output_tokens: 16,
        length,
        tried,
        describe: false,
    }
}

#[test]
fn at_scale_picks_cost_a_shortlist_and_still_find_the_least_loaded() {
    const N: usize = 2000;
    // Loads 1..=9, but a scattered few idle ones.
    let idle = |i: usize| i % 397 == 5;
    let parts = Parts::default();
    let ws = workers(N, &parts.index, |i| {
        if idle(i) {
            0
        } else {
            1 + (i * 7 % 9) as i64
        }
    });
    let picker = parts.picker(&ws, Policy::LeastLoaded);
    let shortlist = &parts.shortlist;
    let tried = HashSet::new();
    // Before the first refresh: a scan of all.
    assert!(shortlist.current().is_none());
    let first = picker.choose(&wanted(64, &tried), 0).unwrap();
    assert!(idle(first.link.record.node_id[1..].parse().unwrap()));
    shortlist.saw(32, 16);
    picker.refresh_shortlist();
    let list = shortlist.current().expect("a shortlist at 2,000 workers");
    assert_eq!(list.len(), SHORTLIST_LEN);
    // Every idle worker is on it, and a pick takes one of them, then the next.
    let idle_ids: HashSet<String> = (0..N)
        .filter(|&i| idle(i))
        .map(|i| format!("w{i:05}"))
        .collect();
    let listed: HashSet<String> = list.iter().map(|w| w.record.node_id.clone()).collect();
    assert!(
        idle_ids.is_subset(&listed),
        "{idle_ids:?} not all in the list"
    );
    let mut taken = HashSet::new();
    for turn in 0..idle_ids.len() as u64 {
        let c = picker.choose(&wanted(64, &tried), turn).unwrap();
        c.link.hot.outstanding.fetch_add(1, Ordering::Relaxed);
        assert!(idle_ids.contains(&c.link.record.node_id), "turn {turn}");
        taken.insert(c.link.record.node_id.clone());
    }
    assert_eq!(taken, idle_ids, "each idle worker took one request");
    // A context only the last worker takes: the shortlist cannot, the scan finds it.
    let c = picker.choose(&wanted(2048, &tried), 9).unwrap();
    assert_eq!(c.link.record.node_id, format!("w{:05}", N - 1));
}

#[test]
fn below_the_threshold_there_is_no_shortlist() {
    let parts = Parts::default();
    let ws = workers(SHORTLIST_FROM - 1, &parts.index, |_| 0);
    let picker = parts.picker(&ws, Policy::LeastLoaded);
    let shortlist = &parts.shortlist;
    picker.refresh_shortlist();
    assert!(shortlist.current().is_none());
}

/// A prompt of `blocks` blocks, for a prefix pick.
fn prompt(blocks: u64) -> Vec<u64> {
    (0..blocks).map(|k| 7_000 + k).collect()
}

fn prefix_wanted<'a>(hashes: &'a [u64], tried: &'a HashSet<String>) -> Wanted<'a> {
    Wanted {
        hashes,
        prompt_tokens: hashes.len() * 16,
        output_tokens: 16,
        length: 64,
        tried,
        describe: false,
    }
}

#[test]
fn the_holders_of_a_shared_prefix_join_the_shortlist_once_each() {
    let parts = Parts::default();
    let ws = workers(2000, &parts.index, |i| (i % 9) as i64);
    let picker = parts.picker(&ws, Policy::Prefix);
    parts.shortlist.saw(32, 16);
    picker.refresh_shortlist();
    let list = parts
        .shortlist
        .current()
        .expect("a shortlist at 2,000 workers");
    let w = ws.read();
    // 600 holders of the prompt's blocks, the shortlisted workers among them.
    let hs = prompt(2);
    let holders: HashSet<u32> = list
        .iter()
        .map(|l| l.hot.slot)
        .chain((0..600u32).map(|k| k * 3))
        .collect();
    for s in &holders {
        w.by_slot[s].kv.apply(true, &hs, &[]);
    }
    let pick = |tried: &HashSet<String>, turn| {
        let want = prefix_wanted(&hs, tried);
        let hits = picker.shortlist_hits(&list, &w.by_slot, &want, Instant::now(), turn);
        let got = picker
            .shortlisted_for(&list, &w.by_slot, &hits, |l| can_take(l, &want))
            .unwrap();
        let slots: HashSet<u32> = got.iter().map(|l| l.hot.slot).collect();
        assert_eq!(slots.len(), got.len(), "a worker taken twice");
        // Each listed worker is costed with its hits.
        for l in list.iter().filter(|l| holders.contains(&l.hot.slot)) {
            assert!(hits.iter().any(|h| h.0 == l.hot.slot && h.2 == 2));
        }
        slots
    };
    let none = HashSet::new();
    let slots = pick(&none, 0);
    let shortlisted: HashSet<u32> = list.iter().map(|l| l.hot.slot).collect();
    assert!(shortlisted.is_subset(&slots), "the shortlist is kept");
    assert_eq!(
        slots.len(),
        shortlisted.len() + MAX_HOLDERS,
        "{MAX_HOLDERS} of the 600 holders join"
    );
    assert!(slots
        .iter()
        .all(|s| holders.contains(s) || shortlisted.contains(s)));
    // Another turn, other holders of the same run.
    let next = pick(&none, 1_000);
    assert!(
        next.difference(&slots).count() > MAX_HOLDERS / 2,
        "{next:?}"
    );
    // One that cannot take the request (tried already) is left out, holder or not.
    let odd: HashSet<String> = w
        .list
        .iter()
        .filter(|l| l.hot.slot % 2 == 1)
        .map(|l| l.record.node_id.clone())
        .collect();
    let got = pick(&odd, 0);
    assert!(got.iter().all(|s| s % 2 == 0));
    let even_listed = shortlisted.iter().filter(|s| *s % 2 == 0).count();
    assert_eq!(got.len(), even_listed + MAX_HOLDERS);
}

#[test]
fn of_many_holders_those_with_the_longest_runs_are_costed() {
    let parts = Parts::default();
    let ws = workers(2000, &parts.index, |i| (i % 9) as i64);
    let picker = parts.picker(&ws, Policy::Prefix);
    parts.shortlist.saw(32, 16);
    picker.refresh_shortlist();
    let list = parts.shortlist.current().expect("a shortlist");
    let w = ws.read();
    let shortlisted: HashSet<u32> = list.iter().map(|l| l.hot.slot).collect();
    // 300 holders outside the shortlist, their runs 1..=300 blocks (the last 100 pending).
    let hs = prompt(300);
    let outside: Vec<u32> = (0..2000u32)
        .filter(|s| !shortlisted.contains(s))
        .take(300)
        .collect();
    let now = Instant::now();
    for (k, s) in outside.iter().enumerate() {
        let kv = &w.by_slot[s].kv;
        if k < 200 {
            kv.apply(true, &hs[..=k], &[]);
        } else {
            kv.expect(&hs[..=k], now);
        }
    }
    let tried = HashSet::new();
    let want = prefix_wanted(&hs, &tried);
    let hits = picker.shortlist_hits(&list, &w.by_slot, &want, now, 0);
    let got = picker
        .shortlisted_for(&list, &w.by_slot, &hits, |_| true)
        .unwrap();
    let joined: HashSet<u32> = got
        .iter()
        .map(|l| l.hot.slot)
        .filter(|s| !shortlisted.contains(s))
        .collect();
    let longest: HashSet<u32> = outside[300 - MAX_HOLDERS..].iter().copied().collect();
    assert_eq!(
        joined, longest,
        "the {MAX_HOLDERS} longest runs, and only they"
    );
    // A prefix pick goes to the longest run among them: the least loaded of those whose
    // cached prefix is longest, not a shortlisted worker that would compute it all.
    let c = picker.choose(&want, 0).unwrap();
    assert!(
        longest.contains(&c.link.hot.slot),
        "{}",
        c.link.record.node_id
    );
    assert!(c.cached_blocks > 300 - MAX_HOLDERS, "{}", c.cached_blocks);
}
