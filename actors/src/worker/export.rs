//! The prefill side of a disaggregated request: compute the decode worker's prompt here and
//! push each layer's K and V into its reserved blocks as soon as the layer is computed, then
//! send the first token and the sampler's state. The bytes travel over QUIC streams, TCP
//! connections, or, when both roles are in this process, by a copy from one pool into the
//! other (`kvmesh_transport::kv`).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvmesh_gpu::engine::{ExportEvent, Handover, KvLease, SeqEvent, Submission};
use kvmesh_gpu::error::EngineError;
use kvmesh_telemetry::TARGET;
use kvmesh_transport::kv::ipc::IpcSender;
use kvmesh_transport::kv::local::{LocalSender, LocalTarget};
use kvmesh_transport::kv::streams::{StreamSender, Target};
use kvmesh_transport::kv::ucx::{remote_keys, UcxSender};
use kvmesh_transport::kv::{KvRegion, KvSender};
use kvmesh_transport::wire::{self, DataPath, PrefillEvent, PrefillRequest};
use kvmesh_transport::{Connection, TransportError};
use tokio::sync::mpsc;
use tracing::{field::Empty, Instrument};

use super::kv_side::{region, TransferError};
use super::role_core::WorkerCore;
use crate::convert;

/// Where a prefill worker sends a transfer's bytes.
pub enum SendVia {
    /// Streams on the decode worker's connection, or TCP to its listener (`DataPath`).
    Network(Connection),
    /// The decode role in this same process.
    Local(LocalTarget),
}

impl WorkerCore {
    /// Prefill side: computes `req`'s prompt, sends its KV, and reports on `events`; stops
    /// (freeing everything) as soon as `events` is closed.
    pub async fn run_export(
        &self,
        req: PrefillRequest,
        via: SendVia,
        events: mpsc::UnboundedSender<PrefillEvent>,
    ) {
        let span = tracing::info_span!(
            target: TARGET,
            "prefill.remote",
            otel.kind = "server",
            node = self.node_id.as_str(),
            decode_worker = req.decode_node.as_str(),
            via = match (&via, &req.data) {
                (SendVia::Local(t), _) if t.on_device() => "in-process-device",
                (SendVia::Local(_), _) => "in-process",
                (_, DataPath::Quic { .. }) => "quic",
                (_, DataPath::Tcp { .. }) => "tcp",
                (_, DataPath::Ucx { device: true, .. }) => "ucx-device",
                (_, DataPath::Ucx { .. }) => "ucx",
                (_, DataPath::CudaIpc(_)) => "cuda-ipc",
            },
            prompt_tokens = req.request.prompt.len(),
            from_pos = req.from_pos,
            cached_tokens = Empty,
            bytes = Empty,
            ms = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
        );
        kvmesh_telemetry::set_remote_parent(&span, req.request.traceparent.as_deref());
        let closed = events.clone();
        let started = Instant::now();
        let r = tokio::select! {
            r = self.export(&req, via, &events).instrument(span.clone()) => r,
            _ = closed.closed() => Err(TransferError::fatal("the decode worker went away")),
        };
        let secs = started.elapsed().as_secs_f64();
        span.record("ms", secs * 1e3);
        match &r {
            Ok(bytes) => {
                span.record("bytes", *bytes);
            }
            Err(e) => {
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", e.message.as_str());
            }
        }
        let kv = self.kv.as_ref().expect("a prefill role has a KV side");
        match r {
            Ok(bytes) => {
                kv.stats.served.fetch_add(1, Ordering::Relaxed);
                kv.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
            }
            Err(TransferError { message, retryable }) => {
                kv.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    "prefill for {} (transfer {}) ended: {message}",
                    req.decode_node,
                    req.transfer_id
                );
                let _ = events.send(PrefillEvent::Failed { message, retryable });
            }
        }
    }

    async fn export(
        &self,
        req: &PrefillRequest,
        via: SendVia,
        events: &mpsc::UnboundedSender<PrefillEvent>,
    ) -> Result<u64, TransferError> {
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| TransferError::fatal("not a prefill worker"))?;
        if let Some(m) = kv.layout.mismatch(
            &format!("prefill worker {}", self.node_id),
            &req.layout,
            &format!("decode worker {}", req.decode_node),
        ) {
            return Err(TransferError::fatal(m));
        }
        let from = req.from_pos as usize;
        // A decode engine of this process that lent its device cache's blocks takes them
        // from this engine's on the device.
        // So does a decode worker of this host that exported its cache (CUDA IPC), and one
        // whose cache on a GPU is registered with UCX.
        let handover = match (&via, &req.data) {
            (SendVia::Local(t), _) if t.on_device() => Handover::Device,
            (SendVia::Network(_), DataPath::CudaIpc(_)) => Handover::Device,
            (SendVia::Network(_), DataPath::Ucx { device: true, .. }) => Handover::Device,
            _ => Handover::Host,
        };
        let (mut sub, mut ev, lease, computed) = self.admit(req, handover).await?;
        let span = tracing::Span::current();
        span.record("cached_tokens", computed);
        let _ = events.send(PrefillEvent::Started {
            cached: computed as u32,
        });
        let to = lease.prompt_len();
        if req.dest_blocks.len() * lease.spec().block_size < to {
            return Err(TransferError::fatal(format!(
                "the decode worker's {} blocks cannot hold {to} tokens",
                req.dest_blocks.len()
            )));
        }
        let target = Target {
            source: Arc::new(region(&lease, from..to)),
            transfer_id: req.transfer_id,
            dest_blocks: req.dest_blocks.clone(),
            span: span.clone(),
        };
        let ipc_dest = match &req.data {
            DataPath::CudaIpc(_) => {
                let dest = kv.ipc.dest(&lease, &req.data, &req.dest_blocks, from..to);
                Some(dest.map_err(|e| TransferError::fatal(e.0))?)
            }
            _ => None,
        };
        drop(lease);
        let ucx = kv.ucx.as_ref().map(|u| &u.ucx);
        let mut sender = open_sender(via, req, target, ucx, ipc_dest).await?;
        let layers = kv.layout.num_layers as usize;
        let mut progress = Layers::new(layers, from, to, &span);
        // The cached prefix goes at once.
        if computed > from {
            for layer in 0..layers {
                sender
                    .send(layer, from, computed - from)
                    .await
                    .map_err(net)?;
            }
            progress.sent.fill(computed);
        }
        // The export channel closes when the sequence ends, which may be seen before its
        // token is: then only the token is left to wait for.
        let mut ev_open = true;
        let first = loop {
            let mut jobs = Vec::new();
            tokio::select! {
                e = ev.recv(), if ev_open => match e {
                    Some(e) => progress.on_export(e, &mut jobs),
                    None => ev_open = false,
                },
                e = sub.events.recv() => match e {
                    Some(SeqEvent::Token { sampled, .. }) => {
                        sub.finished();
                        // Every layer was reported before the token: collect the rest.
                        while let Ok(e) = ev.try_recv() {
                            progress.on_export(e, &mut jobs);
                        }
                        send_all(&mut sender, jobs).await?;
                        break sampled;
                    }
                    other => return Err(TransferError::retryable(failure(other))),
                },
            }
            send_all(&mut sender, jobs).await?;
        };
        progress.check_complete()?;
        let state = progress.take_state()?;
        let totals = sender.finish().await.map_err(net)?;
        let _ = events.send(PrefillEvent::Done {
            token: first.token,
            logprob: first.logprob,
            top: convert::top_to_wire(&first.top),
            rng: progress.rng,
            cached: computed as u32,
            bytes: totals.bytes,
            state,
        });
        Ok(totals.bytes)
    }

    /// The prompt into this engine, its first token only (the decode worker applies every
    /// stop rule), waiting for its admission: the submission, the layers' channel, the
    /// blocks' lease and the positions the prefix cache held.
    async fn admit(
        &self,
        req: &PrefillRequest,
        handover: Handover,
    ) -> Result<
        (
            Submission,
            mpsc::UnboundedReceiver<ExportEvent>,
            KvLease,
            usize,
        ),
        TransferError,
    > {
        let mut ereq = convert::request_from_wire(&req.request);
        self.engine.warm_guide(&ereq).await;
        ereq.params.max_tokens = 1;
        ereq.params.ignore_eos = true;
        ereq.params.stop_token_ids.clear();
        let (mut sub, mut ev) = self
            .engine
            .submit_export_on(ereq, req.from_pos as usize, handover)
            .map_err(|e| TransferError {
                retryable: matches!(e, EngineError::QueueFull { .. }),
                message: e.to_string(),
            })?;
        self.requests_served.fetch_add(1, Ordering::Relaxed);
        let _queue = tracing::info_span!(target: TARGET, "queue");
        let (lease, computed) = tokio::select! {
            e = ev.recv() => match e {
                Some(ExportEvent::Ready { lease, computed }) => (lease, computed),
                _ => return Err(TransferError::retryable("the engine dropped the request")),
            },
            e = sub.events.recv() => return Err(TransferError::retryable(failure(e))),
        };
        Ok((sub, ev, lease, computed))
    }

    /// Prefill side of a request that came over QUIC: runs the export, writing its events
    /// on the stream; a decode worker that stops reading cancels it.
    pub async fn serve_prefill(
        self: Arc<Self>,
        conn: Connection,
        mut send: kvmesh_transport::SendStream,
        req: PrefillRequest,
    ) {
        let (etx, mut erx) = mpsc::unbounded_channel();
        let core = self.clone();
        let work = core.run_export(req, SendVia::Network(conn), etx);
        tokio::pin!(work);
        let stopped = send.stopped();
        tokio::pin!(stopped);
        let mut finished = false;
        loop {
            tokio::select! {
                _ = &mut work, if !finished => finished = true,
                ev = erx.recv() => match ev {
                    Some(ev) => {
                        if wire::write_msg(&mut send, &ev).await.is_err() {
                            return; // dropping `work` cancels the export
                        }
                    }
                    None => {
                        let _ = send.finish();
                        return;
                    }
                },
                _ = &mut stopped => return,
            }
        }
    }
}

fn net(e: TransportError) -> TransferError {
    TransferError::retryable(format!("sending KV: {e}"))
}

/// How the bytes go: a copy into the decode role of this process, or streams (QUIC or TCP,
/// as the decode worker asked) to the decode worker.
async fn open_sender(
    via: SendVia,
    req: &PrefillRequest,
    target: Target,
    ucx: Option<&kvmesh_transport::kv::ucx::Ucx>,
    ipc_dest: Option<KvRegion>,
) -> Result<Box<dyn KvSender>, TransferError> {
    Ok(match (via, &req.data) {
        (SendVia::Local(t), _) => Box::new(LocalSender::new(target.source, t)),
        (SendVia::Network(conn), DataPath::Quic { streams }) => Box::new(
            StreamSender::quic(&conn, target, req.secret, (*streams).clamp(1, 16) as usize)
                .await
                .map_err(net)?,
        ),
        (SendVia::Network(_), DataPath::Tcp { addr, connections }) => {
            let addr: SocketAddr = addr
                .parse()
                .map_err(|e| TransferError::fatal(format!("bad KV address '{addr}': {e}")))?;
            Box::new(
                StreamSender::tcp(
                    addr,
                    target,
                    req.secret,
                    (*connections).clamp(1, 16) as usize,
                )
                .await
                .map_err(net)?,
            )
        }
        (
            SendVia::Network(conn),
            DataPath::Ucx {
                worker,
                registration,
                buffers,
                lanes,
                checksum,
                device: _,
            },
        ) => {
            let ucx = ucx.ok_or_else(|| {
                TransferError::fatal(
                    "this prefill worker has no UCX (start it with --kv-transport ucx or auto)",
                )
            })?;
            let keys = remote_keys(worker, *registration, buffers);
            let lanes = (*lanes).clamp(1, 16) as usize;
            Box::new(
                UcxSender::quic(
                    ucx.clone(),
                    &conn,
                    target,
                    keys,
                    req.secret,
                    lanes,
                    *checksum,
                )
                .await
                .map_err(|e| match e {
                    TransportError::Codec(m) => TransferError::fatal(m),
                    e => net(e),
                })?,
            )
        }
        (SendVia::Network(conn), DataPath::CudaIpc(path)) => {
            let dest = ipc_dest.ok_or_else(|| TransferError::fatal("no mapped destination"))?;
            let ids = (target.transfer_id, req.secret, path.registration);
            Box::new(
                IpcSender::quic(&conn, target.source, dest, ids)
                    .await
                    .map_err(|e| match e {
                        TransportError::Codec(m) => TransferError::fatal(m),
                        e => net(e),
                    })?,
            )
        }
    })
}

async fn send_all(
    sender: &mut Box<dyn KvSender>,
    jobs: Vec<(usize, usize, usize)>,
) -> Result<(), TransferError> {
    for (layer, first, n) in jobs {
        sender.send(layer, first, n).await.map_err(net)?;
    }
    Ok(())
}

/// What an export has sent of each layer, the prompt's chunks as spans (a chunk is computed
/// once its last layer is reported), and the sampler's state after the first token.
struct Layers<'s> {
    sent: Vec<usize>,
    to: usize,
    span: &'s tracing::Span,
    chunk: Option<tracing::Span>,
    rng: Option<[u64; 4]>,
    /// The recurrent state after the prompt, for a model with one.
    state: Option<Vec<f32>>,
}

impl<'s> Layers<'s> {
    fn new(layers: usize, from: usize, to: usize, span: &'s tracing::Span) -> Layers<'s> {
        let mut l = Layers {
            sent: vec![from; layers],
            to,
            span,
            chunk: None,
            rng: None,
            state: None,
        };
        l.chunk = Some(l.chunk_span());
        l
    }

    fn chunk_span(&self) -> tracing::Span {
        tracing::info_span!(target: TARGET, parent: self.span, "prefill.chunk", upto = Empty)
    }

    /// An engine event: new positions of a layer to send (as `(layer, first, n)` jobs), or
    /// the sampler's state.
    fn on_export(&mut self, e: ExportEvent, jobs: &mut Vec<(usize, usize, usize)>) {
        let layers = self.sent.len();
        match e {
            ExportEvent::Layer { layer, upto } if layer < layers && upto > self.sent[layer] => {
                jobs.push((layer, self.sent[layer], upto - self.sent[layer]));
                self.sent[layer] = upto;
                if layer + 1 == layers {
                    if let Some(c) = self.chunk.take() {
                        c.record("upto", upto);
                    }
                    if upto < self.to {
                        self.chunk = Some(self.chunk_span());
                    }
                }
            }
            ExportEvent::Sampled { rng } => self.rng = Some(rng),
            ExportEvent::State(s) => self.state = Some(s),
            _ => {}
        }
    }

    /// The recurrent state to send with the first token, if the model has one: it travels
    /// in the final event, so it must fit one frame.
    fn take_state(&mut self) -> Result<Option<Vec<f32>>, TransferError> {
        let Some(state) = self.state.take() else {
            return Ok(None);
        };
        let bytes = state.len() * 4;
        // Room for the rest of the event beside it.
        if bytes + (1 << 20) > wire::MAX_FRAME {
            return Err(TransferError::fatal(format!(
                "this model's recurrent state ({} MiB a sequence) is larger than a transfer \
                 message may be ({} MiB)",
                bytes >> 20,
                wire::MAX_FRAME >> 20
            )));
        }
        Ok(Some(state))
    }

    /// Every layer was computed up to the end of the prompt.
    fn check_complete(&self) -> Result<(), TransferError> {
        match self.sent.iter().position(|&s| s != self.to) {
            Some(l) => Err(TransferError::retryable(format!(
                "layer {l} was computed up to {} of {} positions",
                self.sent[l], self.to
            ))),
            None => Ok(()),
        }
    }
}

fn failure(e: Option<SeqEvent>) -> String {
    match e {
        Some(SeqEvent::Failed(m)) => m,
        Some(SeqEvent::Token { .. }) => "an unexpected token".into(),
        None => "the engine stopped".into(),
    }
}
