//! The router role's data path: keeps a QUIC connection to every worker the registry lists
//! (pinned to the certificate fingerprint in its record), reads their load reports, and
//! sends each request to the worker the policy picks.
//!
//! A worker whose connection breaks is out of routing at once; the registry lease is the
//! backstop. A request that has not produced a token when its worker fails is retried on
//! another worker; one already streaming ends with a clear error event.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_discovery::{Membership, NodeRecord};
use kvmesh_gpu::engine::{FinishReason, Request, SeqEvent, SeqId, Submission};
use kvmesh_gpu::kv_cache::block_hashes;
use kvmesh_gpu::sampler::Sampled;
use kvmesh_transport::wire::{
    self, Finish, GenerateRequest, LoadReport, StreamRequest, TokenEvent, UniHeader,
};
use kvmesh_transport::{Connection, NodeEndpoint};
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;

use crate::policy::{pick, Candidate, Policy, PrefixIndex, RequestShape};

/// How long a request that has produced nothing waits for some worker to take it, after
/// every worker it tried failed or refused it.
const UNSTARTED_PATIENCE: Duration = Duration::from_secs(10);

/// Prompt block hashes remembered per worker for prefix routing.
const PREFIX_HASHES_PER_WORKER: usize = 65_536;

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("no worker is available for model '{0}'; try again when one has joined")]
    NoWorkers(String),
}

/// One worker as the router knows it.
pub struct WorkerLink {
    pub record: NodeRecord,
    conn: Mutex<Option<Connection>>,
    report: Mutex<Option<(LoadReport, Instant)>>,
    /// Requests this router has in flight there, and their tokens (prompt + max_tokens).
    outstanding: AtomicI64,
    outstanding_tokens: AtomicI64,
    pub routed: AtomicU64,
    gone: AtomicBool,
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

    pub fn last_report(&self) -> Option<LoadReport> {
        self.report.lock().as_ref().map(|(r, _)| r.clone())
    }

    /// Requests there: the worker's own count, or this router's if it is newer news.
    pub fn load(&self) -> f64 {
        let own = self.outstanding.load(Ordering::Relaxed).max(0) as f64;
        let reported = self
            .last_report()
            .map_or(0.0, |r| (r.running + r.waiting) as f64);
        own.max(reported)
    }

    pub fn capacity(&self) -> f64 {
        self.last_report()
            .map(|r| r.capacity_tokens_per_s as f64)
            .filter(|&c| c > 0.0)
            .unwrap_or(self.record.capacity_tokens_per_s)
            .max(1e-3)
    }
}

#[derive(Default)]
pub struct RouterStats {
    pub routed: AtomicU64,
    pub retries: AtomicU64,
    pub failed_midstream: AtomicU64,
    pub no_worker: AtomicU64,
}

pub struct RouterCore {
    pub node_id: String,
    pub model: String,
    pub policy: Policy,
    endpoint: NodeEndpoint,
    workers: RwLock<BTreeMap<String, Arc<WorkerLink>>>,
    prefix: Mutex<PrefixIndex>,
    turn: AtomicU64,
    next_id: AtomicU64,
    pub stats: RouterStats,
}

enum Outcome {
    Done,
    ClientGone,
    /// Nothing reached the client: another worker may take it.
    NotStarted(String),
    Broken {
        tokens: usize,
        reason: String,
    },
}

impl RouterCore {
    pub fn new(
        node_id: String,
        model: String,
        policy: Policy,
        endpoint: NodeEndpoint,
    ) -> Arc<Self> {
        Arc::new(RouterCore {
            node_id,
            model,
            policy,
            endpoint,
            workers: RwLock::new(BTreeMap::new()),
            prefix: Mutex::new(PrefixIndex::new(PREFIX_HASHES_PER_WORKER)),
            turn: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            stats: RouterStats::default(),
        })
    }

    /// Workers in id order.
    pub fn workers(&self) -> Vec<Arc<WorkerLink>> {
        self.workers.read().values().cloned().collect()
    }

    pub fn routable(&self) -> Vec<Arc<WorkerLink>> {
        self.workers()
            .into_iter()
            .filter(|w| w.connected())
            .collect()
    }

    /// The context length every routable worker accepts (None without workers).
    pub fn max_model_len(&self) -> Option<usize> {
        self.routable().iter().map(|w| w.record.max_model_len).min()
    }

    /// Brings the worker set in line with the registry: new workers get a connection task,
    /// departed ones are closed and forgotten, changed records (a restarted node: new
    /// address or certificate) are replaced.
    pub fn apply_membership(self: &Arc<Self>, members: &Membership) {
        let wanted: BTreeMap<&String, &NodeRecord> = members
            .iter()
            .filter(|(_, r)| r.roles.iter().any(|x| x == "worker") && r.model == self.model)
            .collect();
        let mut workers = self.workers.write();
        let departed: Vec<String> = workers
            .iter()
            .filter(|(id, link)| {
                wanted.get(id).is_none_or(|r| {
                    r.quic_addr != link.record.quic_addr || r.cert_sha256 != link.record.cert_sha256
                })
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in departed {
            if let Some(link) = workers.remove(&id) {
                link.gone.store(true, Ordering::Relaxed);
                if let Some(c) = link.connection() {
                    c.close(0u32.into(), b"left the cluster");
                }
                self.prefix.lock().forget(&id);
                tracing::info!("worker {id} left the routing set");
            }
        }
        for (id, rec) in wanted {
            if workers.contains_key(id) {
                continue;
            }
            let link = Arc::new(WorkerLink {
                record: rec.clone(),
                conn: Mutex::new(None),
                report: Mutex::new(None),
                outstanding: AtomicI64::new(0),
                outstanding_tokens: AtomicI64::new(0),
                routed: AtomicU64::new(0),
                gone: AtomicBool::new(false),
            });
            workers.insert(id.clone(), link.clone());
            tokio::spawn(self.clone().maintain(link));
        }
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
                    let reports = tokio::spawn(read_reports(link.clone(), conn.clone()));
                    let reason = conn.closed().await;
                    reports.abort();
                    *link.conn.lock() = None;
                    *link.report.lock() = None;
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
        if self.routable().is_empty() {
            self.stats.no_worker.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoWorkers(self.model.clone()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(self.clone().run(id, req, tx));
        Ok(Submission::external(SeqId(id), rx, move || task.abort()))
    }

    fn choose(&self, hashes: &[u64], tried: &HashSet<String>) -> Option<Arc<WorkerLink>> {
        let links: Vec<_> = self
            .routable()
            .into_iter()
            .filter(|w| !tried.contains(&w.record.node_id))
            .collect();
        if links.is_empty() {
            return None;
        }
        let block_size = links[0].record.block_size.max(1);
        let cands: Vec<Candidate> = {
            let prefix = self.prefix.lock();
            links
                .iter()
                .map(|w| Candidate {
                    load: w.load(),
                    capacity: w.capacity(),
                    cached_blocks: if self.policy == Policy::Prefix {
                        prefix.leading_hits(&w.record.node_id, hashes)
                    } else {
                        0
                    },
                    tokens_in_flight: w.outstanding_tokens.load(Ordering::Relaxed).max(0) as f64,
                })
                .collect()
        };
        let shape = RequestShape {
            prompt_blocks: hashes.len(),
            block_size,
        };
        let i = pick(
            self.policy,
            &cands,
            shape,
            self.turn.fetch_add(1, Ordering::Relaxed),
        )?;
        if self.policy == Policy::Prefix {
            self.prefix.lock().record(&links[i].record.node_id, hashes);
        }
        Some(links[i].clone())
    }

    async fn run(self: Arc<Self>, id: u64, req: Request, tx: mpsc::UnboundedSender<SeqEvent>) {
        let block_size = self
            .routable()
            .first()
            .map_or(16, |w| w.record.block_size.max(1));
        let hashes: Vec<u64> = if self.policy == Policy::Prefix {
            block_hashes(&req.prompt, block_size)
                .into_iter()
                .map(|h| h.0)
                .collect()
        } else {
            Vec::new()
        };
        let p = &req.params;
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
            traceparent: None,
        };
        let mut tried = HashSet::new();
        let mut last_error = String::from("no worker was connected");
        let give_up = Instant::now() + UNSTARTED_PATIENCE;
        loop {
            let Some(link) = self.choose(&hashes, &tried) else {
                // Nothing has reached the client yet, so the request can still wait for a
                // worker: one restarting, one joining, or a full one draining its queue.
                if Instant::now() < give_up && !tx.is_closed() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    tried.clear();
                    continue;
                }
                self.stats.no_worker.fetch_add(1, Ordering::Relaxed);
                let _ = tx.send(SeqEvent::Failed(format!(
                    "no worker could take the request within {} s: {last_error}",
                    UNSTARTED_PATIENCE.as_secs()
                )));
                return;
            };
            tried.insert(link.record.node_id.clone());
            link.routed.fetch_add(1, Ordering::Relaxed);
            self.stats.routed.fetch_add(1, Ordering::Relaxed);
            let guard = InFlight::new(&link, (req.prompt.len() + p.max_tokens) as i64);
            let outcome = stream_from(&link, &wire_req, &tx).await;
            drop(guard);
            match outcome {
                Outcome::Done | Outcome::ClientGone => return,
                Outcome::NotStarted(reason) => {
                    tracing::info!(
                        "request {id}: worker {} did not start it ({reason}); retrying elsewhere",
                        link.record.node_id
                    );
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    last_error = format!("{}: {reason}", link.record.node_id);
                }
                Outcome::Broken { tokens, reason } => {
                    self.stats.failed_midstream.fetch_add(1, Ordering::Relaxed);
                    let _ = tx.send(SeqEvent::Failed(format!(
                        "worker {} was lost after {tokens} generated tokens: {reason}",
                        link.record.node_id
                    )));
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
            "kvmesh:router_retries_total",
            "Requests moved to another worker before their first token.",
            s.retries.load(Ordering::Relaxed),
        );
        counter(
            "kvmesh:router_midstream_failures_total",
            "Requests whose worker was lost after tokens had been sent.",
            s.failed_midstream.load(Ordering::Relaxed),
        );
        counter(
            "kvmesh:router_no_worker_total",
            "Requests refused because no worker could take them.",
            s.no_worker.load(Ordering::Relaxed),
        );
        let workers = self.workers();
        let _ = writeln!(
            out,
            "# HELP kvmesh:router_workers_routable Workers connected and in routing.\n\
             # TYPE kvmesh:router_workers_routable gauge\nkvmesh:router_workers_routable {}",
            workers.iter().filter(|w| w.connected()).count()
        );
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

/// Counts a request against a worker while it is there; the count is returned however the
/// request ends, including when its task is aborted because the client left.
struct InFlight<'a> {
    link: &'a WorkerLink,
    tokens: i64,
}

impl<'a> InFlight<'a> {
    fn new(link: &'a WorkerLink, tokens: i64) -> Self {
        link.outstanding.fetch_add(1, Ordering::Relaxed);
        link.outstanding_tokens.fetch_add(tokens, Ordering::Relaxed);
        InFlight { link, tokens }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.link.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.link
            .outstanding_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

async fn read_reports(link: Arc<WorkerLink>, conn: Connection) {
    while let Ok(mut recv) = conn.accept_uni().await {
        let link = link.clone();
        tokio::spawn(async move {
            match wire::read_msg::<UniHeader>(&mut recv).await {
                Ok(Some(UniHeader::Load)) => {}
                _ => {
                    // Not a load stream (nothing else is sent to a router).
                    let _ = recv.stop(0u32.into());
                    return;
                }
            }
            while let Ok(Some(r)) = wire::read_msg::<LoadReport>(&mut recv).await {
                *link.report.lock() = Some((r, Instant::now()));
            }
        });
    }
}

async fn stream_from(
    link: &WorkerLink,
    req: &GenerateRequest,
    tx: &mpsc::UnboundedSender<SeqEvent>,
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
                    cached_tokens: cached_tokens as usize,
                };
                if tx.send(ev).is_err() {
                    return Outcome::ClientGone;
                }
                if finish.is_some() {
                    return Outcome::Done;
                }
            }
            Ok(Some(TokenEvent::Rejected { message, retryable })) => {
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
