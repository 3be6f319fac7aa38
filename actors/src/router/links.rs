//! The workers a router knows: one link each, holding its connection, what its reports say
//! of its speed and load, its place in the prefix index, and what this router has in flight
//! there. A link keeps its worker connected for as long as the worker is a member.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_discovery::{NodeRecord, Role};
use kvmesh_transport::wire::{self, KvEventBatch, LoadReport, UniHeader};
use kvmesh_transport::{until_silent, Connection, NodeEndpoint};
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::link_state::{Attempt, LinkState, Next};
use crate::kv_index::{KvIndex, WorkerKv};

/// The workers a router knows, by id, and the same in a list a draw can index (rebuilt
/// when the set changes).
#[derive(Default)]
pub(crate) struct Workers {
    pub(crate) by_id: BTreeMap<String, Arc<WorkerLink>>,
    pub(crate) list: Vec<Arc<WorkerLink>>,
    /// By slot in the prefix index (see `shortlist`).
    pub(crate) by_slot: std::collections::HashMap<u32, Arc<WorkerLink>>,
}

impl Workers {
    pub(crate) fn values(&self) -> std::slice::Iter<'_, Arc<WorkerLink>> {
        self.list.iter()
    }
}

/// What a routing decision reads of a worker, kept together so that a pick over hundreds
/// of workers touches two cache lines of each instead of a dozen scattered ones.
#[repr(C, align(64))]
pub(crate) struct PickState {
    /// Set while the link holds a connection, cleared when it breaks.
    pub(crate) up: AtomicBool,
    /// Its last report said it is shutting down.
    pub(crate) draining: AtomicBool,
    /// Its record names the worker or decode role.
    pub(crate) generates: bool,
    /// Its slot in the router's prefix index.
    pub(crate) slot: u32,
    pub(crate) max_model_len: usize,
    /// Requests this router has in flight there.
    pub(crate) outstanding: AtomicI64,
    /// Uncached prompt tokens of requests this router sent there with no first token yet.
    pub(crate) queued_prompt: AtomicI64,
    /// A token from it has reached this router: from then on its reports measure it.
    pub(crate) streamed: AtomicBool,
    /// Its last report's speeds, as a pick wants them.
    pub(crate) speed: AtomicSpeeds,
}

/// [`Speeds`] in atomics, so that a pick over hundreds of workers reads them with plain
/// loads instead of taking and releasing a lock on each (two atomic read-modify-writes a
/// worker, most of a pick's time). A pick racing a report may see fields of both; each is a
/// valid estimate of the same worker.
pub(crate) struct AtomicSpeeds {
    others: AtomicI64,
    capacity: AtomicU64,
    prompt_rate: AtomicU64,
    step_base: AtomicU64,
    step_per_seq: AtomicU64,
    max_running: AtomicU64,
}

impl AtomicSpeeds {
    pub(crate) fn new(s: Speeds) -> AtomicSpeeds {
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

/// What a prefill pick reads of a prefill node's last report (zeros for a report without a
/// prefill role), in atomics like [`AtomicSpeeds`]: a report is folded in with stores.
#[derive(Default)]
pub(crate) struct AtomicPrefillLoad {
    waiting: AtomicU32,
    tokens_in_flight: AtomicU64,
    tokens_per_s: AtomicU32,
    kv_usage: AtomicU32,
    total_blocks: AtomicU32,
}

/// [`AtomicPrefillLoad`] read back.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PrefillView {
    pub(crate) waiting: u32,
    pub(crate) tokens_in_flight: u64,
    pub(crate) tokens_per_s: f32,
    pub(crate) kv_usage: f32,
    /// The node's KV blocks, all roles together.
    pub(crate) total_blocks: u32,
}

impl AtomicPrefillLoad {
    fn store(&self, r: &LoadReport) {
        let p = r.prefill.clone().unwrap_or_default();
        let o = Ordering::Relaxed;
        self.waiting.store(p.waiting, o);
        self.tokens_in_flight.store(p.tokens_in_flight, o);
        self.tokens_per_s.store(p.tokens_per_s.to_bits(), o);
        self.kv_usage.store(p.kv_usage.to_bits(), o);
        self.total_blocks.store(r.total_blocks, o);
    }

    pub(crate) fn load(&self) -> PrefillView {
        let o = Ordering::Relaxed;
        PrefillView {
            waiting: self.waiting.load(o),
            tokens_in_flight: self.tokens_in_flight.load(o),
            tokens_per_s: f32::from_bits(self.tokens_per_s.load(o)),
            kv_usage: f32::from_bits(self.kv_usage.load(o)),
            total_blocks: self.total_blocks.load(o),
        }
    }
}

/// Milliseconds since this process's first look at the clock, plus one: 0 stays "never".
fn now_ms() -> u64 {
    static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
    EPOCH.elapsed().as_millis() as u64 + 1
}

/// A worker's speeds from its last report (or its record's declaration before one).
#[derive(Clone, Copy)]
pub(crate) struct Speeds {
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
    pub(crate) fn of(report: Option<&(LoadReport, i64)>, declared_capacity: f64) -> Speeds {
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
    pub(crate) conn: Mutex<Option<Connection>>,
    /// All a pick reads of it, in two cache lines.
    pub(crate) hot: PickState,
    /// What a prefill pick reads of its latest load report.
    pub(crate) prefill_load: AtomicPrefillLoad,
    /// What its prefix cache holds, from its events: its slot in the router's index.
    pub kv: KvSlot,
    /// Tokens (prompt + max_tokens) of the requests this router has in flight there.
    pub(crate) outstanding_tokens: AtomicI64,
    /// Prompts this router sent there to prefill whose first token has not come yet, and
    /// their uncached tokens.
    pub(crate) prefills: AtomicI64,
    pub(crate) prefill_tokens: AtomicI64,
    pub routed: AtomicU64,
    /// Prompts sent there to prefill.
    pub prefilled: AtomicU64,
    pub(crate) gone: AtomicBool,
    /// When its record left the registry while its connection lived on.
    pub(crate) vanished: Mutex<Option<Instant>>,
    /// When its last load report on the current connection came ([`now_ms`]; 0: none yet).
    pub(crate) reported_at: AtomicU64,
}

impl WorkerLink {
    pub(crate) fn connection(&self) -> Option<Connection> {
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

    /// Folds in its latest load report (`None`: its connection broke) with atomic stores:
    /// no lock, and nothing else woken.
    pub(crate) fn set_report(&self, report: Option<LoadReport>) {
        let own = self.hot.outstanding.load(Ordering::Relaxed).max(0);
        self.hot.draining.store(
            report.as_ref().is_some_and(|r| r.draining),
            Ordering::Release,
        );
        let report = report.map(|r| (r, own));
        self.hot.speed.store(Speeds::of(
            report.as_ref(),
            self.record.capacity_tokens_per_s,
        ));
        match &report {
            Some((r, _)) => {
                self.prefill_load.store(r);
                self.reported_at.store(now_ms(), Ordering::Release);
            }
            None => self.reported_at.store(0, Ordering::Release),
        }
    }

    /// A load report came on its current connection within `age`.
    pub(crate) fn reported_within(&self, age: Duration) -> bool {
        let at = self.reported_at.load(Ordering::Acquire);
        at != 0 && now_ms().saturating_sub(at) < age.as_millis() as u64
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
        self.record.has_role(Role::Prefill)
    }

    /// A prefill node a decode worker may be sent to: connected, and it has reported its
    /// queue and KV room (the first report follows the connection at once). Until then its
    /// room is unknown, and a pick would take it as full.
    pub(crate) fn prefill_ready(&self) -> bool {
        self.prefills() && self.available() && self.reported_at.load(Ordering::Acquire) != 0
    }

    /// Prompt tokens per second it computes, once measured.
    pub fn prompt_rate(&self) -> Option<f64> {
        self.pick_inputs().prompt_rate
    }

    /// What a pick needs from its last report, read with atomic loads: capacity, prompt rate
    /// (once measured), the decode step fit in seconds, and its batch limit.
    pub(crate) fn pick_inputs(&self) -> ReportedSpeed {
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
pub(crate) struct ReportedSpeed {
    /// As [`WorkerLink::load`] reads it.
    pub(crate) load: f64,
    /// No token from it has reached this router yet: nothing it reported measures it.
    pub(crate) fresh: bool,
    pub(crate) capacity: f64,
    pub(crate) prompt_rate: Option<f64>,
    pub(crate) step_base: f64,
    pub(crate) step_per_seq: f64,
    pub(crate) max_running: f64,
}

impl ReportedSpeed {
    /// It has decoded and reported its step fit.
    pub(crate) fn step_measured(&self) -> bool {
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
pub(crate) fn assume_for_unmeasured(speeds: &mut [ReportedSpeed]) {
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
    index: Arc<KvIndex>,
    pub slot: u32,
    kv: WorkerKv,
}

impl KvSlot {
    pub(crate) fn new(index: &Arc<KvIndex>, next: &AtomicU32) -> KvSlot {
        KvSlot {
            index: index.clone(),
            slot: next.fetch_add(1, Ordering::Relaxed),
            kv: WorkerKv::default(),
        }
    }

    pub(crate) fn apply(&self, snapshot: bool, stored: &[u64], removed: &[u64]) {
        self.index
            .apply(self.slot, &self.kv, snapshot, stored, removed);
    }

    /// The worker was lost: nothing it held can be counted on.
    pub(crate) fn clear(&self) {
        self.index.clear_worker(self.slot, &self.kv);
    }

    pub(crate) fn expect(&self, hashes: &[u64], now: Instant) {
        self.index.expect(self.slot, &self.kv, hashes, now);
    }

    /// Blocks it reported holding.
    pub fn held(&self) -> usize {
        self.kv.held()
    }

    /// Its snapshot has arrived: the view is its own account.
    pub fn synced(&self) -> bool {
        self.kv.synced()
    }
}

impl Drop for KvSlot {
    fn drop(&mut self) {
        self.index.clear_worker(self.slot, &self.kv);
    }
}

/// Counts a prompt's uncached tokens against a node until its first token comes.
pub(crate) struct QueuedPrompt {
    link: Arc<WorkerLink>,
    tokens: i64,
}

impl QueuedPrompt {
    pub(crate) fn new(link: Arc<WorkerLink>, tokens: i64) -> Self {
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
pub(crate) struct PrefillInFlight {
    link: Arc<WorkerLink>,
    tokens: i64,
}

impl PrefillInFlight {
    pub(crate) fn new(link: Arc<WorkerLink>, tokens: i64) -> Self {
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
pub(crate) struct InFlight<'a> {
    link: &'a WorkerLink,
    tokens: i64,
}

impl<'a> InFlight<'a> {
    pub(crate) fn new(link: &'a WorkerLink, tokens: i64) -> Self {
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
        let id = conn.stable_id();
        tokio::spawn(async move {
            match wire::read_msg::<UniHeader>(&mut recv).await {
                Ok(Some(UniHeader::Load)) => {
                    // The worker opens this stream once it has accepted the connection: only
                    // now is the link up. The handshake completing on this side is not
                    // enough, as a worker that does not know this router's certificate yet
                    // refuses it a moment after (a node that has just joined).
                    // Under the lock the link's loss takes too: a late stream of a lost
                    // connection cannot mark its successor up.
                    {
                        let current = link.conn.lock();
                        if current.as_ref().is_some_and(|c| c.stable_id() == id) {
                            link.hot.up.store(true, Ordering::Release);
                        }
                    }
                    while let Ok(Some(r)) = wire::read_msg::<LoadReport>(&mut recv).await {
                        LOAD_REPORTS.fetch_add(1, Ordering::Relaxed);
                        link.set_report(Some(r));
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

/// Load reports read by this process's routers (`kvmesh:router_load_reports_total`).
pub(crate) static LOAD_REPORTS: AtomicU64 = AtomicU64::new(0);

/// Handshakes a router has under way at most. A router that starts, or restarts, beside
/// thousands of registered workers would otherwise dial them all at once: the handshakes'
/// packets overflow the sockets and are lost, and the workers' processes fall seconds
/// behind on everything else, their load reports and lease keep-alives included. In turns,
/// each handshake is over in milliseconds.
pub(crate) const DIALS_AT_ONCE: usize = 64;

/// Keeps one worker connected while it is a member: connect (taking a turn of `dials`),
/// read its load reports, notice the break (a closed connection, or one silent for several
/// beats: 0.7 s in a small cluster, see [`crate::pace`]), reconnect with backoff. When to
/// dial again and what to report is `LinkState`'s to decide (`link_state`).
pub(crate) async fn maintain(
    (endpoint, dials): (NodeEndpoint, Arc<Semaphore>),
    link: Arc<WorkerLink>,
    wants_kv: bool,
) {
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
    let mut state = LinkState::new();
    let _held = crate::pace::Link::held();
    while !link.gone.load(Ordering::Relaxed) {
        let beat = crate::pace::Beat::now();
        let dialled = {
            // Never closed: a turn always comes.
            let _turn = dials.acquire().await;
            endpoint
                .connect_paced(addr, &link.record.cert_sha256, None)
                .await
        };
        let attempt = match dialled {
            Ok(conn) => {
                tracing::info!("connected to worker {id} at {addr}");
                state.connected();
                *link.conn.lock() = Some(conn.clone());
                let reports = tokio::spawn(read_reports(link.clone(), conn.clone(), wants_kv));
                // Several of this link's beats, or of the pace the cluster has grown to since
                // (the machine hosting it is busier too).
                let silent = || {
                    beat.silent_after()
                        .max(crate::pace::Beat::now().silent_after())
                };
                let reason = tokio::select! {
                    reason = conn.closed() => reason.to_string(),
                    () = until_silent(&conn, silent, true) => {
                        // Dead without a word (killed, or its machine lost): its streams
                        // fail now and move, instead of at QUIC's idle timeout.
                        conn.close(0u32.into(), b"worker silent");
                        format!("nothing heard for {} ms", silent().as_millis())
                    }
                };
                reports.abort();
                {
                    let mut current = link.conn.lock();
                    *current = None;
                    link.hot.up.store(false, Ordering::Release);
                }
                link.set_report(None);
                link.kv.clear();
                Attempt::Lost(reason)
            }
            Err(e) => Attempt::Unreachable(e.to_string()),
        };
        match state.after(attempt, link.gone.load(Ordering::Relaxed), &id) {
            Next::Stop => break,
            Next::Retry { warn, after } => {
                if let Some(w) = warn {
                    tracing::warn!("{w}");
                }
                tokio::time::sleep(after).await;
            }
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
    fn reports_are_folded_into_atomics_and_a_broken_connection_clears_them() {
        use kvmesh_transport::wire::PrefillLoad;
        let mut rec = crate::router::shortlist_tests::record(0, 512);
        rec.roles = vec![Role::Prefill];
        let index = Arc::new(KvIndex::default());
        let link = super::super::membership::new_link(&rec, &index, &AtomicU32::new(0));
        link.hot.up.store(true, Ordering::Relaxed);
        link.hot.outstanding.store(2, Ordering::Relaxed);
        // Connected, but nothing reported yet: its room is unknown.
        assert!(!link.prefill_ready());
        assert!(!link.reported_within(Duration::from_secs(1)));
        let report = LoadReport {
            running: 3,
            waiting: 4,
            total_blocks: 100,
            capacity_tokens_per_s: 50.0,
            prefill: Some(PrefillLoad {
                waiting: 5,
                tokens_in_flight: 600,
                kv_usage: 0.25,
                tokens_per_s: 7000.0,
                ..Default::default()
            }),
            ..Default::default()
        };
        link.set_report(Some(report));
        assert!(link.prefill_ready());
        assert!(link.reported_within(Duration::from_secs(1)));
        let seen = link.prefill_load.load();
        assert_eq!(
            (seen.waiting, seen.tokens_in_flight, seen.total_blocks),
            (5, 600, 100)
        );
        assert_eq!((seen.kv_usage, seen.tokens_per_s), (0.25, 7000.0));
        // Others' requests: the worker's 7 less this router's 2 when it reported.
        assert_eq!(link.load(), 7.0);
        assert_eq!(link.capacity(), 50.0);
        link.set_report(None);
        assert!(!link.prefill_ready());
        assert!(!link.reported_within(Duration::from_secs(1)));
        assert_eq!(link.load(), 2.0);
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
