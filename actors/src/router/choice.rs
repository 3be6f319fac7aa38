//! Which worker a request goes to, and whether a prefill node computes its prompt: the
//! router's snapshot of each eligible worker turned into the policy's candidates, the pick,
//! and for a decode node the disaggregation decision.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::RwLock;

use super::config::DisaggConfig;
use super::links::{assume_for_unmeasured, ReportedSpeed, WorkerLink, Workers};
use super::shortlist::{uses_shortlist, Listed, Shortlist, SHORTLIST_FROM, SHORTLIST_LEN};
use super::stats::{Decision, PickTimes};
use crate::kv_index::KvIndex;
use crate::policy::{
    cost, pick, pick_prefill, two_choices, Candidate, Policy, PrefillCandidate, PrefixTuning,
    RequestShape,
};

/// The prompt rate assumed while no candidate has measured one (prompt tokens per second).
const UNMEASURED_PROMPT_RATE: f64 = 10_000.0;

/// A node picked for a request.
pub(crate) struct Choice {
    pub link: Arc<WorkerLink>,
    /// Leading prompt blocks it holds or is about to (prompts just sent there).
    pub cached_blocks: usize,
    /// Leading prompt blocks it reported holding.
    pub reported_blocks: usize,
    /// Prompt tokens it has to compute, as far as the router knows.
    pub uncached: usize,
    /// For a traced request: the candidates and their costs, as text.
    pub candidates: String,
}

/// What a pick knows of the request.
pub(crate) struct Wanted<'a> {
    /// The prompt's reusable block hashes (prefix policy; empty otherwise).
    pub hashes: &'a [u64],
    pub prompt_tokens: usize,
    /// Tokens it is expected to generate.
    pub output_tokens: usize,
    /// Prompt plus `max_tokens`: a worker must accept this context.
    pub length: usize,
    /// Workers already tried this round.
    pub tried: &'a HashSet<String>,
    /// Describe the candidates (a traced request).
    pub describe: bool,
}

/// What the router lends a pick: its worker set, prefix index, policy and counters.
pub(crate) struct Picker<'a> {
    pub workers: &'a RwLock<Workers>,
    pub index: &'a KvIndex,
    pub policy: Policy,
    pub tuning: PrefixTuning,
    pub picks: &'a PickTimes,
    pub shortlist: &'a Shortlist,
}

impl Picker<'_> {
    /// Picks a node for a request; `turn` is the router's round-robin counter.
    pub fn choose(&self, want: &Wanted, turn: u64) -> Option<Choice> {
        let started = Instant::now();
        // The worker set is read in place for the pick (membership changes wait that
        // long); only the chosen worker's handle is copied out.
        let workers = self.workers.read();
        let now = Instant::now();
        let prefix = self.policy == Policy::Prefix;
        let short = uses_shortlist(self.policy)
            .then(|| self.shortlist.current())
            .flatten();
        // The prompt's leading hits (prefix): of the workers the pick costs, from the index.
        let mut hits = Vec::new();
        let shortlisted = short.as_ref().and_then(|list| {
            self.shortlist.saw(want.prompt_tokens, want.output_tokens);
            if prefix {
                hits = self.shortlist_hits(list, &workers.by_slot, want, now, turn);
            }
            self.shortlisted_for(list, &workers.by_slot, &hits, |w| can_take(w, want))
        });
        let links = match shortlisted {
            Some(links) => links,
            None => {
                if prefix {
                    hits = self.index.leading_hits(want.hashes, now);
                }
                self.eligible(&workers, want, turn)
            }
        };
        if links.is_empty() {
            return None;
        }
        let block_size = links[0].record.block_size.max(1);
        let (cands, reported) = self.candidates(&links, &hits);
        let shape = RequestShape {
            prompt_tokens: want.prompt_tokens,
            block_size,
            output_tokens: want.output_tokens,
        };
        let i = pick(self.policy, &cands, shape, turn, self.tuning)?;
        if prefix {
            links[i].kv.expect(want.hashes, now);
        }
        self.picks.record(started.elapsed());
        let candidates = if want.describe {
            self.describe(&links, &cands, shape)
        } else {
            String::new()
        };
        Some(Choice {
            link: links[i].clone(),
            cached_blocks: cands[i].cached_blocks,
            reported_blocks: reported[i],
            uncached: want
                .prompt_tokens
                .saturating_sub(cands[i].cached_blocks * block_size),
            candidates,
        })
    }

    /// The workers the policy chooses among: every one that can take the request, or for
    /// power-of-two two drawn from the whole set (drawn again among those that can take it
    /// when a drawn one cannot).
    fn eligible<'w>(
        &self,
        workers: &'w Workers,
        want: &Wanted,
        turn: u64,
    ) -> Vec<&'w Arc<WorkerLink>> {
        let eligible = |w: &WorkerLink| can_take(w, want);
        // Power-of-two draws its two from the whole set and looks at nothing else; only
        // when a drawn one cannot take the request does it draw among those that can.
        let drawn: Option<Vec<&Arc<WorkerLink>>> = (self.policy == Policy::PowerOfTwo)
            .then(|| {
                two_choices(workers.list.len(), turn)
                    .into_iter()
                    .map(|i| &workers.list[i])
                    .collect::<Vec<_>>()
            })
            .filter(|d| d.len() == workers.list.len().min(2) && d.iter().all(|w| eligible(w)));
        match drawn {
            Some(d) => d,
            None => {
                let all: Vec<_> = workers.values().filter(|w| eligible(w)).collect();
                if self.policy == Policy::PowerOfTwo {
                    two_choices(all.len(), turn)
                        .into_iter()
                        .map(|i| all[i])
                        .collect()
                } else {
                    all
                }
            }
        }
    }

    /// Each link as the policy sees it, and the leading blocks each reported holding;
    /// `hits` are the prompt's leading hits by slot (prefix), sorted.
    pub(super) fn candidates(
        &self,
        links: &[&Arc<WorkerLink>],
        hits: &[(u32, usize, usize)],
    ) -> (Vec<Candidate>, Vec<usize>) {
        let mut reported = vec![0; links.len()];
        let mut speeds: Vec<ReportedSpeed> = links.iter().map(|w| w.pick_inputs()).collect();
        assume_for_unmeasured(&mut speeds);
        let cands = links
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let cached_blocks = match hits.binary_search_by_key(&w.hot.slot, |h| h.0) {
                    Ok(k) => {
                        reported[i] = hits[k].1;
                        hits[k].2
                    }
                    Err(_) => 0,
                };
                let sp = &speeds[i];
                Candidate {
                    load: sp.load,
                    capacity: sp.capacity,
                    cached_blocks,
                    queued_prompt_tokens: w.hot.queued_prompt.load(Ordering::Relaxed).max(0) as f64,
                    prefill_rate: sp.prompt_rate.unwrap_or(UNMEASURED_PROMPT_RATE),
                    step_base: sp.step_base,
                    step_per_seq: sp.step_per_seq,
                    max_running: sp.max_running,
                }
            })
            .collect();
        (cands, reported)
    }

    /// The candidates and their costs, for a traced request's span.
    fn describe(
        &self,
        links: &[&Arc<WorkerLink>],
        cands: &[Candidate],
        shape: RequestShape,
    ) -> String {
        links
            .iter()
            .zip(cands)
            .map(|(w, c)| {
                format!(
                    "{}: cost {:.4} s (load {:.0}, capacity {:.1} tok/s, step {:.2} ms + \
                     {:.3} ms/seq, cached blocks {}, queued prompt tokens {:.0}, prompt \
                     rate {:.0} tok/s)",
                    w.record.node_id,
                    cost(self.policy, c, shape),
                    c.load,
                    c.capacity,
                    c.step_base * 1e3,
                    c.step_per_seq * 1e3,
                    c.cached_blocks,
                    c.queued_prompt_tokens,
                    c.prefill_rate
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Whether `w` may be given the request: up, generating, with room for its context, and
/// not tried for it yet.
pub(crate) fn can_take(w: &WorkerLink, want: &Wanted) -> bool {
    w.available()
        && w.hot.generates
        && w.hot.max_model_len >= want.length
        && (want.tried.is_empty() || !want.tried.contains(&w.record.node_id))
}

/// Decides whether a request routed to `decode` is prefilled elsewhere, and where, among
/// `workers` (the router's, in id order).
pub(crate) fn prefill_for(
    workers: &[Arc<WorkerLink>],
    disagg: DisaggConfig,
    decode: &WorkerLink,
    prompt_len: usize,
    cached_blocks: usize,
) -> (Decision, Option<Arc<WorkerLink>>) {
    let uncached = prompt_len.saturating_sub(cached_blocks * decode.record.block_size);
    let links: Vec<_> = workers
        .iter()
        .filter(|w| {
            w.prefill_ready()
                && w.record.kv_layout.is_some()
                && w.record.kv_layout == decode.record.kv_layout
        })
        .collect();
    if links.is_empty() {
        return (Decision::NoPrefillWorker, None);
    }
    if uncached < disagg.min_tokens {
        return (Decision::ShortPrompt, None);
    }
    let cands: Vec<PrefillCandidate> = links
        .iter()
        .map(|w| {
            let r = w.prefill_load.load();
            let total = r.total_blocks as usize * w.record.block_size;
            PrefillCandidate {
                queued: r.waiting as f64 + w.prefills.load(Ordering::Relaxed).max(0) as f64,
                tokens_queued: r.tokens_in_flight as f64
                    + w.prefill_tokens.load(Ordering::Relaxed).max(0) as f64,
                tokens_per_s: r.tokens_per_s as f64,
                free_tokens: (1.0 - r.kv_usage as f64) * total as f64,
            }
        })
        .collect();
    match pick_prefill(&cands, uncached, disagg.max_queue) {
        Some(i) => (Decision::Remote, Some(links[i].clone())),
        None => (Decision::PrefillBusy, None),
    }
}

/// Holders of a prompt's leading blocks a shortlisted pick costs at most, besides the
/// shortlist itself: the shortlist brings the least loaded, these the longest cached
/// prefixes, and of equal ones each pick takes the next few.
pub(crate) const MAX_HOLDERS: usize = 16;

/// The [`SHORTLIST_LEN`] workers cheapest for the last request's shape, among all that take
/// requests; none below [`SHORTLIST_FROM`].
fn shortlisted(picker: &Picker) -> Vec<Arc<WorkerLink>> {
    let workers = picker.workers.read();
    if workers.list.len() < SHORTLIST_FROM {
        return Vec::new();
    }
    let links: Vec<&Arc<WorkerLink>> = workers
        .values()
        .filter(|w| w.available() && w.hot.generates)
        .collect();
    let Some(first) = links.first() else {
        return Vec::new();
    };
    let shape = picker.shortlist.shape(first.record.block_size.max(1));
    let cands = picker.candidates(&links, &[]).0;
    let n = links.len();
    let offset = picker.shortlist.next_turn() * SHORTLIST_LEN;
    let mut order: Vec<(f64, usize)> = cands
        .iter()
        .enumerate()
        .map(|(i, c)| (cost(Policy::LeastLoaded, c, shape), (i + offset) % n))
        .collect();
    let by_cost = |a: &(f64, usize), b: &(f64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
    if order.len() > SHORTLIST_LEN {
        order.select_nth_unstable_by(SHORTLIST_LEN, by_cost);
        order.truncate(SHORTLIST_LEN);
    }
    order
        .into_iter()
        .map(|(_, k)| links[(k + n - offset % n) % n].clone())
        .collect()
}

impl Picker<'_> {
    /// Chooses the shortlist again (see `shortlist`).
    pub(crate) fn refresh_shortlist(&self) {
        self.shortlist.set(shortlisted(self));
    }

    /// The leading hits a shortlisted pick costs: the shortlist's own, and those of the
    /// [`MAX_HOLDERS`] other workers able to take the request with the longest runs (of
    /// equal ones, a different few each turn). However many workers hold a shared prompt
    /// prefix, the pick's cost stays bounded: one left out has a cached prefix no longer
    /// than every holder kept, and is not among the shortlist's least loaded.
    pub(crate) fn shortlist_hits(
        &self,
        list: &Listed,
        by_slot: &HashMap<u32, Arc<WorkerLink>>,
        want: &Wanted,
        now: Instant,
        turn: u64,
    ) -> Vec<(u32, usize, usize)> {
        let keep = |slot| by_slot.get(&slot).is_some_and(|w| can_take(w, want));
        // Successive picks start their holders where the last one's left off.
        let from = (turn as usize).wrapping_mul(MAX_HOLDERS);
        self.index
            .top_hits(want.hashes, now, MAX_HOLDERS, &list.slots, keep, from)
    }

    /// The shortlisted workers that can take the request, and the other holders of its
    /// leading blocks in `hits` (by slot: see `shortlist_hits`); `None` where none can (the
    /// pick then scans).
    pub(crate) fn shortlisted_for<'w>(
        &self,
        list: &'w Listed,
        by_slot: &'w HashMap<u32, Arc<WorkerLink>>,
        hits: &[(u32, usize, usize)],
        eligible: impl Fn(&WorkerLink) -> bool,
    ) -> Option<Vec<&'w Arc<WorkerLink>>> {
        let mut links: Vec<&Arc<WorkerLink>> = list.iter().filter(|w| eligible(w)).collect();
        let holders = hits
            .iter()
            .filter(|h| list.slots.binary_search(&h.0).is_err())
            .filter_map(|h| by_slot.get(&h.0).filter(|w| eligible(w)));
        links.extend(holders);
        (!links.is_empty()).then_some(links)
    }
}
