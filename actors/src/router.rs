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
//! backstop. A request that has not produced a token when its worker fails is retried on
//! another worker. One already streaming **migrates**: the router resubmits the prompt plus
//! the tokens already streamed (and the seeded generator's draws spent on them) to another
//! worker, which continues the sequence; the client's stream goes on with no repeated or
//! missing token. A request migrates at most `migration_limit` times, then ends with an
//! error event naming the worker.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_discovery::{Membership, NodeRecord};
use kvmesh_gpu::engine::{FinishReason, Request, SeqEvent, SeqId, Submission, Unavailable};
use kvmesh_gpu::kv_cache::block_hashes;
use kvmesh_gpu::sampler::Sampled;
use kvmesh_transport::wire::{
    self, Finish, GenerateRequest, KvEventBatch, LoadReport, PrefillPeer, StreamRequest,
    TokenEvent, UniHeader,
};
use kvmesh_transport::{Connection, NodeEndpoint};
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;

use kvmesh_telemetry::TARGET;
use tracing::{field::Empty, Instrument};

use crate::kv_index::KvIndex;
use crate::policy::{
    cost, pick, pick_prefill, two_choices, Candidate, Policy, PrefillCandidate, PrefixTuning,
    RequestShape,
};

/// How long a request that has produced nothing waits for some worker to take it, after
/// every worker it tried failed or refused it.
const UNSTARTED_PATIENCE: Duration = Duration::from_secs(10);

/// How long a worker whose record left the registry stays in routing while its connection
/// lives (and it is not draining): long enough for every node to register again after the
/// registry lost its data. Call [`RouterCore::apply_membership`] at least every second so
/// the grace ends on time.
pub const REGISTRY_GRACE: Duration = Duration::from_secs(30);

/// How many more rounds over the workers a request makes, backing off between them, when
/// every worker's queue was full, before it is refused with 429.
const FULL_ROUNDS: u32 = 2;

/// The prompt rate assumed while no candidate has measured one (prompt tokens per second).
const UNMEASURED_PROMPT_RATE: f64 = 10_000.0;

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("no worker is available for model '{0}'; try again when one has joined")]
    NoWorkers(String),
}

/// The workers a router knows, by id, and the same in a list a draw can index (rebuilt
/// when the set changes).
#[derive(Default)]
struct Workers {
    by_id: BTreeMap<String, Arc<WorkerLink>>,
    list: Vec<Arc<WorkerLink>>,
}

impl Workers {
    fn values(&self) -> std::slice::Iter<'_, Arc<WorkerLink>> {
        self.list.iter()
    }
}

/// What a routing decision reads of a worker, kept together so that a pick over hundreds
/// of workers touches two cache lines of each instead of a dozen scattered ones.
#[repr(C, align(64))]
struct PickState {
    /// Set while the link holds a connection, cleared when it breaks.
    up: AtomicBool,
    /// Its last report said it is shutting down.
    draining: AtomicBool,
    /// Its record names the worker or decode role.
    generates: bool,
    /// Its slot in the router's prefix index.
    slot: u32,
    max_model_len: usize,
    /// Requests this router has in flight there.
    outstanding: AtomicI64,
    /// Uncached prompt tokens of requests this router sent there with no first token yet.
    queued_prompt: AtomicI64,
    /// A token from it has reached this router: from then on its reports measure it.
    streamed: AtomicBool,
    /// Its last report's speeds, as a pick wants them.
    speed: AtomicSpeeds,
}

/// [`Speeds`] in atomics, so that a pick over hundreds of workers reads them with plain
/// loads instead of taking and releasing a lock on each (two atomic read-modify-writes a
/// worker, most of a pick's time). A pick racing a report may see fields of both; each is a
/// valid estimate of the same worker.
struct AtomicSpeeds {
    others: AtomicI64,
    capacity: AtomicU64,
    prompt_rate: AtomicU64,
    step_base: AtomicU64,
    step_per_seq: AtomicU64,
    max_running: AtomicU64,
}

impl AtomicSpeeds {
    fn new(s: Speeds) -> AtomicSpeeds {
        let f = |x: f64| AtomicU64::new(x.to_bits());
        AtomicSpeeds {
            others: AtomicI64::new(s.others),
            capacity: f(s.capacity),
            prompt_rate: f(s.prompt_rate),
            step_base: f(s.step_base),
            step_per_seq: f(s.step_per_seq),
            max_running: f(s.max_running),
        }
    }

    fn store(&self, s: Speeds) {
        let r = Ordering::Relaxed;
        self.others.store(s.others, r);
        self.capacity.store(s.capacity.to_bits(), r);
        self.prompt_rate.store(s.prompt_rate.to_bits(), r);
        self.step_base.store(s.step_base.to_bits(), r);
        self.step_per_seq.store(s.step_per_seq.to_bits(), r);
        self.max_running.store(s.max_running.to_bits(), r);
    }

    fn load(&self) -> Speeds {
        let f = |a: &AtomicU64| f64::from_bits(a.load(Ordering::Relaxed));
        Speeds {
            others: self.others.load(Ordering::Relaxed),
            capacity: f(&self.capacity),
            prompt_rate: f(&self.prompt_rate),
            step_base: f(&self.step_base),
            step_per_seq: f(&self.step_per_seq),
            max_running: f(&self.max_running),
        }
    }
}

/// A worker's speeds from its last report (or its record's declaration before one).
#[derive(Clone, Copy)]
struct Speeds {
    /// Its running and waiting requests when reported, less this router's at the time.
    others: i64,
    capacity: f64,
    /// 0 until measured.
    prompt_rate: f64,
    step_base: f64,
    step_per_seq: f64,
    max_running: f64,
}

impl Speeds {
    fn of(report: Option<&(LoadReport, i64)>, declared_capacity: f64) -> Speeds {
        let Some((r, own_then)) = report else {
            return Speeds {
                others: 0,
                capacity: declared_capacity.max(1e-3),
                prompt_rate: 0.0,
                step_base: 0.0,
                step_per_seq: 0.0,
                max_running: 0.0,
            };
        };
        let secs = |ms: f32| f64::from(ms.max(0.0)) / 1e3;
        let capacity = r.capacity_tokens_per_s as f64;
        Speeds {
            others: (i64::from(r.running) + i64::from(r.waiting) - own_then).max(0),
            capacity: if capacity > 0.0 {
                capacity
            } else {
                declared_capacity
            }
            .max(1e-3),
            prompt_rate: (r.prompt_tokens_per_s as f64).max(0.0),
            step_base: secs(r.step_base_ms),
            step_per_seq: secs(r.step_per_seq_ms),
            max_running: f64::from(r.max_running),
        }
    }
}

/// One worker as the router knows it.
pub struct WorkerLink {
    pub record: NodeRecord,
    conn: Mutex<Option<Connection>>,
    /// All a pick reads of it, in two cache lines.
    hot: PickState,
    /// Its latest load report, and how many requests this router had there when it came.
    report: Mutex<Option<(LoadReport, i64)>>,
    /// What its prefix cache holds, from its events: its slot in the router's index.
    pub kv: KvSlot,
    /// Tokens (prompt + max_tokens) of the requests this router has in flight there.
    outstanding_tokens: AtomicI64,
    /// Prompts this router sent there to prefill whose first token has not come yet, and
    /// their uncached tokens.
    prefills: AtomicI64,
    prefill_tokens: AtomicI64,
    pub routed: AtomicU64,
    /// Prompts sent there to prefill.
    pub prefilled: AtomicU64,
    gone: AtomicBool,
    /// When its record left the registry while its connection lived on.
    vanished: Mutex<Option<Instant>>,
    /// When its last load report came.
    reported_at: Mutex<Option<Instant>>,
}

impl WorkerLink {
    fn connection(&self) -> Option<Connection> {
        self.conn.lock().clone()
    }

    pub fn connected(&self) -> bool {
        self.conn
            .lock()
            .as_ref()
            .is_some_and(|c| c.close_reason().is_none())
    }

    /// Connected and not shutting down: may be given new requests. (A connection that
    /// broke a moment ago may still count until its task notices; a request sent there
    /// fails before its first token and goes elsewhere.)
    pub fn available(&self) -> bool {
        self.hot.up.load(Ordering::Acquire) && !self.hot.draining.load(Ordering::Acquire)
    }

    /// Its last report said it is shutting down (it finishes what it has).
    pub fn draining(&self) -> bool {
        self.hot.draining.load(Ordering::Acquire)
    }

    /// Takes its latest load report.
    fn set_report(&self, report: Option<LoadReport>) {
        let own = self.hot.outstanding.load(Ordering::Relaxed).max(0);
        self.hot.draining.store(
            report.as_ref().is_some_and(|r| r.draining),
            Ordering::Release,
        );
        let mut kept = self.report.lock();
        *kept = report.map(|r| (r, own));
        self.hot
            .speed
            .store(Speeds::of(kept.as_ref(), self.record.capacity_tokens_per_s));
    }

    pub fn last_report(&self) -> Option<LoadReport> {
        self.report.lock().as_ref().map(|(r, _)| r.clone())
    }

    /// Requests there: this router's own, known at once, plus those of others (the
    /// worker's last count beyond what this router had there when it was reported). A
    /// report up to one interval old thus never counts a request that has since finished.
    pub fn load(&self) -> f64 {
        self.pick_inputs().load
    }

    /// Takes generate requests (a worker or decode role).
    pub fn generates(&self) -> bool {
        self.hot.generates
    }

    /// Prefills for decode workers.
    pub fn prefills(&self) -> bool {
        self.record.has_role("prefill")
    }

    /// A prefill node a decode worker may be sent to: connected, and it has reported its
    /// queue and KV room (the first report follows the connection at once). Until then its
    /// room is unknown, and a pick would take it as full.
    fn prefill_ready(&self) -> bool {
        self.prefills() && self.available() && self.report.lock().is_some()
    }

    /// Prompt tokens per second it computes, once measured.
    pub fn prompt_rate(&self) -> Option<f64> {
        self.pick_inputs().prompt_rate
    }

    /// What a pick needs from its last report, read with atomic loads: capacity, prompt rate
    /// (once measured), the decode step fit in seconds, and its batch limit.
    fn pick_inputs(&self) -> ReportedSpeed {
        let sp = self.hot.speed.load();
        let own = self.hot.outstanding.load(Ordering::Relaxed).max(0);
        ReportedSpeed {
            load: (own + sp.others) as f64,
            fresh: !self.hot.streamed.load(Ordering::Relaxed),
            capacity: sp.capacity,
            prompt_rate: (sp.prompt_rate > 0.0).then_some(sp.prompt_rate),
            step_base: sp.step_base,
            step_per_seq: sp.step_per_seq,
            max_running: sp.max_running,
        }
    }

    pub fn capacity(&self) -> f64 {
        self.pick_inputs().capacity
    }
}

/// A worker's speeds as its last report gave them (see [`WorkerLink::pick_inputs`]).
struct ReportedSpeed {
    /// As [`WorkerLink::load`] reads it.
    load: f64,
    /// No token from it has reached this router yet: nothing it reported measures it.
    fresh: bool,
    capacity: f64,
    prompt_rate: Option<f64>,
    step_base: f64,
    step_per_seq: f64,
    max_running: f64,
}

impl ReportedSpeed {
    /// It has decoded and reported its step fit.
    fn step_measured(&self) -> bool {
        self.step_base > 0.0 || self.step_per_seq > 0.0
    }
}

/// What a pick assumes of workers that have not measured themselves yet: no faster than
/// the slowest that has, so being new never makes a cache miss or a busy node look cheap.
/// The prompt rate is the lowest measured one. A worker that has not streamed this router
/// a token yet also takes the slowest decode step fit (at a one-sequence batch): a worker
/// measured on a busy machine is thus compared with the same machine, not with a
/// declaration. That holds while its first requests are still in prefill too: in a burst,
/// the workers just sent their first requests are costed like the one that has decoded,
/// by their queued prompts and batches, not by a declared rate that makes each request
/// there look several times dearer. With nothing measured anywhere, the prompt rate stays
/// unknown and the step at the declared rate.
fn assume_for_unmeasured(speeds: &mut [ReportedSpeed]) {
    let prompt_rate = speeds.iter().filter_map(|s| s.prompt_rate).reduce(f64::min);
    let step = speeds
        .iter()
        .filter(|s| s.step_measured())
        .map(|s| (s.step_base, s.step_per_seq))
        .reduce(|a, b| if b.0 + b.1 > a.0 + a.1 { b } else { a });
    for s in speeds.iter_mut() {
        // Only a worker that has not streamed a token borrows a step fit. One that has
        // served but has no fit (a saturated worker may run no pure decode step for long)
        // keeps being costed by its own measured per-sequence rate, which weighs its load.
        let fresh = s.fresh && !s.step_measured();
        s.prompt_rate = s.prompt_rate.or(prompt_rate);
        if let (true, Some((base, per_seq))) = (fresh, step) {
            (s.step_base, s.step_per_seq) = (base, per_seq);
        }
    }
}

/// A worker's place in its router's [`KvIndex`]: what its prefix cache holds, from its
/// events, plus what was just sent there. Forgotten when the link goes.
pub struct KvSlot {
    index: Arc<Mutex<KvIndex>>,
    pub slot: u32,
}

impl KvSlot {
    fn new(index: &Arc<Mutex<KvIndex>>, next: &AtomicU32) -> KvSlot {
        KvSlot {
            index: index.clone(),
            slot: next.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn apply(&self, snapshot: bool, stored: &[u64], removed: &[u64]) {
        self.index
            .lock()
            .apply(self.slot, snapshot, stored, removed);
    }

    /// The worker was lost: nothing it held can be counted on.
    fn clear(&self) {
        self.index.lock().clear_worker(self.slot);
    }

    fn expect(&self, hashes: &[u64], now: Instant) {
        self.index.lock().expect(self.slot, hashes, now);
    }

    /// Blocks it reported holding.
    pub fn held(&self) -> usize {
        self.index.lock().held(self.slot)
    }

    /// Its snapshot has arrived: the view is its own account.
    pub fn synced(&self) -> bool {
        self.index.lock().synced(self.slot)
    }
}

impl Drop for KvSlot {
    fn drop(&mut self) {
        self.index.lock().clear_worker(self.slot);
    }
}

#[derive(Default)]
pub struct RouterStats {
    pub routed: AtomicU64,
    pub retries: AtomicU64,
    pub failed_midstream: AtomicU64,
    /// Requests moved to another worker after tokens were streamed.
    pub migrations: AtomicU64,
    /// Prefix routing: the cached prompt tokens the router expected from the worker's
    /// events against what the worker reported: equal, more, fewer.
    pub predictions: [AtomicU64; 3],
    pub no_worker: AtomicU64,
    /// Requests refused because every worker's queue was full.
    pub full: AtomicU64,
    /// Requests routed to decode nodes, by disaggregation decision.
    pub disagg: [AtomicU64; Decision::COUNT],
    /// How long routing decisions take.
    pub picks: PickTimes,
}

/// Upper bounds of the pick-time histogram's buckets, in microseconds.
const PICK_BUCKETS_US: [u64; 10] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000];

/// The time each routing decision took: from reading the worker set to the policy's pick
/// (building every candidate and the prompt's cached blocks included; describing the
/// candidates for a sampled trace not).
#[derive(Default)]
pub struct PickTimes {
    pub count: AtomicU64,
    pub sum_ns: AtomicU64,
    pub max_ns: AtomicU64,
    /// Picks at most each of [`PICK_BUCKETS_US`] (not cumulative).
    buckets: [AtomicU64; PICK_BUCKETS_US.len()],
    /// The last [`RECENT_PICKS`] times, in ns (a ring), for percentiles.
    recent: Mutex<(Vec<u32>, usize)>,
}

/// How many recent pick times the percentiles are taken over.
const RECENT_PICKS: usize = 1024;

impl PickTimes {
    fn record(&self, took: Duration) {
        let ns = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
        if let Some(b) = PICK_BUCKETS_US.iter().position(|&us| ns <= us * 1000) {
            self.buckets[b].fetch_add(1, Ordering::Relaxed);
        }
        let mut recent = self.recent.lock();
        let (ring, next) = &mut *recent;
        let v = ns.min(u64::from(u32::MAX)) as u32;
        if ring.len() < RECENT_PICKS {
            ring.push(v);
        } else {
            ring[*next] = v;
        }
        *next = (*next + 1) % RECENT_PICKS;
    }

    /// Percentiles (0..=100) of the recent pick times, in microseconds (empty before the
    /// first pick).
    pub fn recent_percentiles_us(&self, ps: &[f64]) -> Vec<f64> {
        let mut v = self.recent.lock().0.clone();
        if v.is_empty() {
            return Vec::new();
        }
        v.sort_unstable();
        ps.iter()
            .map(|p| {
                let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
                f64::from(v[i.min(v.len() - 1)]) / 1e3
            })
            .collect()
    }

    /// Mean pick time in microseconds (0 before the first).
    pub fn mean_us(&self) -> f64 {
        let n = self.count.load(Ordering::Relaxed);
        if n == 0 {
            return 0.0;
        }
        self.sum_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e3
    }

    /// A Prometheus histogram, in seconds.
    fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let name = "kvmesh:router_pick_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time a routing decision takes (every candidate built and the \
             policy's pick).\n# TYPE {name} histogram"
        );
        let mut below = 0;
        for (us, b) in PICK_BUCKETS_US.iter().zip(&self.buckets) {
            below += b.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {below}", *us as f64 / 1e6);
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// What the router decided about prefilling a request routed to a decode node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// A prefill node computes the prompt and streams its KV to the decode node.
    Remote,
    /// Too little of the prompt is uncached: the decode node prefills it.
    ShortPrompt,
    /// No prefill node with this model and KV layout is connected.
    NoPrefillWorker,
    /// Every such prefill node has a full queue or no KV room for the prompt.
    PrefillBusy,
}

impl Decision {
    const COUNT: usize = 4;
    const ALL: [Decision; 4] = [
        Decision::Remote,
        Decision::ShortPrompt,
        Decision::NoPrefillWorker,
        Decision::PrefillBusy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Remote => "remote",
            Decision::ShortPrompt => "short_prompt",
            Decision::NoPrefillWorker => "no_prefill_worker",
            Decision::PrefillBusy => "prefill_busy",
        }
    }
}

/// When to disaggregate.
#[derive(Clone, Copy, Debug)]
pub struct DisaggConfig {
    /// Prefill remotely only prompts with at least this many uncached tokens.
    pub min_tokens: usize,
    /// A prefill node with this many prompts queued (reported, or sent by this router and
    /// not yet started) has no room.
    pub max_queue: usize,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig {
            min_tokens: 256,
            max_queue: 8,
        }
    }
}

/// How a router routes, beyond its policy.
#[derive(Clone, Copy, Debug)]
pub struct RouterConfig {
    pub disagg: DisaggConfig,
    /// How many times one request may move to another worker after tokens were streamed
    /// (its worker lost mid-stream); past that it ends with an error event.
    pub migration_limit: u32,
    pub prefix: PrefixTuning,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            disagg: DisaggConfig::default(),
            migration_limit: 3,
            prefix: PrefixTuning::default(),
        }
    }
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
    kv_index: Arc<Mutex<KvIndex>>,
    next_slot: AtomicU32,
    /// Tokens a finished request generated, smoothed (f64 bits; 0 until one finished):
    /// how long a new request is expected to decode, where its max_tokens is larger.
    mean_output: AtomicU64,
    pub stats: RouterStats,
}

enum Outcome {
    Done,
    ClientGone,
    /// Nothing reached the client: another worker may take it.
    NotStarted(String),
    /// The worker's queue is full: another may take it, and when none can, the client is
    /// told to come back (429) rather than kept waiting.
    Full(String),
    Broken {
        tokens: usize,
        reason: String,
    },
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
            kv_index: Arc::new(Mutex::new(KvIndex::default())),
            next_slot: AtomicU32::new(0),
            mean_output: AtomicU64::new(0),
            stats: RouterStats::default(),
        })
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
        let mut refused = BTreeMap::new();
        let wanted: BTreeMap<&String, &NodeRecord> = members
            .iter()
            .filter(|(_, r)| {
                r.model == self.model
                    && ["worker", "decode", "prefill"]
                        .iter()
                        .any(|role| r.has_role(role))
            })
            .filter(|(id, r)| {
                // Same name, another model (vocabulary, config, weights): its token ids
                // would mean other text here. Never mix it in.
                let why = match &r.model_fingerprint {
                    Some(f) if *f == self.model_fingerprint => return true,
                    Some(f) => format!(
                        "serves another model under the name '{}' (fingerprint {f}, this router's is {})",
                        self.model, self.model_fingerprint
                    ),
                    None => format!(
                        "publishes no model fingerprint (version {}); cannot tell its model is this router's",
                        r.version
                    ),
                };
                refused.insert((*id).clone(), why);
                false
            })
            .collect();
        {
            let mut known = self.refused.lock();
            for (id, why) in &refused {
                if known.get(id) != Some(why) {
                    tracing::warn!("not routing to worker {id}: it {why}");
                }
            }
            *known = refused;
        }
        let mut guard = self.workers.write();
        let workers = &mut guard.by_id;
        let mut departed = Vec::new();
        for (id, link) in workers.iter() {
            match wanted.get(id) {
                // Restarted elsewhere, or with a new certificate: replace at once.
                Some(r)
                    if r.quic_addr != link.record.quic_addr
                        || r.cert_sha256 != link.record.cert_sha256 =>
                {
                    departed.push(id.clone())
                }
                Some(_) => *link.vanished.lock() = None,
                // Gone from the registry. A live connection says the worker is not: the
                // registry may have lost its data (etcd restarted empty) and everyone is
                // registering again, so the link stays for a grace period.
                None => {
                    let mut since = link.vanished.lock();
                    let first = since.is_none();
                    let at = *since.get_or_insert_with(Instant::now);
                    // Reports every 200 ms say it lives; a crashed worker's connection
                    // lingers until the idle timeout, but its reports stop at once.
                    let reporting = link
                        .reported_at
                        .lock()
                        .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
                    if link.connected() && reporting && at.elapsed() < REGISTRY_GRACE {
                        if first {
                            tracing::warn!(
                                "worker {id} left the registry but its connection is alive; \
                                 routing on to it for up to {} s while it registers again",
                                REGISTRY_GRACE.as_secs()
                            );
                        }
                    } else {
                        departed.push(id.clone());
                    }
                }
            }
        }
        for id in departed {
            if let Some(link) = workers.remove(&id) {
                link.gone.store(true, Ordering::Relaxed);
                if let Some(c) = link.connection() {
                    c.close(0u32.into(), b"left the cluster");
                }
                tracing::info!("worker {id} left the routing set");
            }
        }
        for (id, rec) in wanted {
            if workers.contains_key(id) {
                continue;
            }
            let kv = KvSlot::new(&self.kv_index, &self.next_slot);
            let link = Arc::new(WorkerLink {
                record: rec.clone(),
                conn: Mutex::new(None),
                hot: PickState {
                    up: AtomicBool::new(false),
                    draining: AtomicBool::new(false),
                    generates: rec.has_role("worker") || rec.has_role("decode"),
                    slot: kv.slot,
                    max_model_len: rec.max_model_len,
                    outstanding: AtomicI64::new(0),
                    queued_prompt: AtomicI64::new(0),
                    streamed: AtomicBool::new(false),
                    speed: AtomicSpeeds::new(Speeds::of(None, rec.capacity_tokens_per_s)),
                },
                report: Mutex::new(None),
                kv,
                outstanding_tokens: AtomicI64::new(0),
                prefills: AtomicI64::new(0),
                prefill_tokens: AtomicI64::new(0),
                routed: AtomicU64::new(0),
                prefilled: AtomicU64::new(0),
                gone: AtomicBool::new(false),
                vanished: Mutex::new(None),
                reported_at: Mutex::new(None),
            });
            workers.insert(id.clone(), link.clone());
            tokio::spawn(self.clone().maintain(link));
        }
        guard.list = guard.by_id.values().cloned().collect();
    }

    /// Keeps one worker connected while it is a member: connect, read its load reports,
    /// notice the break, reconnect with backoff.
    async fn maintain(self: Arc<Self>, link: Arc<WorkerLink>) {
        let id = link.record.node_id.clone();
        let addr: SocketAddr = match link.record.quic_addr.parse() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(
                    "worker {id} has a bad QUIC address '{}': {e}",
                    link.record.quic_addr
                );
                return;
            }
        };
        let mut backoff = Duration::from_millis(100);
        let mut warned = false;
        while !link.gone.load(Ordering::Relaxed) {
            match self.endpoint.connect(addr, &link.record.cert_sha256).await {
                Ok(conn) => {
                    tracing::info!("connected to worker {id} at {addr}");
                    backoff = Duration::from_millis(100);
                    warned = false;
                    *link.conn.lock() = Some(conn.clone());
                    link.hot.up.store(true, Ordering::Release);
                    let wants_kv = self.policy == Policy::Prefix;
                    let reports = tokio::spawn(read_reports(link.clone(), conn.clone(), wants_kv));
                    let reason = conn.closed().await;
                    reports.abort();
                    link.hot.up.store(false, Ordering::Release);
                    *link.conn.lock() = None;
                    link.set_report(None);
                    link.kv.clear();
                    if link.gone.load(Ordering::Relaxed) {
                        break;
                    }
                    tracing::warn!(
                        "lost worker {id}: {reason}; out of routing until it reconnects"
                    );
                }
                Err(e) => {
                    if !warned {
                        tracing::warn!("cannot reach worker {id}: {e}");
                        warned = true;
                    }
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Queues a request on a worker; the events arrive on the returned submission, and
    /// dropping it cancels the request on the worker.
    pub fn submit(self: &Arc<Self>, req: Request) -> Result<Submission, RouteError> {
        if self.with_routable(|ws| ws.next().is_none()) {
            self.stats.no_worker.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoWorkers(self.model.clone()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        // A child of the caller's span (the gateway's request).
        let span = tracing::info_span!(
            target: TARGET,
            "route",
            node = self.node_id.as_str(),
            policy = self.policy.as_str(),
            prompt_tokens = req.prompt.len(),
            attempts = Empty,
            migrations = Empty,
            otel.status_code = Empty,
            otel.status_message = Empty,
        );
        // Run by the reader's own task as it awaits the events (no spawn, and no hand-off
        // between tasks per token); dropping the submission cancels it.
        Ok(Submission::driven(
            SeqId(id),
            rx,
            self.clone().run(id, req, tx).instrument(span),
        ))
    }

    /// Decides whether a request routed to `decode` is prefilled elsewhere, and where.
    fn prefill_for(
        &self,
        decode: &WorkerLink,
        prompt_len: usize,
        cached_blocks: usize,
    ) -> (Decision, Option<Arc<WorkerLink>>) {
        let uncached = prompt_len.saturating_sub(cached_blocks * decode.record.block_size);
        let links: Vec<_> = self
            .workers()
            .into_iter()
            .filter(|w| {
                w.prefill_ready()
                    && w.record.kv_layout.is_some()
                    && w.record.kv_layout == decode.record.kv_layout
            })
            .collect();
        if links.is_empty() {
            return (Decision::NoPrefillWorker, None);
        }
        if uncached < self.disagg.min_tokens {
            return (Decision::ShortPrompt, None);
        }
        let cands: Vec<PrefillCandidate> = links
            .iter()
            .map(|w| {
                let r = w.last_report().and_then(|r| r.prefill).unwrap_or_default();
                let total = w
                    .last_report()
                    .map_or(0, |r| r.total_blocks as usize * w.record.block_size);
                PrefillCandidate {
                    queued: r.waiting as f64 + w.prefills.load(Ordering::Relaxed).max(0) as f64,
                    tokens_queued: r.tokens_in_flight as f64
                        + w.prefill_tokens.load(Ordering::Relaxed).max(0) as f64,
                    tokens_per_s: r.tokens_per_s as f64,
                    free_tokens: (1.0 - r.kv_usage as f64) * total as f64,
                }
            })
            .collect();
        match pick_prefill(&cands, uncached, self.disagg.max_queue) {
            Some(i) => (Decision::Remote, Some(links[i].clone())),
            None => (Decision::PrefillBusy, None),
        }
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

    /// Picks a node for a request (with `hashes` its prompt's reusable block hashes), and
    /// for a traced request, the candidates and their costs as text.
    fn choose(
        &self,
        hashes: &[u64],
        prompt_tokens: usize,
        output_tokens: usize,
        length: usize,
        tried: &HashSet<String>,
        describe: bool,
    ) -> Option<Choice> {
        let started = Instant::now();
        // The worker set is read in place for the pick (membership changes wait that
        // long); only the chosen worker's handle is copied out.
        let workers = self.workers.read();
        let eligible = |w: &WorkerLink| {
            w.available()
                && w.hot.generates
                && w.hot.max_model_len >= length
                && (tried.is_empty() || !tried.contains(&w.record.node_id))
        };
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
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
        let links: Vec<&Arc<WorkerLink>> = match drawn {
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
        };
        if links.is_empty() {
            return None;
        }
        let block_size = links[0].record.block_size.max(1);
        let now = Instant::now();
        let prefix = self.policy == Policy::Prefix;
        let mut reported = vec![0; links.len()];
        let mut speeds: Vec<ReportedSpeed> = links.iter().map(|w| w.pick_inputs()).collect();
        assume_for_unmeasured(&mut speeds);
        // Every worker's leading hits at once, from the index: the cost follows the
        // prompt's blocks and their holders, not the number of workers.
        let hits = if prefix && !hashes.is_empty() {
            self.kv_index.lock().leading_hits(hashes, now)
        } else {
            Vec::new()
        };
        let cands: Vec<Candidate> = links
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
        let shape = RequestShape {
            prompt_tokens,
            block_size,
            output_tokens,
        };
        let i = pick(self.policy, &cands, shape, turn, self.tuning)?;
        if prefix {
            links[i].kv.expect(hashes, now);
        }
        self.stats.picks.record(started.elapsed());
        let candidates = if describe {
            links
                .iter()
                .zip(&cands)
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
        } else {
            String::new()
        };
        Some(Choice {
            link: links[i].clone(),
            cached_blocks: cands[i].cached_blocks,
            reported_blocks: reported[i],
            uncached: prompt_tokens.saturating_sub(cands[i].cached_blocks * block_size),
            candidates,
        })
    }

    async fn run(self: Arc<Self>, id: u64, req: Request, tx: mpsc::UnboundedSender<SeqEvent>) {
        let block_size =
            self.with_routable(|ws| ws.next().map_or(16, |w| w.record.block_size.max(1)));
        // The blocks a worker can reuse: all full ones but the last token's (which is
        // always computed, to give the first token's logits).
        let prompt_hashes = |prompt: &[u32]| -> Vec<u64> {
            if self.policy == Policy::Prefix {
                let reusable = prompt.len().saturating_sub(1) / block_size * block_size;
                block_hashes(&prompt[..reusable], block_size)
                    .into_iter()
                    .map(|h| h.0)
                    .collect()
            } else {
                Vec::new()
            }
        };
        let mut hashes = prompt_hashes(&req.prompt);
        let p = &req.params;
        let greedy = p.temperature <= 1e-5 || p.top_k == 1;
        let wire_req = GenerateRequest {
            request_id: id,
            prompt: req.prompt.clone(),
            temperature: p.temperature,
            top_k: p.top_k.min(u32::MAX as usize) as u32,
            top_p: p.top_p,
            seed: p.seed,
            max_tokens: p.max_tokens.min(u32::MAX as usize) as u32,
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs.map(|n| n as u32),
            resume_draws: p.resume_draws,
            traceparent: None,
            prefill: None,
        };
        // What the client has been sent: a migration continues from here.
        let mut sent = Streamed::default();
        let mut migrations = 0u32;
        let mut tried = HashSet::new();
        let mut last_error = String::from("no worker was connected");
        let mut give_up = Instant::now() + UNSTARTED_PATIENCE;
        let route = tracing::Span::current();
        let traced = kvmesh_telemetry::is_sampled(&route);
        let mut attempts = 0u32;
        // Rounds over every worker: whether each refused as full, and the wait between.
        let (mut full_seen, mut all_full, mut full_rounds) = (false, true, 0u32);
        let mut backoff = Duration::from_millis(100);
        loop {
            let prompt_len = req.prompt.len() + sent.tokens.len();
            let length = req.prompt.len() + p.max_tokens;
            let output = self.expected_output(p.max_tokens.saturating_sub(sent.tokens.len()));
            let Some(choice) = self.choose(&hashes, prompt_len, output, length, &tried, traced)
            else {
                // Every worker was tried this round. Nothing more has reached the client
                // since, so the request may wait: for a worker restarting or joining, with
                // backoff, up to the patience; when every one was full, only a few short
                // rounds, then the client is told to come back later (429), as one node
                // would: waiting on here would only pile requests onto full queues.
                let round_full = full_seen && all_full;
                full_seen = false;
                all_full = true;
                if round_full {
                    full_rounds += 1;
                }
                let wait = backoff;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                let patient = if round_full {
                    full_rounds <= FULL_ROUNDS
                } else {
                    Instant::now() + wait < give_up
                };
                if patient && !tx.is_closed() {
                    tokio::time::sleep(wait).await;
                    tried.clear();
                    continue;
                }
                let (why, message) = if round_full {
                    self.stats.full.fetch_add(1, Ordering::Relaxed);
                    (
                        Unavailable::QueueFull,
                        format!(
                            "every worker's queue is full (tried {full_rounds} times): {last_error}; retry later"
                        ),
                    )
                } else if migrations > 0 {
                    self.stats.no_worker.fetch_add(1, Ordering::Relaxed);
                    (
                        Unavailable::WorkerLost,
                        format!("the request's worker was lost and no other could take it: {last_error}"),
                    )
                } else {
                    self.stats.no_worker.fetch_add(1, Ordering::Relaxed);
                    (
                        Unavailable::NoWorker,
                        format!(
                            "no worker could take the request within {} s: {last_error}",
                            UNSTARTED_PATIENCE.as_secs()
                        ),
                    )
                };
                route.record("otel.status_code", "ERROR");
                route.record("otel.status_message", message.as_str());
                let _ = tx.send(SeqEvent::Unavailable { message, why });
                return;
            };
            let Choice {
                link,
                cached_blocks,
                reported_blocks,
                uncached,
                candidates,
            } = choice;
            attempts += 1;
            route.record("attempts", attempts);
            // Each try is its own span, a child of the route; the worker continues it. A
            // migration's try names the tokens it resumes after.
            let attempt = tracing::info_span!(
                target: TARGET,
                "attempt",
                n = attempts,
                worker = link.record.node_id.as_str(),
                candidates = candidates.as_str(),
                cached_blocks,
                predicted_cached_tokens = Empty,
                migration = migrations,
                resumed_after_tokens = sent.tokens.len(),
                disagg = Empty,
                prefill_worker = Empty,
                outcome = Empty,
                otel.status_code = Empty,
                otel.status_message = Empty,
            );
            tried.insert(link.record.node_id.clone());
            link.routed.fetch_add(1, Ordering::Relaxed);
            self.stats.routed.fetch_add(1, Ordering::Relaxed);
            let mut wire = wire_req.clone();
            if !sent.tokens.is_empty() {
                // The sequence so far is the new prompt; the worker generates the rest.
                wire.prompt.extend_from_slice(&sent.tokens);
                wire.max_tokens = wire.max_tokens.saturating_sub(sent.tokens.len() as u32);
                if !greedy {
                    wire.resume_draws += sent.tokens.len() as u64;
                }
            }
            let guard = InFlight::new(&link, (wire.prompt.len() + wire.max_tokens as usize) as i64);
            // Until its first token, the prompt is work queued there (or on its prefill node).
            let mut prefill_guard = None;
            let mut queued = Some(QueuedPrompt::new(link.clone(), uncached as i64));
            if link.record.has_role("decode") {
                let (decision, prefill) =
                    self.prefill_for(&link, wire.prompt.len(), reported_blocks);
                self.stats.disagg[decision as usize].fetch_add(1, Ordering::Relaxed);
                attempt.record("disagg", decision.as_str());
                if let Some(pl) = prefill {
                    let uncached = wire
                        .prompt
                        .len()
                        .saturating_sub(cached_blocks * link.record.block_size);
                    pl.prefilled.fetch_add(1, Ordering::Relaxed);
                    attempt.record("prefill_worker", pl.record.node_id.as_str());
                    wire.prefill = Some(PrefillPeer {
                        node_id: pl.record.node_id.clone(),
                        quic_addr: pl.record.quic_addr.clone(),
                        cert_sha256: pl.record.cert_sha256.clone(),
                        min_tokens: self.disagg.min_tokens as u32,
                    });
                    prefill_guard = Some(PrefillInFlight::new(pl, uncached as i64));
                    queued = None;
                }
            }
            wire.traceparent = kvmesh_telemetry::traceparent(&attempt);
            let before = sent.tokens.len();
            let outcome = stream_from(
                &link,
                &wire,
                &tx,
                &mut prefill_guard,
                &mut queued,
                &mut sent,
            )
            .instrument(attempt.clone())
            .await;
            drop(guard);
            if self.policy == Policy::Prefix && sent.tokens.len() > before {
                // How well the worker's own account predicted its hit.
                let block_size = link.record.block_size.max(1);
                let expected = reported_blocks * block_size;
                let got = sent.attempt_cached;
                let k = match got.cmp(&expected) {
                    std::cmp::Ordering::Equal => 0,
                    std::cmp::Ordering::Less => 1,
                    std::cmp::Ordering::Greater => 2,
                };
                self.stats.predictions[k].fetch_add(1, Ordering::Relaxed);
                attempt.record("predicted_cached_tokens", expected);
            }
            if matches!(outcome, Outcome::Done) {
                self.note_output(sent.tokens.len());
            }
            let (what, error) = match &outcome {
                Outcome::Done => ("done", None),
                Outcome::ClientGone => ("client_gone", None),
                Outcome::NotStarted(r) => ("not_started", Some(r.clone())),
                Outcome::Full(r) => ("queue_full", Some(r.clone())),
                Outcome::Broken { reason, .. } => ("broken", Some(reason.clone())),
            };
            attempt.record("outcome", what);
            if let Some(e) = error {
                attempt.record("otel.status_code", "ERROR");
                attempt.record("otel.status_message", e.as_str());
            }
            match outcome {
                Outcome::Done | Outcome::ClientGone => return,
                Outcome::NotStarted(reason) => {
                    tracing::info!(
                        "request {id}: worker {} did not start it ({reason}); retrying elsewhere",
                        link.record.node_id
                    );
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    last_error = format!("{}: {reason}", link.record.node_id);
                    all_full = false;
                }
                Outcome::Full(reason) => {
                    tracing::debug!(
                        "request {id}: worker {} is full ({reason}); trying another",
                        link.record.node_id
                    );
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    last_error = format!("{}: {reason}", link.record.node_id);
                    full_seen = true;
                }
                Outcome::Broken { tokens, reason } => {
                    let total = sent.tokens.len();
                    if migrations < self.migration_limit {
                        migrations += 1;
                        self.stats.migrations.fetch_add(1, Ordering::Relaxed);
                        route.record("migrations", migrations);
                        tracing::warn!(
                            "request {id}: worker {} was lost after {tokens} tokens ({reason}); \
                             continuing after token {total} elsewhere (migration {migrations} of \
                             at most {})",
                            link.record.node_id,
                            self.migration_limit
                        );
                        last_error = format!("{}: {reason}", link.record.node_id);
                        hashes = prompt_hashes(&[&req.prompt[..], &sent.tokens[..]].concat());
                        give_up = Instant::now() + UNSTARTED_PATIENCE;
                        backoff = Duration::from_millis(100);
                        continue;
                    }
                    self.stats.failed_midstream.fetch_add(1, Ordering::Relaxed);
                    let message = format!(
                        "worker {} was lost after {total} generated tokens: {reason} (the \
                         request had moved {migrations} times, the limit)",
                        link.record.node_id
                    );
                    route.record("otel.status_code", "ERROR");
                    route.record("otel.status_message", message.as_str());
                    let _ = tx.send(SeqEvent::Unavailable {
                        message,
                        why: Unavailable::WorkerLost,
                    });
                    return;
                }
            }
        }
    }

    /// Prometheus lines for the router's view of the cluster.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let s = &self.stats;
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        counter(
            "kvmesh:router_requests_total",
            "Requests sent to workers, retries included.",
            s.routed.load(Ordering::Relaxed),
        );
        counter(
            "kvmesh:router_queue_full_total",
            "Requests refused with 429 because every worker's queue was full.",
            s.full.load(Ordering::Relaxed),
        );
        counter(
            "kvmesh:router_retries_total",
            "Requests moved to another worker before their first token.",
            s.retries.load(Ordering::Relaxed),
        );
        counter(
            "kvmesh:router_midstream_failures_total",
            "Requests that ended with an error because their worker was lost mid-stream and the \
             migration limit was reached.",
            s.failed_midstream.load(Ordering::Relaxed),
        );
        counter(
            "kvmesh:migrations_total",
            "Requests moved to another worker after tokens were streamed (their worker lost).",
            s.migrations.load(Ordering::Relaxed),
        );
        counter(
            "kvmesh:router_no_worker_total",
            "Requests refused because no worker could take them.",
            s.no_worker.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP kvmesh:disagg_decisions_total Requests routed to decode nodes, by whether \
             and why their prompt was prefilled elsewhere.\n# TYPE kvmesh:disagg_decisions_total counter"
        );
        for d in Decision::ALL {
            let _ = writeln!(
                out,
                "kvmesh:disagg_decisions_total{{reason=\"{}\"}} {}",
                d.as_str(),
                s.disagg[d as usize].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvmesh:router_prefix_predictions_total Prefix routing: the cached prompt \
             tokens expected from the worker's KV events against those it reported.\n\
             # TYPE kvmesh:router_prefix_predictions_total counter"
        );
        for (k, outcome) in ["exact", "fewer", "more"].iter().enumerate() {
            let _ = writeln!(
                out,
                "kvmesh:router_prefix_predictions_total{{outcome=\"{outcome}\"}} {}",
                s.predictions[k].load(Ordering::Relaxed)
            );
        }
        s.picks.render(out);
        let workers = self.workers();
        let _ = writeln!(
            out,
            "# HELP kvmesh:router_workers_routable Workers connected and in routing.\n\
             # TYPE kvmesh:router_workers_routable gauge\nkvmesh:router_workers_routable {}",
            workers
                .iter()
                .filter(|w| w.available() && w.generates())
                .count()
        );
        let _ = writeln!(
            out,
            "# HELP kvmesh:router_prefill_workers_connected Prefill nodes connected and reporting, available to decode nodes.\n\
             # TYPE kvmesh:router_prefill_workers_connected gauge\nkvmesh:router_prefill_workers_connected {}",
            workers.iter().filter(|w| w.prefill_ready()).count()
        );
        let _ = writeln!(out, "# TYPE kvmesh:prefill_routed_total counter");
        for w in workers.iter().filter(|w| w.prefills()) {
            let _ = writeln!(
                out,
                "kvmesh:prefill_routed_total{{worker=\"{}\"}} {}",
                w.record.node_id,
                w.prefilled.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(out, "# TYPE kvmesh:worker_routed_total counter");
        for w in &workers {
            let _ = writeln!(
                out,
                "kvmesh:worker_routed_total{{worker=\"{}\"}} {}",
                w.record.node_id,
                w.routed.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(out, "# TYPE kvmesh:worker_load gauge");
        for w in &workers {
            let _ = writeln!(
                out,
                "kvmesh:worker_load{{worker=\"{}\"}} {}",
                w.record.node_id,
                w.load()
            );
        }
        let _ = writeln!(out, "# TYPE kvmesh:worker_capacity_tokens_per_s gauge");
        for w in &workers {
            let _ = writeln!(
                out,
                "kvmesh:worker_capacity_tokens_per_s{{worker=\"{}\"}} {:.1}",
                w.record.node_id,
                w.capacity()
            );
        }
    }
}

/// A node picked for a request.
struct Choice {
    link: Arc<WorkerLink>,
    /// Leading prompt blocks it holds or is about to (prompts just sent there).
    cached_blocks: usize,
    /// Leading prompt blocks it reported holding.
    reported_blocks: usize,
    /// Prompt tokens it has to compute, as far as the router knows.
    uncached: usize,
    candidates: String,
}

/// Counts a prompt's uncached tokens against a node until its first token comes.
struct QueuedPrompt {
    link: Arc<WorkerLink>,
    tokens: i64,
}

impl QueuedPrompt {
    fn new(link: Arc<WorkerLink>, tokens: i64) -> Self {
        link.hot.queued_prompt.fetch_add(tokens, Ordering::Relaxed);
        QueuedPrompt { link, tokens }
    }
}

impl Drop for QueuedPrompt {
    fn drop(&mut self) {
        self.link
            .hot
            .queued_prompt
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// Counts a prompt against a prefill node until its first token comes (or the request ends).
struct PrefillInFlight {
    link: Arc<WorkerLink>,
    tokens: i64,
}

impl PrefillInFlight {
    fn new(link: Arc<WorkerLink>, tokens: i64) -> Self {
        link.prefills.fetch_add(1, Ordering::Relaxed);
        link.prefill_tokens.fetch_add(tokens, Ordering::Relaxed);
        PrefillInFlight { link, tokens }
    }
}

impl Drop for PrefillInFlight {
    fn drop(&mut self) {
        self.link.prefills.fetch_sub(1, Ordering::Relaxed);
        self.link
            .prefill_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// Counts a request against a worker while it is there; the count is returned however the
/// request ends, including when its task is aborted because the client left.
struct InFlight<'a> {
    link: &'a WorkerLink,
    tokens: i64,
}

impl<'a> InFlight<'a> {
    fn new(link: &'a WorkerLink, tokens: i64) -> Self {
        link.hot.outstanding.fetch_add(1, Ordering::Relaxed);
        link.outstanding_tokens.fetch_add(tokens, Ordering::Relaxed);
        InFlight { link, tokens }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.link.hot.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.link
            .outstanding_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// Reads a worker's load reports and, when `wants_kv` (prefix routing), its KV events; a
/// router that does not route by prefix stops the events stream, so the worker sends none.
async fn read_reports(link: Arc<WorkerLink>, conn: Connection, wants_kv: bool) {
    while let Ok(mut recv) = conn.accept_uni().await {
        let link = link.clone();
        tokio::spawn(async move {
            match wire::read_msg::<UniHeader>(&mut recv).await {
                Ok(Some(UniHeader::Load)) => {
                    while let Ok(Some(r)) = wire::read_msg::<LoadReport>(&mut recv).await {
                        link.set_report(Some(r));
                        *link.reported_at.lock() = Some(Instant::now());
                    }
                }
                Ok(Some(UniHeader::KvEvents)) if wants_kv => {
                    while let Ok(Some(b)) = wire::read_msg::<KvEventBatch>(&mut recv).await {
                        link.kv.apply(b.snapshot, &b.stored, &b.removed);
                    }
                    // The stream broke with the connection still up: its view is stale.
                    link.kv.clear();
                }
                _ => {
                    // Nothing else is sent to a router.
                    let _ = recv.stop(0u32.into());
                }
            }
        });
    }
}

/// What a request has streamed to its client so far, across workers.
#[derive(Default)]
struct Streamed {
    tokens: Vec<u32>,
    /// The first worker's cached prompt tokens: what the client's usage reports, however
    /// many workers the sequence passed through.
    cached_tokens: Option<usize>,
    /// The cached tokens the latest attempt's worker reported with its first token.
    attempt_cached: usize,
}

async fn stream_from(
    link: &WorkerLink,
    req: &GenerateRequest,
    tx: &mpsc::UnboundedSender<SeqEvent>,
    prefill: &mut Option<PrefillInFlight>,
    queued: &mut Option<QueuedPrompt>,
    sent: &mut Streamed,
) -> Outcome {
    let Some(conn) = link.connection() else {
        return Outcome::NotStarted("not connected".into());
    };
    let (mut send, mut recv) = match conn.open_bi().await {
        Ok(s) => s,
        Err(e) => return Outcome::NotStarted(e.to_string()),
    };
    if let Err(e) = wire::write_msg(&mut send, &StreamRequest::Generate(req.clone())).await {
        return Outcome::NotStarted(e.to_string());
    }

    let _ = send.finish();
    let mut tokens = 0usize;
    loop {
        let broken = |reason: String| {
            if tokens == 0 {
                Outcome::NotStarted(reason)
            } else {
                Outcome::Broken { tokens, reason }
            }
        };
        match wire::read_msg::<TokenEvent>(&mut recv).await {
            Ok(Some(TokenEvent::Token {
                token,
                logprob,
                top,
                finish,
                cached_tokens,
            })) => {
                tokens += 1;
                // The prompt is prefilled: the prefill node no longer holds it.
                prefill.take();
                queued.take();
                if tokens == 1 {
                    sent.attempt_cached = cached_tokens as usize;
                    if !link.hot.streamed.load(Ordering::Relaxed) {
                        link.hot.streamed.store(true, Ordering::Relaxed);
                    }
                }
                sent.tokens.push(token);
                let cached_tokens = *sent.cached_tokens.get_or_insert(cached_tokens as usize);
                let ev = SeqEvent::Token {
                    sampled: Sampled {
                        token,
                        logprob,
                        top: top.into_iter().map(|t| (t.token, t.logprob)).collect(),
                    },
                    finish: finish.map(|f| match f {
                        Finish::Stop => FinishReason::Stop,
                        Finish::Length => FinishReason::Length,
                    }),
                    cached_tokens,
                };
                if tx.send(ev).is_err() {
                    return Outcome::ClientGone;
                }
                if finish.is_some() {
                    return Outcome::Done;
                }
            }
            Ok(Some(TokenEvent::Rejected {
                message,
                retryable,
                queue_full,
            })) => {
                if queue_full && tokens == 0 {
                    return Outcome::Full(message);
                }
                if retryable && tokens == 0 {
                    return Outcome::NotStarted(message);
                }
                let _ = tx.send(SeqEvent::Failed(message));
                return Outcome::Done;
            }
            Ok(Some(TokenEvent::Failed { message })) => {
                let _ = tx.send(SeqEvent::Failed(message));
                return Outcome::Done;
            }
            Ok(None) => return broken("the worker closed the stream early".into()),
            Err(e) => return broken(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn speed(prompt_rate: Option<f64>, base: f64, per_seq: f64) -> ReportedSpeed {
        ReportedSpeed {
            load: 0.0,
            fresh: prompt_rate.is_none(),
            capacity: 100.0,
            prompt_rate,
            step_base: base,
            step_per_seq: per_seq,
            max_running: 0.0,
        }
    }

    #[test]
    fn pick_times_give_percentiles_and_a_cumulative_histogram() {
        let t = PickTimes::default();
        assert!(t.recent_percentiles_us(&[50.0]).is_empty());
        for us in 1..=2000u64 {
            t.record(Duration::from_micros(us));
        }
        // The ring keeps the last 1024: 977..=2000 µs.
        assert_eq!(t.recent_percentiles_us(&[0.0, 100.0]), vec![977.0, 2000.0]);
        assert_eq!(t.count.load(Ordering::Relaxed), 2000);
        assert!((t.mean_us() - 1000.5).abs() < 1e-9);
        let mut out = String::new();
        t.render(&mut out);
        assert!(
            out.contains("kvmesh:router_pick_seconds_bucket{le=\"0.00001\"} 10\n"),
            "{out}"
        );
        assert!(
            out.contains("kvmesh:router_pick_seconds_bucket{le=\"0.001\"} 1000\n"),
            "{out}"
        );
        assert!(
            out.contains("kvmesh:router_pick_seconds_bucket{le=\"+Inf\"} 2000\n"),
            "{out}"
        );
        assert!(
            out.contains("kvmesh:router_pick_seconds_count 2000\n"),
            "{out}"
        );
    }

    #[test]
    fn an_unmeasured_worker_is_taken_as_slow_as_the_slowest_measured_one() {
        let mut s = vec![
            speed(Some(4000.0), 0.010, 0.001),
            speed(None, 0.0, 0.0),
            speed(Some(2000.0), 0.020, 0.0005),
            speed(Some(8000.0), 0.0, 0.0),
        ];
        assume_for_unmeasured(&mut s);
        let got: Vec<_> = s
            .iter()
            .map(|s| (s.prompt_rate, s.step_base, s.step_per_seq))
            .collect();
        assert_eq!(
            got,
            vec![
                (Some(4000.0), 0.010, 0.001),
                (Some(2000.0), 0.020, 0.0005),
                (Some(2000.0), 0.020, 0.0005),
                // Served, not yet fitted: its own measured rate.
                (Some(8000.0), 0.0, 0.0),
            ]
        );
        // Nothing measured: nothing assumed (the policy serves them at their declared rate).
        let mut s = vec![speed(None, 0.0, 0.0), speed(None, 0.0, 0.0)];
        assume_for_unmeasured(&mut s);
        assert!(s
            .iter()
            .all(|s| s.prompt_rate.is_none() && !s.step_measured()));
    }
}
