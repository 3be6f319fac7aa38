//! A node's QUIC endpoint as its worker-type roles serve it: connections from routers and
//! decode workers are accepted, each request stream goes to the role that takes it, and
//! every connection is sent the node's load and its prefix cache's events.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_discovery::Role;
use kvmesh_gpu::kv_cache::KvEvent;
use kvmesh_telemetry::RateLimited;
use kvmesh_transport::grant::{self, StreamGrant};
use kvmesh_transport::wire::{
    self, CardReply, KvEventBatch, LoadReport, StreamRequest, TokenEvent, UniHeader,
};
use kvmesh_transport::{peer_fingerprint, Connection, NodeEndpoint, RecvStream, SendStream};
use parking_lot::RwLock;

use super::load::LOAD_REPORT_INTERVAL;
use super::role_core::WorkerCore;
use crate::pace::ReportPace;

/// A node's QUIC endpoint and the roles serving on it: requests are handed to whichever
/// role takes them, while its actor has it registered.
pub struct Serving {
    pub endpoint: NodeEndpoint,
    /// The worker or decode role: takes generate requests.
    generate: RwLock<Option<Arc<WorkerCore>>>,
    /// The prefill role: takes prefill requests.
    prefill: RwLock<Option<Arc<WorkerCore>>>,
    /// Set once the node starts shutting down: new requests are refused (retryable) and
    /// every router connection is sent a report saying so at once.
    draining: tokio::sync::watch::Sender<bool>,
    /// Generate and prefill streams being served.
    in_flight: AtomicU64,
    /// The model card of the node's model (its fingerprint, and the card as JSON), for the
    /// gateways that ask.
    card: RwLock<Option<(String, Arc<Vec<u8>>)>>,
    /// How often load reports go out, as the cluster's size sets it.
    pub pace: Arc<ReportPace>,
}

/// Counts a stream being served for as long as it lives.
struct InFlight<'a>(&'a AtomicU64);

impl<'a> InFlight<'a> {
    fn enter(n: &'a AtomicU64) -> InFlight<'a> {
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Serving {
    pub fn new(endpoint: NodeEndpoint) -> Arc<Serving> {
        Serving::paced(endpoint, Arc::default())
    }

    /// Serving with load reports at `pace` (shared by the workers of one process).
    pub fn paced(endpoint: NodeEndpoint, pace: Arc<ReportPace>) -> Arc<Serving> {
        Arc::new(Serving {
            pace,
            endpoint,
            generate: RwLock::new(None),
            prefill: RwLock::new(None),
            draining: tokio::sync::watch::channel(false).0,
            in_flight: AtomicU64::new(0),
            card: RwLock::new(None),
        })
    }

    /// The card served to gateways asking for the model of `fingerprint`.
    pub fn set_card(&self, fingerprint: String, card: Arc<Vec<u8>>) {
        *self.card.write() = Some((fingerprint, card));
    }

    /// Answers a gateway's request for a model card. A card is served while draining too:
    /// it is read-only, and a gateway may still be finishing that model's requests.
    async fn serve_card(&self, mut send: SendStream, fingerprint: String) {
        let card = self.card.read().clone();
        let reply = match card {
            Some((f, card)) if f == fingerprint => CardReply::Card(card.to_vec()),
            Some((f, _)) => CardReply::Refused {
                message: format!(
                    "this node serves the model of fingerprint {f}, not {fingerprint}"
                ),
            },
            None => CardReply::Refused {
                message: "this node has no model card".into(),
            },
        };
        let _ = wire::write_msg(&mut send, &reply).await;
        let _ = send.finish();
    }

    /// Starts the shutdown: refuse new requests, tell every router now.
    pub fn start_draining(&self) {
        self.draining.send_replace(true);
    }

    pub fn draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Generate and prefill requests being served now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits until no request is being served, or `deadline`; says whether it got there.
    pub async fn wait_idle(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Puts a role's core in service (`Some`) or out of it (`None`).
    pub fn set(&self, role: Role, core: Option<Arc<WorkerCore>>) {
        if role == Role::Prefill {
            *self.prefill.write() = core;
        } else {
            *self.generate.write() = core;
        }
    }

    /// The node's load, as routers see it: the generating role's, with the prefill role's
    /// beside it.
    pub fn load_report(&self) -> Option<LoadReport> {
        let gen = self.generate.read().clone();
        let pre = self.prefill.read().clone();
        let mut report = match (gen, pre) {
            (Some(g), Some(p)) => {
                let mut r = g.load_report();
                r.prefill = p.load_report().prefill;
                r
            }
            (Some(c), None) | (None, Some(c)) => c.load_report(),
            (None, None) => return None,
        };
        report.draining = self.draining();
        Some(report)
    }

    /// Accepts connections until the endpoint closes. Refused handshakes (outsiders with
    /// unknown certificates, garbage) are logged with the peer's address, a line every few
    /// seconds at most, so a flood cannot flood the log.
    pub async fn accept_loop(self: Arc<Self>) {
        let refusals = Arc::new(parking_lot::Mutex::new(RateLimited::default()));
        while let Some(incoming) = self.endpoint.accept().await {
            let serving = self.clone();
            let refusals = refusals.clone();
            let peer = incoming.remote_address();
            tokio::spawn(async move {
                match incoming.await {
                    Ok(conn) => serving.serve_connection(conn).await,
                    Err(e) => {
                        // "authentication failed": a client Initial packet that does not
                        // decrypt. Garbage does that; so do retransmissions of handshakes
                        // this node dropped while it was paused (SIGSTOP, a debugger, a VM
                        // pause), sent to the connection id it had chosen, from which QUIC
                        // derives other keys than the client used.
                        let hint = if e.to_string().contains("authentication failed") {
                            " (a handshake packet that does not decrypt: garbage, or stale \
                             retransmissions if this process was paused)"
                        } else {
                            ""
                        };
                        let mut log = refusals.lock();
                        if log.ready() {
                            tracing::warn!(
                                "refused a QUIC connection from {peer}: {e}{hint}{}",
                                log.suppressed_note()
                            );
                        }
                    }
                }
            });
        }
    }

    async fn serve_connection(self: Arc<Self>, conn: Connection) {
        let peer = peer_fingerprint(&conn).unwrap_or_default();
        tracing::info!(
            "peer {} connected from {}",
            &peer[..peer.len().min(12)],
            conn.remote_address()
        );
        let reporter = tokio::spawn(report_load(self.clone(), conn.clone()));
        let kv_reporter = tokio::spawn(report_kv_events(self.clone(), conn.clone()));
        let grant = StreamGrant::new(&conn, grant::Dir::Bi);
        loop {
            match conn.accept_bi().await {
                Ok((send, recv)) => {
                    let serving = self.clone();
                    let conn = conn.clone();
                    let open = grant.enter();
                    tokio::spawn(async move {
                        serving.serve_stream(conn, send, recv).await;
                        drop(open);
                    });
                }
                Err(e) => {
                    tracing::info!("connection from {} ended: {e}", conn.remote_address());
                    break;
                }
            }
        }
        reporter.abort();
        kv_reporter.abort();
    }

    async fn serve_stream(&self, conn: Connection, mut send: SendStream, mut recv: RecvStream) {
        let reject = |message: String, retryable: bool| TokenEvent::Rejected {
            message,
            retryable,
            queue_full: false,
        };
        let msg = match wire::read_msg::<StreamRequest>(&mut recv).await {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                let _ = wire::write_msg(
                    &mut send,
                    &reject(format!("unreadable request: {e}"), false),
                )
                .await;
                return;
            }
        };
        let msg = match msg {
            StreamRequest::Card { fingerprint } => {
                return self.serve_card(send, fingerprint).await;
            }
            other => other,
        };
        let _counted = InFlight::enter(&self.in_flight);
        if self.draining() {
            let why = "this node is shutting down";
            let _ = match msg {
                StreamRequest::Generate(_) => {
                    wire::write_msg(&mut send, &reject(why.into(), true)).await
                }
                StreamRequest::Card { .. } => Ok(()),
                StreamRequest::Prefill(_) => {
                    wire::write_msg(
                        &mut send,
                        &wire::PrefillEvent::Failed {
                            message: why.into(),
                            retryable: true,
                        },
                    )
                    .await
                }
            };
            let _ = send.finish();
            return;
        }
        match msg {
            StreamRequest::Generate(req) => {
                let core = self.generate.read().clone();
                match core {
                    Some(c) => c.serve_generate(send, req).await,
                    None => {
                        let why = if self.prefill.read().is_some() {
                            "this node only prefills"
                        } else {
                            "this node's worker role is restarting"
                        };
                        let _ = wire::write_msg(&mut send, &reject(why.into(), true)).await;
                        let _ = send.finish();
                    }
                }
            }
            StreamRequest::Card { .. } => {}
            StreamRequest::Prefill(req) => {
                let core = self.prefill.read().clone();
                match core {
                    Some(c) => c.serve_prefill(conn, send, req).await,
                    None => {
                        let _ = wire::write_msg(
                            &mut send,
                            &wire::PrefillEvent::Failed {
                                message: "this node has no prefill role".into(),
                                retryable: false,
                            },
                        )
                        .await;
                        let _ = send.finish();
                    }
                }
            }
        }
    }
}

/// Pushes the generating engine's prefix-cache stores and evictions on one connection
/// until it ends: a snapshot, then each batch as it comes (those that queued while the
/// last was written go as one). A node without a generating role sends none.
async fn report_kv_events(serving: Arc<Serving>, conn: Connection) {
    let hub = loop {
        if let Some(c) = serving.generate.read().as_ref() {
            break c.engine.kv_events.clone();
        }
        if serving.prefill.read().is_some() {
            return;
        }
        // The role is starting or restarting.
        tokio::time::sleep(LOAD_REPORT_INTERVAL).await;
    };
    let Ok(mut send) = conn.open_uni().await else {
        return;
    };
    if wire::write_msg(&mut send, &UniHeader::KvEvents)
        .await
        .is_err()
    {
        return;
    }
    loop {
        let (held, mut rx) = hub.subscribe();
        let snapshot = KvEventBatch {
            snapshot: true,
            stored: held,
            removed: Vec::new(),
        };
        if wire::write_msg(&mut send, &snapshot).await.is_err() {
            return;
        }
        // Ends when the hub dropped this subscriber for falling behind: resubscribe.
        while let Some(first) = rx.recv().await {
            let mut latest: std::collections::HashMap<u64, bool> = Default::default();
            let mut add = |batch: &[KvEvent]| {
                for e in batch {
                    match *e {
                        KvEvent::Stored(h) => latest.insert(h.0, true),
                        KvEvent::Removed(h) => latest.insert(h.0, false),
                    };
                }
            };
            add(&first);
            while let Ok(more) = rx.try_recv() {
                add(&more);
            }
            let mut batch = KvEventBatch::default();
            for (h, stored) in latest {
                if stored {
                    batch.stored.push(h);
                } else {
                    batch.removed.push(h);
                }
            }
            if wire::write_msg(&mut send, &batch).await.is_err() {
                return;
            }
        }
    }
}

/// Pushes load reports on one connection until it ends: at the cluster's pace
/// ([`crate::pace`]), only when the report changed, and at least every ten intervals.
async fn report_load(serving: Arc<Serving>, conn: Connection) {
    let Ok(mut send) = conn.open_uni().await else {
        return;
    };
    if wire::write_msg(&mut send, &UniHeader::Load).await.is_err() {
        return;
    }
    let mut draining = serving.draining.subscribe();
    let mut last: Option<(LoadReport, Instant)> = None;
    loop {
        let every = serving.pace.every();
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            // Draining started: say so now, not at the next tick.
            Ok(()) = draining.changed() => {}
        }
        let Some(report) = serving.load_report() else {
            continue;
        };
        let news = match &last {
            Some((sent, at)) => report != *sent || at.elapsed() >= every * 10,
            None => true,
        };
        if !news {
            continue;
        }
        if wire::write_msg(&mut send, &report).await.is_err() {
            return;
        }
        last = Some((report, Instant::now()));
    }
}
