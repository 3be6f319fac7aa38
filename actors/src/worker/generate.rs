//! A router's generate request on a worker or decode role: run through the engine (a decode
//! role first takes the prompt's KV from the prefill worker the router named), its token
//! events streamed back as they come.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvmesh_discovery::Role;
use kvmesh_gateway::generate::record_progress;
use kvmesh_gpu::engine::SeqEvent;
use kvmesh_gpu::error::EngineError;
use kvmesh_telemetry::phases::Phases;
use kvmesh_telemetry::TARGET;
use kvmesh_transport::wire::{self, GenerateRequest, TokenEvent};
use kvmesh_transport::SendStream;
use tracing::{field::Empty, Instrument};

use super::pull;
use super::role_core::WorkerCore;
use crate::convert;

impl WorkerCore {
    /// A router's generate request: runs it through the engine, streaming token events. A
    /// decode role first takes the prompt's KV from the prefill worker the router named.
    pub async fn serve_generate(self: Arc<Self>, send: SendStream, req: GenerateRequest) {
        // Continues the router's attempt span.
        let span = tracing::info_span!(
            target: TARGET,
            "worker",
            otel.kind = "server",
            node = self.node_id.as_str(),
            role = self.role.as_str(),
            prompt_tokens = req.prompt.len(),
            max_tokens = req.max_tokens,
            queued_ms = Empty,
            cached_tokens = Empty,
            generated = Empty,
            finish = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
        );
        kvmesh_telemetry::set_remote_parent(&span, req.traceparent.as_deref());
        self.generate(send, req).instrument(span).await
    }

    async fn generate(self: Arc<Self>, mut send: SendStream, req: GenerateRequest) {
        let span = tracing::Span::current();
        let mut router_gone = Box::pin(send.stopped());
        if req.guide.is_some() {
            self.engine
                .warm_guide(&convert::request_from_wire(&req))
                .await;
        }
        let remote =
            matches!((&req.prefill, &self.kv), (Some(_), Some(_))) && self.role == Role::Decode;
        let sub = match (&req.prefill, &self.kv) {
            (Some(peer), Some(kv)) if self.role == Role::Decode => {
                match pull::decode(&self, kv, &req, peer, &mut router_gone).await {
                    Ok(Some(sub)) => Ok(sub),
                    Ok(None) => return,
                    Err(e) => Err(e),
                }
            }
            _ => self.engine.submit(convert::request_from_wire(&req)),
        };
        let mut sub = match sub {
            Ok(s) => s,
            Err(e) => {
                let retryable = matches!(e, EngineError::QueueFull { .. });
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", e.to_string().as_str());
                let _ = wire::write_msg(
                    &mut send,
                    &TokenEvent::Rejected {
                        message: e.to_string(),
                        retryable,
                        queue_full: retryable,
                    },
                )
                .await;
                let _ = send.finish();
                return;
            }
        };
        self.requests_served.fetch_add(1, Ordering::Relaxed);
        // Queue, prefill (chunk by chunk) and decode as spans, for a sampled request whose
        // prompt is computed here.
        let mut phases = Phases::new(&span, !remote, req.prompt.len());
        let mut out = Vec::new();
        loop {
            let ev = tokio::select! {
                biased;
                Some(p) = sub.progress.recv() => {
                    record_progress(&mut phases, p);
                    continue;
                }
                ev = sub.events.recv() => ev,
                // The router stopped reading: its client went away. Dropping `sub` aborts.
                _ = &mut router_gone => {
                    span.record("otel.status_code", "ERROR");
                    span.record("otel.status_description", "the router went away");
                    return;
                }
            };
            // Events already waiting go out with this one in a single write: one wake of the
            // connection's driver and one send, not one per token, when the engine runs
            // ahead of this task.
            out.clear();
            let mut ev = ev;
            let last = loop {
                let (msg, last) = to_wire(&mut phases, &span, ev);
                if last {
                    sub.finished();
                }
                if let Err(e) = wire::frame_into(&msg, &mut out) {
                    tracing::error!("could not encode a token event: {e}");
                    return;
                }
                if last {
                    break true;
                }
                // A step's progress comes before its tokens.
                while let Ok(p) = sub.progress.try_recv() {
                    record_progress(&mut phases, p);
                }
                match sub.events.try_recv() {
                    Ok(next) => ev = Some(next),
                    Err(_) => break false,
                }
            };
            if send.write_all(&out).await.is_err() {
                return; // the router is gone; dropping `sub` aborts the sequence
            }
            if last {
                let _ = send.finish();
                return;
            }
        }
    }
}

/// An engine event as the router is sent it, and whether it is the last; the request's
/// spans record it on the way.
fn to_wire(phases: &mut Phases, span: &tracing::Span, ev: Option<SeqEvent>) -> (TokenEvent, bool) {
    match ev {
        Some(SeqEvent::Token {
            sampled,
            finish,
            cached_tokens,
        }) => {
            phases.token(sampled.token);
            if let Some(f) = finish {
                span.record("finish", f.as_str());
                span.record("generated", phases.tokens());
                span.record("cached_tokens", cached_tokens);
            }
            (
                convert::token_to_wire(&sampled, finish, cached_tokens),
                finish.is_some(),
            )
        }
        Some(SeqEvent::Failed(m)) => {
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_description", m.as_str());
            (TokenEvent::Failed { message: m }, true)
        }
        None => (
            TokenEvent::Failed {
                message: "the worker's engine stopped".into(),
            },
            true,
        ),
    }
}
