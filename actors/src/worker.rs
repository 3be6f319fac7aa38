//! The worker role's data path: accepts routers' QUIC connections, runs each request stream
//! through the local engine, and pushes load reports on every connection.
//!
//! Per-token traffic goes engine channel → QUIC stream directly; the worker actor only owns
//! the accept loop's lifecycle (see `supervisor.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_gpu::engine::{EngineHandle, FinishReason, Request, SeqEvent};
use kvmesh_gpu::error::EngineError;
use kvmesh_gpu::sampler::SamplingParams;
use kvmesh_transport::wire::{
    self, Finish, GenerateRequest, LoadReport, StreamRequest, TokenEvent, TopLogprob, UniHeader,
};
use kvmesh_transport::{peer_fingerprint, Connection, NodeEndpoint};
use parking_lot::Mutex;

/// How often a worker pushes its load to each connected router.
pub const LOAD_REPORT_INTERVAL: Duration = Duration::from_millis(200);

pub struct WorkerCore {
    pub node_id: String,
    pub engine: EngineHandle,
    pub endpoint: NodeEndpoint,
    /// Declared capacity (tokens/s) until a measurement replaces it.
    pub declared_capacity: f64,
    meter: Mutex<Meter>,
    pub requests_served: AtomicU64,
}

/// Generation rate over report intervals. Capacity is the rate one running sequence gets:
/// engine steps per second of busy time (smoothed). It falls as a node fills, so a router
/// weighting by it settles where each node's sequences progress equally fast, which gives a
/// node three times faster about three times the work.
struct Meter {
    last_tokens: u64,
    last_steps: u64,
    last_busy_us: u64,
    last_at: Instant,
    rate: f64,
    per_seq: f64,
}

impl WorkerCore {
    pub fn new(
        node_id: String,
        engine: EngineHandle,
        endpoint: NodeEndpoint,
        declared_capacity: f64,
    ) -> Arc<WorkerCore> {
        let s = &engine.stats;
        let meter = Meter {
            last_tokens: s.generation_tokens.load(Ordering::Relaxed),
            last_steps: s.steps.load(Ordering::Relaxed),
            last_busy_us: s.busy_us.load(Ordering::Relaxed),
            last_at: Instant::now(),
            rate: 0.0,
            per_seq: 0.0,
        };
        Arc::new(WorkerCore {
            node_id,
            engine,
            endpoint,
            declared_capacity,
            meter: Mutex::new(meter),
            requests_served: AtomicU64::new(0),
        })
    }

    /// The current load. Rates are recomputed at most every half report interval, so many
    /// router connections asking at once share one measurement.
    pub fn load_report(&self) -> LoadReport {
        let s = &self.engine.stats;
        let running = s.running.load(Ordering::Relaxed) as u32;
        let waiting = s.waiting.load(Ordering::Relaxed) as u32;
        let total = self.engine.info.num_blocks as u32;
        let free = s.free_blocks.load(Ordering::Relaxed) as u32;
        let mut m = self.meter.lock();
        let now = Instant::now();
        let dt = (now - m.last_at).as_secs_f64();
        if dt >= LOAD_REPORT_INTERVAL.as_secs_f64() / 2.0 {
            let tokens = s.generation_tokens.load(Ordering::Relaxed);
            m.rate = (tokens - m.last_tokens) as f64 / dt;
            let steps = s.steps.load(Ordering::Relaxed);
            let busy_us = s.busy_us.load(Ordering::Relaxed);
            let (d_steps, d_busy) = (steps - m.last_steps, busy_us - m.last_busy_us);
            m.last_steps = steps;
            m.last_busy_us = busy_us;
            // Only busy time says what the node can do; an idle interval says nothing.
            if d_steps > 0 && d_busy > 0 {
                let sample = d_steps as f64 / (d_busy as f64 / 1e6);
                m.per_seq = if m.per_seq == 0.0 {
                    sample
                } else {
                    0.7 * m.per_seq + 0.3 * sample
                };
            }
            m.last_tokens = tokens;
            m.last_at = now;
        }
        LoadReport {
            running,
            waiting,
            // KV blocks in use, in tokens: what the running sequences hold.
            tokens_in_flight: (total.saturating_sub(free) as u64)
                * self.engine.info.config.block_size as u64,
            kv_usage: if total == 0 {
                0.0
            } else {
                1.0 - free as f32 / total as f32
            },
            total_blocks: total,
            gen_tokens_per_s: m.rate as f32,
            capacity_tokens_per_s: if m.per_seq > 0.0 {
                m.per_seq as f32
            } else {
                self.declared_capacity as f32
            },
        }
    }

    /// Accepts connections until the endpoint closes.
    pub async fn accept_loop(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            let core = self.clone();
            tokio::spawn(async move {
                match incoming.await {
                    Ok(conn) => core.serve_connection(conn).await,
                    // Outsiders (unknown certificates) end here.
                    Err(e) => tracing::warn!("refused a QUIC connection: {e}"),
                }
            });
        }
    }

    async fn serve_connection(self: Arc<Self>, conn: Connection) {
        let peer = peer_fingerprint(&conn).unwrap_or_default();
        tracing::info!(
            "router {} connected from {}",
            &peer[..peer.len().min(12)],
            conn.remote_address()
        );
        let reporter = tokio::spawn(report_load(self.clone(), conn.clone()));
        loop {
            match conn.accept_bi().await {
                Ok((send, recv)) => {
                    let core = self.clone();
                    tokio::spawn(async move { core.serve_request(send, recv).await });
                }
                Err(e) => {
                    tracing::info!(
                        "router connection from {} ended: {e}",
                        conn.remote_address()
                    );
                    break;
                }
            }
        }
        reporter.abort();
    }

    async fn serve_request(&self, mut send: wire_send::Send, mut recv: wire_send::Recv) {
        let req: GenerateRequest = match wire::read_msg(&mut recv).await {
            Ok(Some(StreamRequest::Generate(r))) => r,
            Ok(Some(StreamRequest::Prefill(_))) => {
                let _ = wire::write_msg(
                    &mut send,
                    &TokenEvent::Rejected {
                        message: "this worker does not take prefill requests".into(),
                        retryable: false,
                    },
                )
                .await;
                return;
            }
            Ok(None) => return,
            Err(e) => {
                let _ = wire::write_msg(
                    &mut send,
                    &TokenEvent::Rejected {
                        message: format!("unreadable request: {e}"),
                        retryable: false,
                    },
                )
                .await;
                return;
            }
        };
        let sub = self.engine.submit(to_engine_request(&req));
        let mut sub = match sub {
            Ok(s) => s,
            Err(e) => {
                let retryable = matches!(e, EngineError::QueueFull { .. });
                let _ = wire::write_msg(
                    &mut send,
                    &TokenEvent::Rejected {
                        message: e.to_string(),
                        retryable,
                    },
                )
                .await;
                let _ = send.finish();
                return;
            }
        };
        self.requests_served.fetch_add(1, Ordering::Relaxed);
        loop {
            let ev = tokio::select! {
                ev = sub.events.recv() => ev,
                // The router stopped reading: its client went away. Dropping `sub` aborts.
                _ = send.stopped() => return,
            };
            let (msg, last) = match ev {
                Some(SeqEvent::Token {
                    sampled,
                    finish,
                    cached_tokens,
                }) => (
                    TokenEvent::Token {
                        token: sampled.token,
                        logprob: sampled.logprob,
                        top: sampled
                            .top
                            .iter()
                            .map(|&(token, logprob)| TopLogprob { token, logprob })
                            .collect(),
                        finish: finish.map(|f| match f {
                            FinishReason::Stop => Finish::Stop,
                            FinishReason::Length => Finish::Length,
                        }),
                        cached_tokens: cached_tokens as u32,
                    },
                    finish.is_some(),
                ),
                Some(SeqEvent::Failed(m)) => (TokenEvent::Failed { message: m }, true),
                None => (
                    TokenEvent::Failed {
                        message: "the worker's engine stopped".into(),
                    },
                    true,
                ),
            };
            if last {
                sub.finished();
            }
            if wire::write_msg(&mut send, &msg).await.is_err() {
                return; // the router is gone; dropping `sub` aborts the sequence
            }
            if last {
                let _ = send.finish();
                return;
            }
        }
    }
}

/// Stream types, named once.
mod wire_send {
    pub type Send = kvmesh_transport::SendStream;
    pub type Recv = kvmesh_transport::RecvStream;
}

fn to_engine_request(r: &GenerateRequest) -> Request {
    Request {
        prompt: r.prompt.clone(),
        params: SamplingParams {
            temperature: r.temperature,
            top_k: r.top_k as usize,
            top_p: r.top_p,
            seed: r.seed,
            max_tokens: r.max_tokens as usize,
            stop_token_ids: r.stop_token_ids.clone(),
            ignore_eos: r.ignore_eos,
            logprobs: r.logprobs.map(|n| n as usize),
        },
    }
}

/// Pushes load reports to one router until its connection ends.
async fn report_load(core: Arc<WorkerCore>, conn: Connection) {
    let Ok(mut send) = conn.open_uni().await else {
        return;
    };
    if wire::write_msg(&mut send, &UniHeader::Load).await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval(LOAD_REPORT_INTERVAL);
    loop {
        tick.tick().await;
        if wire::write_msg(&mut send, &core.load_report())
            .await
            .is_err()
        {
            return;
        }
    }
}
