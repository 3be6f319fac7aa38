//! `kvmesh node`: one member of a cluster. It publishes itself in etcd, watches the other
//! members, and takes the roles it is given:
//!
//! - `worker`: runs the engine and serves requests from routers over QUIC;
//! - `prefill`: runs an engine that computes prompts for decode workers and streams them
//!   the KV, layer by layer;
//! - `decode`: runs an engine that decodes, taking long prompts' KV from a prefill worker
//!   when the router says so (and prefilling short or cached ones itself);
//! - `router`: connects to every worker of its model and picks one per request (`--policy`),
//!   and a prefill worker for a decode worker's long prompts;
//! - `gateway`: the OpenAI HTTP API in front of this node's router.
//!
//! `--roles prefill,decode` runs both engines in one process; their KV moves by a copy from
//! one pool into the other.
//!
//! Every node also serves `/status` (JSON: roles, load, uptime) and `/metrics` over HTTP,
//! on the gateway's port or, for a node without a gateway, on `--status-port`. `kvmesh
//! cluster status` reads the records in etcd and each node's `/status`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use serde_json::{json, Value};

use kvmesh_actors::disagg::{KvSide, KvTransport};
use kvmesh_actors::policy::PrefixTuning;
use kvmesh_actors::router::{DisaggConfig, RouterConfig};
use kvmesh_actors::{
    CoreRole, NodeMsg, NodeRoles, Policy, Role, RoleRestarts, RouterCore, Serving, WorkerCore,
};
use kvmesh_discovery::{EtcdRegistry, Membership, NodeRecord, Registry};
use kvmesh_gateway::error::ApiError;
use kvmesh_gateway::{AppState, Dispatch, ServedModel};
use kvmesh_gpu::engine::{Request, Submission};
use kvmesh_gpu::model::LoadedModel;
use kvmesh_transport::kv::KvLayout;
use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};

use crate::serve::{start_engine, BackendArg, EngineArgs, StartedEngine};

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// Roles this node takes: any of gateway, router, worker, prefill, decode (a gateway
    /// needs a router; a worker prefills itself, so it goes without prefill and decode).
    #[arg(long, value_delimiter = ',', default_value = "worker")]
    pub roles: Vec<String>,
    /// etcd endpoints, comma-separated (http://HOST:2379).
    #[arg(long, value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    /// The cluster's name: nodes see only members of their own cluster.
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// This node's id in the cluster (default: host name and process id).
    #[arg(long)]
    pub node_id: Option<String>,
    /// QUIC address to listen on (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The address other nodes dial, when it differs from --listen (e.g. --listen 0.0.0.0:7000).
    #[arg(long)]
    pub advertise_addr: Option<SocketAddr>,
    /// Gateway: HTTP host and port of the OpenAI API.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// HTTP port of `/status` and `/metrics` on a node without a gateway (0 picks one).
    #[arg(long, default_value_t = 0)]
    pub status_port: u16,
    /// Router: round-robin, least-loaded or prefix.
    #[arg(long, default_value = "least-loaded")]
    pub policy: Policy,
    /// Worker: generated tokens per second one sequence gets here, until measured.
    #[arg(long)]
    pub capacity: Option<f64>,
    /// Router: prefill on a prefill node only prompts with at least this many tokens the
    /// decode node does not cache; shorter ones are prefilled by the decode node.
    #[arg(long, default_value_t = 256)]
    pub disagg_min_tokens: usize,
    /// Router: a prefill node with this many prompts queued has no room; the decode node
    /// then prefills itself.
    #[arg(long, default_value_t = 8)]
    pub disagg_max_queue: usize,
    /// Router: how many times a request whose worker is lost mid-stream moves to another
    /// worker (which continues the sequence from the tokens already streamed) before it
    /// ends with an error event. 0 turns migration off.
    #[arg(long, default_value_t = 3)]
    pub migration_limit: u32,
    /// Router, prefix policy: a cache hit may not send a request to a worker whose backlog
    /// (the time a request spends there apart from computing its own prompt) is more than
    /// (1 + this) times the lowest.
    /// `inf` lifts the bound.
    #[arg(long, value_parser = imbalance, default_value_t = PrefixTuning::default().max_imbalance)]
    pub prefix_max_imbalance: f64,
    /// Decode: how KV arrives from prefill nodes: quic (streams on the node's QUIC
    /// connection) or tcp (plain TCP to --kv-listen, for trusted networks).
    #[arg(long, value_enum, default_value = "quic")]
    pub kv_transport: KvTransportArg,
    /// Decode: parallel streams (QUIC) or connections (TCP) per transfer.
    #[arg(long, default_value_t = 4)]
    pub kv_streams: usize,
    /// Decode with --kv-transport tcp: the KV listener (default: the QUIC address's host,
    /// a free port).
    #[arg(long)]
    pub kv_listen: Option<SocketAddr>,
    /// Decode: a transfer that makes no progress for this many seconds is abandoned and
    /// the prompt prefilled locally.
    #[arg(long, default_value_t = 5.0)]
    pub kv_transfer_timeout: f64,
    /// Registry lease, in seconds: how long a node that vanished stays listed at most.
    #[arg(long, default_value_t = kvmesh_discovery::DEFAULT_TTL_SECS)]
    pub lease_ttl: i64,
    /// Gateway: require `Authorization: Bearer <key>` on /v1 routes (and, on any node, on
    /// /debug routes).
    #[arg(long, env = "KVMESH_API_KEY", value_parser = crate::serve::api_key)]
    pub api_key: Option<String>,
    /// Serve `POST /debug/crash/{router|worker|prefill|decode}`, which makes that role panic
    /// (to check that it is restarted). Off by default.
    #[arg(long)]
    pub enable_fault_injection: bool,
    /// On SIGTERM: seconds to let running requests finish (a worker stops taking new ones
    /// and routers see it draining at once; a gateway stops accepting connections) before
    /// the node leaves the cluster and exits. Streams still running then move to another
    /// worker.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace: f64,
    /// Scale tests: host this many sim workers in this one process, each its own cluster
    /// member (node id `ID.K` for K from 1, its own QUIC endpoint, registry record and
    /// engine) beside the node itself. Worker role and `--backend sim` only. Each sim
    /// engine's KV pool is real memory (about 48 KiB a block for the default model): size
    /// it with `--num-kv-blocks`.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Publish this fingerprint instead of the node's own (tests: a record that does not
    /// match the certificate must be refused by routers).
    #[arg(long, hide = true)]
    pub debug_advertise_fingerprint: Option<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub trace: crate::serve::TraceFlags,
    #[command(flatten)]
    pub http: crate::serve::HttpArgs,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum KvTransportArg {
    Quic,
    Tcp,
}

/// The router as a gateway's dispatch target.
struct RoutedDispatch(Arc<RouterCore>, Arc<RoleRestarts>);

impl Dispatch for RoutedDispatch {
    fn submit(&self, req: Request) -> Result<Submission, ApiError> {
        self.0
            .submit(req)
            .map_err(|e| ApiError::unavailable(e.to_string()))
    }

    fn max_model_len(&self) -> Option<usize> {
        self.0.max_model_len()
    }

    fn render_metrics(&self, out: &mut String, _model: &str) {
        self.0.render_metrics(out);
        render_restarts(out, &self.1);
    }
}

struct NodeState {
    /// This node's recent spans (served to gateways gathering a trace).
    spans: Arc<kvmesh_telemetry::SpanStore>,
    record: NodeRecord,
    started: Instant,
    router: Option<Arc<RouterCore>>,
    serving: Option<Arc<Serving>>,
    /// The node's worker-type cores: worker, decode, prefill.
    cores: Vec<Arc<WorkerCore>>,
    restarts: Arc<RoleRestarts>,
    supervisor: kvmesh_actors::ActorRef<NodeMsg>,
    fault_injection: bool,
    /// When set, /debug routes need it as the API routes do.
    api_key: Option<String>,
}

impl NodeState {
    fn status(&self) -> Value {
        let mut v = json!({
            "node_id": self.record.node_id,
            "cluster": self.record.cluster,
            "roles": self.record.roles,
            "model": self.record.model,
            "device": self.record.device,
            "quic_addr": self.record.quic_addr,
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "draining": self.serving.as_ref().is_some_and(|s| s.draining()),
            "in_flight": self.serving.as_ref().map(|s| s.in_flight()),
            "role_restarts": Role::ALL
                .iter()
                .map(|r| (r.as_str().to_string(), json!(self.restarts.get(*r))))
                .collect::<serde_json::Map<_, _>>(),
        });
        if let Some(r) = self.serving.as_ref().and_then(|s| s.load_report()) {
            v["load"] = json!({
                "running": r.running,
                "waiting": r.waiting,
                "tokens_in_flight": r.tokens_in_flight,
                "kv_usage": r.kv_usage,
                "gen_tokens_per_s": r.gen_tokens_per_s,
                "capacity_tokens_per_s": r.capacity_tokens_per_s,
                "requests_served": self
                    .cores
                    .iter()
                    .map(|c| c.requests_served.load(Ordering::Relaxed))
                    .sum::<u64>(),
            });
            if let Some(p) = r.prefill {
                v["load"]["prefill"] = json!({
                    "running": p.running,
                    "waiting": p.waiting,
                    "tokens_in_flight": p.tokens_in_flight,
                    "kv_usage": p.kv_usage,
                    "tokens_per_s": p.tokens_per_s,
                });
            }
        }
        if let Some(kv) = self.cores.iter().find_map(|c| c.kv.as_ref()) {
            {
                let st = &kv.stats;
                v["kv"] = json!({
                    "transport": kv.transport.name(),
                    "layout": kv.layout.describe(),
                    "remote": st.remote.load(Ordering::Relaxed),
                    "cached_locally": st.cached_locally.load(Ordering::Relaxed),
                    "fallback": st.fallback.load(Ordering::Relaxed),
                    "sent": st.served.load(Ordering::Relaxed),
                    "failed": st.failed.load(Ordering::Relaxed),
                    "bytes_in": st.bytes_in.load(Ordering::Relaxed),
                    "bytes_out": st.bytes_out.load(Ordering::Relaxed),
                });
            }
        }
        if let Some(r) = &self.router {
            // p50 and p99 from one sort of the recent picks.
            let recent = r.stats.picks.recent_percentiles_us(&[50.0, 99.0]);
            v["router"] = json!({
                "policy": r.policy.as_str(),
                "workers": r.workers().iter().map(|w| json!({
                    "node_id": w.record.node_id,
                    "connected": w.connected(),
                    "draining": w.draining(),
                    "load": w.load(),
                    "capacity_tokens_per_s": w.capacity(),
                    "prompt_tokens_per_s": w.prompt_rate(),
                    "routed": w.routed.load(Ordering::Relaxed),
                    "kv_blocks_reported": w.kv.held(),
                    "kv_events_synced": w.kv.synced(),
                })).collect::<Vec<_>>(),
                "refused": r.refused.lock().iter().map(|(id, why)| json!({
                    "node_id": id,
                    "reason": why,
                })).collect::<Vec<_>>(),
                "migrations": r.stats.migrations.load(Ordering::Relaxed),
                "pick_time": {
                    "count": r.stats.picks.count.load(Ordering::Relaxed),
                    "mean_us": r.stats.picks.mean_us(),
                    "max_us": r.stats.picks.max_ns.load(Ordering::Relaxed) as f64 / 1e3,
                    "recent_p50_us": recent.first(),
                    "recent_p99_us": recent.get(1),
                },
                "prefix_predictions": {
                    "exact": r.stats.predictions[0].load(Ordering::Relaxed),
                    "fewer": r.stats.predictions[1].load(Ordering::Relaxed),
                    "more": r.stats.predictions[2].load(Ordering::Relaxed),
                },
            });
        }
        v
    }

    fn metrics(&self) -> String {
        let mut o = String::new();
        render_restarts(&mut o, &self.restarts);
        let labelled = self.cores.len() > 1;
        let engines: Vec<(Option<&str>, &kvmesh_gpu::engine::EngineHandle)> = self
            .cores
            .iter()
            .map(|c| (labelled.then(|| c.role.as_str()), &c.engine))
            .collect();
        if !engines.is_empty() {
            kvmesh_gateway::metrics::render_engines(&mut o, &self.record.model, &engines);
        }
        // A node's prefill and decode cores share one KV side.
        if let Some(kv) = self.cores.iter().find_map(|c| c.kv.as_ref()) {
            kv.render_metrics(&mut o);
        }
        o
    }
}

fn render_restarts(o: &mut String, restarts: &RoleRestarts) {
    use std::fmt::Write;
    let _ = writeln!(
        o,
        "# HELP kvmesh:role_restarts_total Roles restarted by the node supervisor after a crash.\n\
         # TYPE kvmesh:role_restarts_total counter"
    );
    for role in Role::ALL {
        let _ = writeln!(
            o,
            "kvmesh:role_restarts_total{{role=\"{}\"}} {}",
            role.as_str(),
            restarts.get(role)
        );
    }
}

/// `--prefix-max-imbalance`: a relative bound, 0 or more (`inf`: none). A negative or NaN
/// value would silently become "no imbalance allowed", so it is refused.
fn imbalance(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.0 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a relative imbalance (0 or more, e.g. 1.0 for twice the lowest \
             backlog; inf for no bound)"
        )),
    }
}

/// `/status`, `/metrics` (node-level lines), `/health`, the node's spans of a trace, and
/// the fault-injection hook. A gateway serves the API's, metrics and trace routes itself.
fn node_routes(node: Arc<NodeState>, with_metrics: bool) -> Router {
    let mut r = Router::new().route(
        "/status",
        get(|State(n): State<Arc<NodeState>>| async move { Json(n.status()) }),
    );
    if with_metrics {
        r = r.route(
            "/traces/api/spans/{trace}",
            get(
                |State(n): State<Arc<NodeState>>, Path(t): Path<String>| async move {
                    Json(n.spans.trace(&t))
                },
            ),
        );
        r = r
            .route(
                "/metrics",
                get(|State(n): State<Arc<NodeState>>| async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        n.metrics(),
                    )
                }),
            )
            .route(
                "/health",
                get(|State(n): State<Arc<NodeState>>| async move {
                    // A draining worker is alive but takes nothing new: not ready.
                    if n.serving.as_ref().is_some_and(|s| s.draining()) {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            Json(json!({"status": "draining"})),
                        )
                    } else {
                        (StatusCode::OK, Json(json!({"status": "ok"})))
                    }
                }),
            );
    }
    r.route("/debug/crash/{role}", post(crash)).with_state(node)
}

async fn crash(
    State(n): State<Arc<NodeState>>,
    Path(role): Path<String>,
    headers: axum::http::HeaderMap,
) -> Response {
    if let Some(key) = &n.api_key {
        if !kvmesh_gateway::authorized(&headers, key) {
            return ApiError::unauthorized().into_response();
        }
    }
    if !n.fault_injection {
        return ApiError {
            status: StatusCode::NOT_FOUND,
            message: "fault injection is off (--enable-fault-injection)".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
        .into_response();
    }
    let Some(role) = Role::parse(&role) else {
        return ApiError::param(
            "role",
            format!("unknown role '{role}' (router, worker, prefill, decode)"),
        )
        .into_response();
    };
    let _ = n.supervisor.cast(NodeMsg::Crash(role));
    Json(json!({"crashed": role.as_str()})).into_response()
}

/// One of `--replicas`: a sim worker beside the node in its process, a cluster member of
/// its own (record, lease, QUIC endpoint, engine, supervised roles).
struct Replica {
    serving: Arc<Serving>,
    endpoint: NodeEndpoint,
    registration: kvmesh_discovery::Registration,
    _supervisor: kvmesh_actors::ActorRef<NodeMsg>,
}

impl Replica {
    async fn start(
        args: &NodeArgs,
        model: &LoadedModel,
        registry: &Arc<EtcdRegistry>,
        node: &NodeRecord,
        node_id: String,
        allowed: &AllowList,
    ) -> anyhow::Result<Replica> {
        let engine = crate::serve::start_engine_with(&args.engine, model)?;
        let identity = NodeIdentity::generate(&node_id)?;
        // Beside the node: its interface, a port of its own.
        let node_addr: SocketAddr = node.quic_addr.parse()?;
        let bind = SocketAddr::new(args.listen.ip(), 0);
        let endpoint = NodeEndpoint::bind(bind, identity.clone(), allowed.clone())?;
        let quic_addr = SocketAddr::new(node_addr.ip(), endpoint.local_addr().port());
        let capacity = node.capacity_tokens_per_s;
        let core = WorkerCore::new(
            node_id.clone(),
            CoreRole::Worker,
            engine.handle.clone(),
            capacity,
            None,
        );
        let serving = Serving::new(endpoint.clone());
        let supervisor = kvmesh_actors::supervisor::start(NodeRoles {
            router: None,
            serving: Some(serving.clone()),
            generate: Some(core),
            prefill: None,
            restarts: Arc::new(RoleRestarts::default()),
        })
        .await
        .map_err(anyhow::Error::msg)?;
        // Its own record; the node's HTTP listener answers for the process.
        let record = NodeRecord {
            node_id,
            quic_addr: quic_addr.to_string(),
            http_url: None,
            cert_sha256: identity.fingerprint.clone(),
            started_unix_ms: unix_ms(),
            ..node.clone()
        };
        let registration = registry.register(record).await?;
        Ok(Replica {
            serving,
            endpoint,
            registration,
            _supervisor: supervisor,
        })
    }

    async fn leave(self) {
        if let Err(e) = self.registration.deregister().await {
            tracing::warn!("{e}");
        }
        self.endpoint.close();
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn default_node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "node".into());
    format!("{host}-{}", std::process::id())
}

/// What a worker declares before it has measured itself: one sequence's tokens/s.
fn declared_capacity(args: &NodeArgs, device: &str) -> f64 {
    if let Some(c) = args.capacity {
        return c;
    }
    match args.engine.backend {
        BackendArg::Sim => {
            let e = &args.engine;
            let step_s = (e.sim_decode_ms / 1e3 + e.sim_decode_us_per_seq / 1e6).max(1e-6);
            e.sim_speed / step_s
        }
        BackendArg::Cpu if device.starts_with("cuda") => 100.0,
        BackendArg::Cpu => 20.0,
    }
}

/// Checks a node's roles.
fn check_roles(roles: &[String]) -> anyhow::Result<()> {
    const KNOWN: [&str; 5] = ["gateway", "router", "worker", "prefill", "decode"];
    for r in roles {
        if !KNOWN.contains(&r.as_str()) {
            bail!("unknown role '{r}' in --roles ({})", KNOWN.join(", "));
        }
    }
    let has = |r: &str| roles.iter().any(|x| x == r);
    if has("gateway") && !has("router") {
        bail!("the gateway role sends requests to a router in the same node: use --roles gateway,router");
    }
    if has("worker") && (has("prefill") || has("decode")) {
        bail!(
            "a worker prefills and decodes its own requests: use --roles worker, or \
             --roles prefill,decode for the two roles on separate engines"
        );
    }
    Ok(())
}

/// What a prefill and a decode engine must share for KV to mean the same on both.
fn kv_layout(e: &StartedEngine) -> anyhow::Result<KvLayout> {
    let spec = e
        .handle
        .info
        .kv_spec
        .clone()
        .context("the backend has no KV layout")?;
    anyhow::ensure!(
        e.handle.info.kv_transfer,
        "the {} backend keeps its KV cache in device memory, which KV transfers cannot reach \
         yet: the prefill and decode roles need the cpu or sim backend",
        e.device
    );
    // The backend family matters beyond the element type: sim KV holds no real values.
    let family = e.device.split([' ', ':']).next().unwrap_or("");
    let dtype = match family {
        "sim" => format!("sim-{}", spec.dtype.as_str()),
        _ => spec.dtype.as_str().to_string(),
    };
    Ok(KvLayout {
        model: e.fingerprint.clone(),
        dtype,
        num_layers: spec.num_layers as u32,
        block_size: spec.block_size as u32,
        num_kv_heads: spec.num_kv_heads as u32,
        head_dim: spec.head_dim as u32,
    })
}

/// Refuses to join next to a prefill or decode node of the same model whose KV layout
/// differs from ours: one could never fill the other's blocks.
fn check_kv_partners(
    node_id: &str,
    roles: &[String],
    model: &str,
    layout: &str,
    members: &[NodeRecord],
) -> anyhow::Result<()> {
    let mine: Vec<&str> = ["prefill", "decode"]
        .into_iter()
        .filter(|r| roles.iter().any(|x| x == r))
        .collect();
    for m in members {
        if m.node_id == node_id || m.model != model {
            continue;
        }
        let partner = (mine.contains(&"prefill") && m.has_role("decode"))
            || (mine.contains(&"decode") && m.has_role("prefill"));
        if partner && m.kv_layout.as_deref() != Some(layout) {
            bail!(
                "refusing to join: this {} node {node_id} has {layout}; its partner {} node {} has {}",
                mine.join(","),
                if m.has_role("prefill") { "prefill" } else { "decode" },
                m.node_id,
                m.kv_layout.as_deref().unwrap_or("no KV layout (an older version?)")
            );
        }
    }
    Ok(())
}

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let roles: Vec<String> = args.roles.iter().map(|r| r.trim().to_string()).collect();
    check_roles(&roles)?;
    let has = |r: &str| roles.iter().any(|x| x == r);
    anyhow::ensure!(
        args.lease_ttl >= 2,
        "--lease-ttl must be at least 2 seconds"
    );
    anyhow::ensure!(
        args.kv_transfer_timeout > 0.0,
        "--kv-transfer-timeout must be positive"
    );
    anyhow::ensure!(
        (1..=16).contains(&args.kv_streams),
        "--kv-streams must be between 1 and 16"
    );
    anyhow::ensure!(args.replicas >= 1, "--replicas must be at least 1");
    if args.replicas > 1 {
        anyhow::ensure!(
            roles == ["worker"],
            "--replicas hosts extra workers: it needs --roles worker alone, not {}",
            roles.join(",")
        );
        anyhow::ensure!(
            matches!(args.engine.backend, BackendArg::Sim),
            "--replicas is for scale tests on --backend sim (real engines in one process \
             would share its compute and memory)"
        );
        anyhow::ensure!(
            args.debug_advertise_fingerprint.is_none(),
            "--replicas and --debug-advertise-fingerprint do not go together"
        );
    }
    let node_id = args.node_id.clone().unwrap_or_else(default_node_id);
    let telemetry = args.trace.init(&node_id)?;
    let spans = telemetry.store.clone();

    // The engines (worker or decode, and prefill), or just the model's tokenizer and name
    // (gateway/router).
    let generate = if has("worker") || has("decode") {
        Some(start_engine(&args.engine)?)
    } else {
        None
    };
    let prefill = if has("prefill") {
        Some(start_engine(&args.engine)?)
    } else {
        None
    };
    let layout = match generate.as_ref().or(prefill.as_ref()) {
        Some(e) if has("prefill") || has("decode") => Some(kv_layout(e)?),
        _ => None,
    };
    let (model_name, tokenizer, max_model_len, block_size, device, model_fingerprint) =
        match generate.as_ref().or(prefill.as_ref()) {
            Some(e) => (
                e.name.clone(),
                e.tokenizer.clone(),
                e.max_model_len,
                e.block_size,
                e.device.clone(),
                e.fingerprint.clone(),
            ),
            None => {
                let m = match &args.engine.model {
                    Some(dir) => LoadedModel::from_dir(dir)
                        .with_context(|| format!("loading {}", dir.display()))?,
                    None => LoadedModel::from_embedded(&kvmesh_gpu::embedded::DEFAULT_MODEL)
                        .context("loading the embedded model")?,
                };
                let name = args
                    .engine
                    .served_model_name
                    .clone()
                    .unwrap_or_else(|| m.name.clone());
                let len = args
                    .engine
                    .max_model_len
                    .unwrap_or_else(|| m.config.max_context());
                (
                    name,
                    m.tokenizer.clone(),
                    len,
                    args.engine.block_size,
                    "none".into(),
                    m.fingerprint(),
                )
            }
        };
    let capacity = declared_capacity(&args, &device);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let has = |r: &str| roles.iter().any(|x| x == r);
        let identity = NodeIdentity::generate(&node_id)?;
        let allowed = AllowList::default();
        let endpoint = NodeEndpoint::bind(args.listen, identity.clone(), allowed.clone())?;
        let quic_addr = match args.advertise_addr {
            Some(a) => a,
            None => {
                let a = endpoint.local_addr();
                if a.ip().is_unspecified() {
                    bail!("--listen {} is on every interface: say which address other nodes dial with --advertise-addr HOST:PORT", args.listen);
                }
                a
            }
        };
        let registry = EtcdRegistry::connect(&args.etcd, &args.cluster, args.lease_ttl)
            .await
            .with_context(|| format!("joining cluster '{}'", args.cluster))?;

        // HTTP: the gateway's listener, or a status listener.
        let http_addr = if has("gateway") {
            format!("{}:{}", args.host, args.port)
        } else {
            let host = if args.listen.ip().is_unspecified() {
                "0.0.0.0".to_string()
            } else {
                args.listen.ip().to_string()
            };
            format!("{host}:{}", args.status_port)
        };
        let listener = tokio::net::TcpListener::bind(&http_addr)
            .await
            .with_context(|| format!("binding {http_addr}"))?;
        let local_http = listener.local_addr()?;
        let http_host = if local_http.ip().is_unspecified() {
            quic_addr.ip()
        } else {
            local_http.ip()
        };
        let http_url = format!("http://{}", SocketAddr::new(http_host, local_http.port()));

        // A decode node taking KV over TCP listens for it.
        let kv_listener = match (&layout, args.kv_transport) {
            (Some(_), KvTransportArg::Tcp) if has("decode") => {
                let addr = args
                    .kv_listen
                    .unwrap_or_else(|| SocketAddr::new(quic_addr.ip(), 0));
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the KV listener on {addr}"))?;
                Some(Arc::new(l))
            }
            _ => None,
        };
        let kv_tcp_addr = match &kv_listener {
            Some(l) => {
                let a = l.local_addr()?;
                Some(if a.ip().is_unspecified() {
                    SocketAddr::new(quic_addr.ip(), a.port())
                } else {
                    a
                })
            }
            None => None,
        };
        let record = NodeRecord {
            node_id: node_id.clone(),
            cluster: args.cluster.clone(),
            roles: roles.clone(),
            quic_addr: quic_addr.to_string(),
            http_url: Some(http_url.clone()),
            model: model_name.clone(),
            device: device.clone(),
            capacity_tokens_per_s: capacity,
            max_model_len,
            block_size,
            cert_sha256: args
                .debug_advertise_fingerprint
                .clone()
                .unwrap_or_else(|| identity.fingerprint.clone()),
            version: env!("CARGO_PKG_VERSION").into(),
            started_unix_ms: unix_ms(),
            kv_layout: layout.as_ref().map(KvLayout::describe),
            kv_tcp_addr: kv_tcp_addr.map(|a| a.to_string()),
            draining: false,
            model_fingerprint: Some(model_fingerprint.clone()),
        };
        if let Some(l) = &record.kv_layout {
            let members = registry.list().await?;
            check_kv_partners(&node_id, &roles, &model_name, l, &members)?;
        }
        let members = registry.subscribe();
        let restarts = Arc::new(RoleRestarts::default());
        // Members (and only members) may dial this node.
        {
            let mut members = members.clone();
            let allowed = allowed.clone();
            tokio::spawn(async move {
                // A member that left the registry may still dial for the routers' grace
                // period: after the registry lost its data, everyone is registering again.
                let mut seen: std::collections::HashMap<String, Instant> = Default::default();
                loop {
                    let m = members.borrow_and_update().clone();
                    let now = Instant::now();
                    for r in m.values() {
                        seen.insert(r.cert_sha256.clone(), now);
                    }
                    seen.retain(|_, at| now.duration_since(*at) < kvmesh_actors::router::REGISTRY_GRACE);
                    allowed.set(seen.keys().cloned());
                    tokio::select! {
                        r = members.changed() => if r.is_err() {
                            return;
                        },
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            });
        }
        // One KV side for the node's prefill and decode cores.
        let kv = layout.clone().map(|l| {
            let transport = match kv_tcp_addr {
                Some(addr) => KvTransport::Tcp {
                    addr,
                    connections: args.kv_streams,
                },
                None => KvTransport::Quic {
                    streams: args.kv_streams,
                },
            };
            KvSide::new(
                l,
                transport,
                Duration::from_secs_f64(args.kv_transfer_timeout),
                endpoint.clone(),
                kv_listener.clone(),
            )
        });
        let generate_core = generate.as_ref().map(|e| {
            let role = if has("decode") { CoreRole::Decode } else { CoreRole::Worker };
            WorkerCore::new(node_id.clone(), role, e.handle.clone(), capacity, kv.clone())
        });
        let prefill_core = prefill.as_ref().map(|e| {
            WorkerCore::new(node_id.clone(), CoreRole::Prefill, e.handle.clone(), capacity, kv.clone())
        });
        if let (Some(kv), Some(p)) = (&kv, &prefill_core) {
            if has("decode") {
                *kv.local_prefill.write() = Some(p.clone());
            }
        }
        let cores: Vec<Arc<WorkerCore>> =
            generate_core.iter().chain(prefill_core.iter()).cloned().collect();
        let serving = (!cores.is_empty()).then(|| Serving::new(endpoint.clone()));
        let router = has("router").then(|| {
            RouterCore::new(
                node_id.clone(),
                model_name.clone(),
                model_fingerprint.clone(),
                args.policy,
                RouterConfig {
                    disagg: DisaggConfig {
                        min_tokens: args.disagg_min_tokens,
                        max_queue: args.disagg_max_queue,
                    },
                    migration_limit: args.migration_limit,
                    prefix: PrefixTuning {
                        max_imbalance: args.prefix_max_imbalance,
                    },
                },
                endpoint.clone(),
            )
        });
        // The router dials the members it is shown. A member checks a dialling router's
        // certificate against the records it has seen, so the router is shown none until
        // this node's own record has come back through the registry's watch: the others'
        // watches have it by then too, and the first dial is not refused.
        let (router_members_tx, router_members) =
            tokio::sync::watch::channel(Membership::default());
        let supervisor = kvmesh_actors::supervisor::start(NodeRoles {
            router: router.clone().map(|r| (r, router_members)),
            serving: serving.clone(),
            generate: generate_core.clone(),
            prefill: prefill_core.clone(),
            restarts: restarts.clone(),
        })
        .await
        .map_err(anyhow::Error::msg)?;
        for e in generate.iter().chain(prefill.iter()) {
            tokio::spawn(crate::serve::log_throughput(e.handle.clone()));
        }
        let registration = registry.register(record.clone()).await?;
        {
            let mut members = members.clone();
            let me = node_id.clone();
            tokio::spawn(async move {
                let mut listed = false;
                loop {
                    let m = members.borrow_and_update().clone();
                    listed = listed || m.contains_key(&me);
                    if listed && router_members_tx.send(m).is_err() {
                        return;
                    }
                    if members.changed().await.is_err() {
                        return;
                    }
                }
            });
        }
        let mut replicas = Vec::with_capacity(args.replicas - 1);
        let model = if args.replicas > 1 {
            Some(crate::serve::load_model(&args.engine)?)
        } else {
            None
        };
        for k in 1..args.replicas {
            let r = Replica::start(
                &args,
                model.as_ref().expect("loaded for replicas"),
                &registry,
                &record,
                format!("{node_id}.{k}"),
                &allowed,
            )
            .await
            .with_context(|| format!("starting replica {k} of {}", args.replicas))?;
            replicas.push(r);
        }
        if args.replicas > 1 {
            tracing::info!("{} sim workers in this process", args.replicas);
        }

        let node = Arc::new(NodeState {
            spans: spans.clone(),
            record,
            started: Instant::now(),
            router: router.clone(),
            serving,
            cores,
            restarts,
            supervisor,
            fault_injection: args.enable_fault_injection,
            api_key: args.api_key.clone(),
        });
        let app = match &router {
            Some(r) if has("gateway") => {
                // A trace's spans are on every node it crossed: the viewer asks them all.
                let peers = {
                    let members = members.clone();
                    let me = node_id.clone();
                    Box::new(move || {
                        members
                            .borrow()
                            .values()
                            .filter(|r| r.node_id != me)
                            .filter_map(|r| r.http_url.clone())
                            .collect::<Vec<_>>()
                    })
                };
                let state = AppState::new(
                    ServedModel {
                        name: model_name.clone(),
                        tokenizer,
                        engine: Arc::new(RoutedDispatch(r.clone(), node.restarts.clone())),
                        default_max_model_len: max_model_len,
                    },
                    args.api_key.clone(),
                    Some(kvmesh_gateway::traces::Traces::new(spans.clone(), peers)),
                );
                node_routes(node.clone(), false).merge(kvmesh_gateway::router(state))
            }
            _ => node_routes(node.clone(), true),
        };
        tracing::info!(
            "node {node_id} joined cluster '{}' as {} (QUIC {quic_addr}, HTTP {http_url}, policy {})",
            args.cluster,
            roles.join(","),
            args.policy.as_str()
        );
        if let Some(l) = &layout {
            tracing::info!(
                "KV transfers: {}{}",
                l.describe(),
                kv_tcp_addr.map_or(String::new(), |a| format!(", TCP listener {a}"))
            );
        }
        if has("gateway") {
            println!("kvmesh listening on {http_url}");
        }
        println!("kvmesh node {node_id} ready: quic {quic_addr} http {http_url}");
        // SIGTERM: a worker drains first (its status listener stays up meanwhile, saying
        // so); a gateway stops accepting at once and finishes its open streams.
        let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
        let (drained_tx, drained) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            crate::serve::shutdown().await;
            signalled_tx.send_replace(true);
        });
        let http_stop = {
            let mut until = if has("gateway") {
                signalled.clone()
            } else {
                drained.clone()
            };
            async move {
                let _ = until.wait_for(|v| *v).await;
            }
        };
        let server = kvmesh_gateway::http::serve(listener, app, args.http.limits(), http_stop);
        tokio::pin!(server);
        let mut server_done = false;
        tokio::select! {
            r = &mut server => {
                r.context("serving HTTP")?;
                server_done = true;
            }
            _ = signalled.wait_for(|v| *v) => {}
        }
        let grace = Duration::from_secs_f64(args.shutdown_grace.max(0.0));
        let deadline = tokio::time::Instant::now() + grace;
        tracing::info!(
            "shutting down: finishing running requests for at most {:.0} s",
            grace.as_secs_f64()
        );
        for r in &replicas {
            r.serving.start_draining();
        }
        if let Some(serving) = &node.serving {
            serving.start_draining();
            let mut rec = node.record.clone();
            rec.draining = true;
            if let Err(e) = registration.update(rec).await {
                tracing::warn!("could not mark this node draining in the registry: {e}");
            }
            if serving.wait_idle(deadline).await {
                tracing::info!("drained: no request running");
            } else {
                tracing::warn!(
                    "grace period over with {} request(s) still running; their routers move them to other workers",
                    serving.in_flight()
                );
            }
        }
        for r in &replicas {
            r.serving.wait_idle(deadline).await;
        }
        drained_tx.send_replace(true);
        if !server_done {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left.max(Duration::from_millis(200)), &mut server).await {
                Ok(r) => r.context("serving HTTP")?,
                Err(_) => tracing::warn!(
                    "grace period over with HTTP connections still open; closing them"
                ),
            }
        }
        tracing::info!("leaving the cluster");
        for r in replicas {
            r.leave().await;
        }
        if let Err(e) = registration.deregister().await {
            tracing::warn!("{e}");
        }
        endpoint.close();
        // Give the close frames a moment to leave.
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok::<_, anyhow::Error>(())
    })?;
    telemetry.shutdown();
    Ok(())
}

#[derive(Args, Debug)]
pub struct ClusterStatusArgs {
    #[arg(long, value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn cluster_status(args: ClusterStatusArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let registry = EtcdRegistry::connect(&args.etcd, &args.cluster, 3).await?;
        let records = registry.list().await?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()?;
        let mut rows = Vec::new();
        for r in records {
            let status = match &r.http_url {
                Some(u) => match http.get(format!("{u}/status")).send().await {
                    Ok(resp) => resp.json::<Value>().await.ok(),
                    Err(_) => None,
                },
                None => None,
            };
            rows.push((r, status));
        }
        if args.json {
            let v: Vec<Value> = rows
                .iter()
                .map(|(r, s)| json!({"record": r, "status": s}))
                .collect();
            println!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(());
        }
        println!(
            "cluster '{}': {} node{}",
            args.cluster,
            rows.len(),
            if rows.len() == 1 { "" } else { "s" }
        );
        // What each router says of each worker: who cannot reach it.
        let mut unreached: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        let mut refused: std::collections::BTreeMap<String, Vec<(String, String)>> =
            Default::default();
        for (r, s) in &rows {
            for w in s
                .as_ref()
                .and_then(|s| s["router"]["refused"].as_array())
                .into_iter()
                .flatten()
            {
                if let (Some(id), Some(why)) = (w["node_id"].as_str(), w["reason"].as_str()) {
                    refused
                        .entry(id.to_string())
                        .or_default()
                        .push((r.node_id.clone(), why.to_string()));
                }
            }
            let Some(ws) = s.as_ref().and_then(|s| s["router"]["workers"].as_array()) else {
                continue;
            };
            for w in ws {
                if w["connected"] == json!(false) {
                    if let Some(id) = w["node_id"].as_str() {
                        unreached
                            .entry(id.to_string())
                            .or_default()
                            .push(r.node_id.clone());
                    }
                }
            }
        }
        println!(
            "{:<20} {:<21} {:<21} {:<14} {:<14} {:>9} {:>9} {:>7} {:>8}  STATE",
            "NODE", "ROLES", "QUIC", "MODEL", "DEVICE", "CAP tok/s", "RUN/WAIT", "KV %", "UPTIME"
        );
        let mut problems = Vec::new();
        for (r, s) in rows {
            let state = if r.draining || s.as_ref().is_some_and(|s| s["draining"] == json!(true)) {
                "draining".to_string()
            } else if let Some(by) = refused.get(&r.node_id) {
                for (router, why) in by {
                    problems.push(format!(
                        "{}: router {router} does not route to it: it {why}",
                        r.node_id
                    ));
                }
                "refused".to_string()
            } else if let Some(routers) = unreached.get(&r.node_id) {
                problems.push(format!(
                    "{}: router(s) {} cannot reach it at its advertised QUIC address {} \
                     (a wrong --advertise-addr, a firewall, or a cut link); it gets no requests",
                    r.node_id,
                    routers.join(", "),
                    r.quic_addr
                ));
                "unreachable".to_string()
            } else if s.is_none() {
                "no status".to_string()
            } else {
                "ok".to_string()
            };
            let load = s
                .as_ref()
                .and_then(|s| s.get("load"))
                .map(|l| format!("{}/{}", l["running"], l["waiting"]))
                .unwrap_or_else(|| "-".into());
            let worker = ["worker", "prefill", "decode"]
                .iter()
                .any(|x| r.has_role(x));
            let cap = match s
                .as_ref()
                .and_then(|s| s["load"]["capacity_tokens_per_s"].as_f64())
            {
                Some(c) => format!("{c:.1}"),
                None if worker => format!("{:.1}", r.capacity_tokens_per_s),
                None => "-".into(),
            };
            let kv = s
                .as_ref()
                .and_then(|s| s["load"]["kv_usage"].as_f64())
                .map(|k| format!("{:.1}", 100.0 * k))
                .unwrap_or_else(|| "-".into());
            let uptime = s
                .as_ref()
                .and_then(|s| s["uptime_s"].as_f64())
                .map(|u| format!("{u:.0}s"))
                .unwrap_or_else(|| "unreachable".into());
            println!(
                "{:<20} {:<21} {:<21} {:<14} {:<14} {:>9} {:>9} {:>7} {:>8}  {}",
                r.node_id,
                r.roles.join(","),
                r.quic_addr,
                r.model,
                r.device,
                cap,
                load,
                kv,
                uptime,
                state
            );
        }
        for p in problems {
            println!("! {p}");
        }
        Ok(())
    })
}
