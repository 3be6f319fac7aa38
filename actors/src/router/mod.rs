//! The router role's data path: keeps a QUIC connection to every worker the registry lists
//! (pinned to the certificate fingerprint in its record), reads their load reports, and
//! sends each request to the worker the policy picks.
//!
//! Disaggregation is decode-first: the policy picks a worker or decode node; for a decode
//! node, when the part of the prompt it is not known to cache is at least
//! `--disagg-min-tokens` and a prefill node with a compatible KV layout has room, the
//! request names that prefill node (the least expected wait), and the decode node fetches
//! the prompt's KV from it. Every decision is counted by its reason.
//!
//! A worker whose connection breaks is out of routing at once; the registry lease is the
//! backstop. What a request does when its worker fails (retry, wait, migrate, give up) is
//! [`attempts`]'s.
//!
//! - `links`: the workers as the router knows them, kept connected;
//! - `pools`: one core per served model, picked by a request's `model`;
//! - `membership`: which members a pool routes to;
//! - `choice`: the candidates a policy sees, the pick, the prefill decision;
//! - `attempts`: one request's retries and migrations;
//! - `stream`: one attempt's token stream from its worker;
//! - `stats`: what the router counts, and its metrics.

mod attempts;
mod choice;
mod config;
mod link_state;
mod links;
mod membership;
mod pools;
mod shortlist;
#[cfg(test)]
mod shortlist_tests;
mod stats;
mod stream;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use kvmesh_discovery::{Membership, Role};
use kvmesh_gateway::dispatch::{Driven, Event, Reply};
use kvmesh_gpu::engine::Request;
use kvmesh_gpu::kv_cache::block_hashes;
use kvmesh_telemetry::metrics::Exposition;
use kvmesh_telemetry::TARGET;
use kvmesh_transport::wire::{GenerateRequest, PrefillPeer};
use kvmesh_transport::NodeEndpoint;
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;
use tracing::{field::Empty, Instrument};

use crate::convert;
use crate::kv_index::KvIndex;
use crate::policy::{Policy, PrefixTuning};
use attempts::{AttemptInfo, Attempts, Outcome, Route, Streamed};
use choice::{Choice, Picker, Wanted};
use links::{InFlight, PrefillInFlight, QueuedPrompt, Workers};

pub use attempts::{FULL_ROUNDS, UNSTARTED_PATIENCE};
pub use config::{DisaggConfig, RouterConfig};
pub use links::{KvSlot, WorkerLink};
pub use membership::REGISTRY_GRACE;
pub use pools::{fetch_card_from, CardFetchError, Pinned, Pools};
pub use stats::{Decision, PickTimes, PoolView, RouterStats};

/// The metric families of a router's pools, each series labelled with its `model_name`.
pub fn render_pools(pools: &[Arc<RouterCore>], out: &Exposition) {
    let views: Vec<PoolView> = pools.iter().map(|p| p.view()).collect();
    stats::render(&views, out);
}

pub struct RouterCore {
    pub node_id: String,
    pub model: String,
    /// This router's model fingerprint; workers must publish the same one.
    pub model_fingerprint: String,
    /// Workers of this model name it will not route to, and why.
    pub refused: Mutex<BTreeMap<String, String>>,
    pub policy: Policy,
    pub disagg: DisaggConfig,
    pub migration_limit: u32,
    pub tuning: PrefixTuning,
    endpoint: NodeEndpoint,
    workers: RwLock<Workers>,
    turn: AtomicU64,
    next_id: AtomicU64,
    /// Which workers hold which prompt blocks (prefix policy), and the next worker slot.
    kv_index: Arc<KvIndex>,
    next_slot: AtomicU32,
    /// Tokens a finished request generated, smoothed (f64 bits; 0 until one finished):
    /// how long a new request is expected to decode, where its max_tokens is larger.
    mean_output: AtomicU64,
    pub stats: RouterStats,
    /// What picks over thousands of workers cost (see `shortlist`), and whether its task
    /// runs.
    shortlist: shortlist::Shortlist,
    shortlisting: std::sync::atomic::AtomicBool,
    /// Turns to dial a worker: at most [`links::DIALS_AT_ONCE`] handshakes at a time.
    dials: Arc<tokio::sync::Semaphore>,
}

impl RouterCore {
    pub fn new(
        node_id: String,
        model: String,
        model_fingerprint: String,
        policy: Policy,
        config: RouterConfig,
        endpoint: NodeEndpoint,
    ) -> Arc<Self> {
        Arc::new(RouterCore {
            node_id,
            model,
            model_fingerprint,
            refused: Mutex::new(BTreeMap::new()),
            policy,
            disagg: config.disagg,
            migration_limit: config.migration_limit,
            tuning: config.prefix,
            endpoint,
            workers: RwLock::new(Workers::default()),
            turn: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            kv_index: Arc::new(KvIndex::default()),
            next_slot: AtomicU32::new(0),
            mean_output: AtomicU64::new(0),
            stats: RouterStats::default(),
            shortlist: Default::default(),
            shortlisting: Default::default(),
            dials: Arc::new(tokio::sync::Semaphore::new(links::DIALS_AT_ONCE)),
        })
    }

    /// What a pick borrows of the router.
    fn picker(&self) -> Picker<'_> {
        Picker {
            workers: &self.workers,
            index: &self.kv_index,
            policy: self.policy,
            tuning: self.tuning,
            picks: &self.stats.picks,
            shortlist: &self.shortlist,
        }
    }

    /// Workers in id order.
    pub fn workers(&self) -> Vec<Arc<WorkerLink>> {
        self.workers.read().values().cloned().collect()
    }

    /// Connected nodes that take generate requests.
    pub fn routable(&self) -> Vec<Arc<WorkerLink>> {
        self.with_routable(|ws| ws.cloned().collect())
    }

    /// `f` over the routable workers, read in place (no copy of the set).
    fn with_routable<R>(
        &self,
        f: impl FnOnce(&mut dyn Iterator<Item = &Arc<WorkerLink>>) -> R,
    ) -> R {
        let workers = self.workers.read();
        let mut it = workers
            .values()
            .filter(|w| w.available() && w.hot.generates);
        f(&mut it)
    }

    /// The longest context some routable worker accepts (None without workers): requests
    /// go only to workers whose own limit fits them, so one small worker shrinks nobody's.
    pub fn max_model_len(&self) -> Option<usize> {
        self.with_routable(|ws| ws.map(|w| w.record.max_model_len).max())
    }

    /// Brings the worker set in line with the registry: new workers get a connection task,
    /// departed ones are closed and forgotten, changed records (a restarted node: new
    /// address or certificate) are replaced.
    pub fn apply_membership(self: &Arc<Self>, members: &Membership) {
        let model = membership::Model {
            name: &self.model,
            fingerprint: &self.model_fingerprint,
        };
        let added = membership::apply(
            &self.workers,
            &self.refused,
            members,
            &model,
            &self.kv_index,
            &self.next_slot,
        );
        let wants_kv = self.policy == Policy::Prefix;
        if shortlist::uses_shortlist(self.policy)
            && !self.shortlisting.swap(true, Ordering::Relaxed)
        {
            tokio::spawn(refresh_shortlist_while(Arc::downgrade(self)));
        }
        for link in added {
            let dial = (self.endpoint.clone(), self.dials.clone());
            tokio::spawn(links::maintain(dial, link, wants_kv));
        }
    }

    /// Queues a request on a worker; its events arrive on the returned reply, and dropping
    /// the reply cancels the request on the worker. With no routable worker it waits for
    /// one (a worker restarting or joining), up to `attempts::UNSTARTED_PATIENCE`, then is
    /// refused with 503.
    pub fn submit(self: &Arc<Self>, req: Request) -> Reply {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        // A child of the caller's span (the gateway's request).
        let span = tracing::info_span!(
            target: TARGET,
            "route",
            node = self.node_id.as_str(),
            model = self.model.as_str(),
            pool = self.model_fingerprint.as_str(),
            policy = self.policy.as_str(),
            prompt_tokens = req.prompt.len(),
            attempts = Empty,
            migrations = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
        );
        let attempts = Attempts::new(
            convert::request_to_wire(id, &req),
            self.migration_limit,
            tokio::time::Instant::now(),
        );
        let core = self.clone();
        // Run by the reader's own task as it awaits the events (no spawn, and no hand-off
        // between tasks per token); dropping the reply cancels it.
        let driver = async move { attempts::drive(&*core, attempts, &core.stats, &tx).await };
        Reply::Driven(Driven::new(id, rx, driver.instrument(span)))
    }

    /// Tokens a request allowed `max_tokens` is expected to generate: the smoothed length
    /// of finished ones (128 before any), at most `max_tokens`.
    fn expected_output(&self, max_tokens: usize) -> usize {
        let mean = f64::from_bits(self.mean_output.load(Ordering::Relaxed));
        let mean = if mean > 0.0 {
            mean.round() as usize
        } else {
            128
        };
        mean.clamp(1, max_tokens.max(1))
    }

    fn note_output(&self, tokens: usize) {
        let _ = self
            .mean_output
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = if old > 0.0 {
                    0.95 * old + 0.05 * tokens as f64
                } else {
                    tokens as f64
                };
                Some(new.max(1.0).to_bits())
            });
    }

    /// The blocks of `prompt` a worker can reuse (prefix policy): all full ones but the last
    /// token's, which is always computed, to give the first token's logits.
    fn reusable_hashes(&self, prompt: &[u32]) -> Vec<u64> {
        if self.policy != Policy::Prefix {
            return Vec::new();
        }
        let block_size =
            self.with_routable(|ws| ws.next().map_or(16, |w| w.record.block_size.max(1)));
        let reusable = prompt.len().saturating_sub(1) / block_size * block_size;
        block_hashes(&prompt[..reusable], block_size)
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    /// Names a prefill node in a request routed to a decode node, when the router
    /// disaggregates it; the span and counters say what was decided.
    fn disaggregate(
        &self,
        choice: &Choice,
        wire: &mut GenerateRequest,
        attempt: &tracing::Span,
    ) -> Option<PrefillInFlight> {
        let link = &choice.link;
        let (decision, prefill) = choice::prefill_for(
            &self.workers(),
            self.disagg,
            link,
            wire.prompt.len(),
            choice.reported_blocks,
        );
        self.stats.disagg[decision as usize].fetch_add(1, Ordering::Relaxed);
        attempt.record("disagg", decision.as_str());
        let pl = prefill?;
        let uncached = wire
            .prompt
            .len()
            .saturating_sub(choice.cached_blocks * link.record.block_size);
        pl.prefilled.fetch_add(1, Ordering::Relaxed);
        attempt.record("prefill_worker", pl.record.node_id.as_str());
        wire.prefill = Some(PrefillPeer {
            node_id: pl.record.node_id.clone(),
            quic_addr: pl.record.quic_addr.clone(),
            cert_sha256: pl.record.cert_sha256.clone(),
            min_tokens: self.disagg.min_tokens as u32,
            ucx: pl.record.kv_transports.iter().any(|t| t == "ucx"),
            cuda_ipc: pl.record.kv_transports.iter().any(|t| t == "cuda-ipc"),
            ucx_cuda: pl.record.kv_transports.iter().any(|t| t == "ucx-cuda"),
        });
        Some(PrefillInFlight::new(pl, uncached as i64))
    }

    /// How well the worker's own account predicted its prefix hit, for the prefix policy.
    fn count_prediction(&self, choice: &Choice, got: usize, attempt: &tracing::Span) {
        let expected = choice.reported_blocks * choice.link.record.block_size.max(1);
        let k = match got.cmp(&expected) {
            std::cmp::Ordering::Equal => 0,
            std::cmp::Ordering::Less => 1,
            std::cmp::Ordering::Greater => 2,
        };
        self.stats.predictions[k].fetch_add(1, Ordering::Relaxed);
        attempt.record("predicted_cached_tokens", expected);
    }

    /// This pool's part of the router's metrics.
    pub fn view(&self) -> stats::PoolView<'_> {
        stats::PoolView {
            model: &self.model,
            stats: &self.stats,
            workers: self.workers(),
        }
    }
}

impl Route for RouterCore {
    type Pick = Choice;

    fn choose(
        &self,
        req: &GenerateRequest,
        tried: &HashSet<String>,
        describe: bool,
    ) -> Option<Choice> {
        let hashes = self.reusable_hashes(&req.prompt);
        let want = Wanted {
            hashes: &hashes,
            prompt_tokens: req.prompt.len(),
            output_tokens: self.expected_output(req.max_tokens as usize),
            length: req.prompt.len() + req.max_tokens as usize,
            tried,
            describe,
        };
        self.picker()
            .choose(&want, self.turn.fetch_add(1, Ordering::Relaxed))
    }

    fn worker<'p>(&self, pick: &'p Choice) -> &'p str {
        &pick.link.record.node_id
    }

    async fn attempt(
        &self,
        choice: Choice,
        mut wire: GenerateRequest,
        info: AttemptInfo,
        sent: &mut Streamed,
        tx: &mpsc::UnboundedSender<Event>,
    ) -> Outcome {
        // Each try is its own span, a child of the route; the worker continues it. A
        // migration's try names the tokens it resumes after.
        let attempt = tracing::info_span!(
            target: TARGET,
            "attempt",
            n = info.n,
            worker = choice.link.record.node_id.as_str(),
            candidates = choice.candidates.as_str(),
            cached_blocks = choice.cached_blocks,
            predicted_cached_tokens = Empty,
            migration = info.migration,
            resumed_after_tokens = info.resumed_after,
            disagg = Empty,
            prefill_worker = Empty,
            outcome = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
        );
        let link = choice.link.clone();
        link.routed.fetch_add(1, Ordering::Relaxed);
        let guard = InFlight::new(&link, (wire.prompt.len() + wire.max_tokens as usize) as i64);
        // Until its first token, the prompt is work queued there (or on its prefill node).
        let mut queued = Some(QueuedPrompt::new(link.clone(), choice.uncached as i64));
        let mut prefill = None;
        if link.record.has_role(Role::Decode) {
            prefill = self.disaggregate(&choice, &mut wire, &attempt);
            if prefill.is_some() {
                queued = None;
            }
        }
        wire.traceparent = kvmesh_telemetry::traceparent(&attempt);
        let before = sent.tokens.len();
        let outcome = stream::stream_from(&link, &wire, tx, &mut prefill, &mut queued, sent)
            .instrument(attempt.clone())
            .await;
        drop(guard);
        if self.policy == Policy::Prefix && sent.tokens.len() > before {
            self.count_prediction(&choice, sent.attempt_cached, &attempt);
        }
        if outcome == Outcome::Done {
            self.note_output(sent.tokens.len());
        }
        let (what, error) = outcome.describe();
        attempt.record("outcome", what);
        if let Some(e) = error {
            attempt.record("otel.status_code", "ERROR");
            attempt.record("otel.status_description", e);
        }
        outcome
    }
}

/// Chooses the router's shortlist every [`shortlist::REFRESH`] for as long as the router lives.
async fn refresh_shortlist_while(core: std::sync::Weak<RouterCore>) {
    let mut tick = tokio::time::interval(shortlist::REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(core) = core.upgrade() else { return };
        core.picker().refresh_shortlist();
    }
}
