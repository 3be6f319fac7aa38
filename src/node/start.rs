//! Starting a node: its engines, its endpoints and record, the cores of its roles under their
//! supervisor, and the HTTP routes it serves.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use axum::Router;
use tokio::net::TcpListener;

use kvmesh_actors::pace::ReportPace;
use kvmesh_actors::worker::{KvSide, KvTransport, UcxSide};
use kvmesh_actors::{NodeRoles, Pinned, Pools, Role, RoleRestarts, Serving, WorkerCore};
use kvmesh_discovery::{
    DirRegistry, EmbeddedRegistry, EtcdRegistry, Membership, NodeRecord, Registration, Registry,
};
use kvmesh_gateway::AppState;
use kvmesh_gpu::backend::sm_split::{SmPartition, SmSide};
use kvmesh_gpu::model::{LoadedModel, Numerics};
use kvmesh_gpu::tokenizer::TextTokenizer;
use kvmesh_transport::kv::ucx::{Ucx, UcxOptions};
use kvmesh_transport::wire::KvLayout;
use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};

use super::catalog::{LocalModel, MeshCatalog};
use super::membership::{check_kv_partners, follow_allow_list, follow_pace, gate_router_members};
use super::plan::{KvPlan, NetworkPlan, NodePlan};
use super::replica::{unix_ms, Host, Replica};
use super::status::{node_routes, NodeState};
use crate::engines::{load_model, start_engine_with, EngineArgs, StartedEngine};

/// The node's engines (worker or decode, and prefill), or, for a gateway/router node, just
/// what it needs of the model.
pub struct Engines {
    generate: Option<StartedEngine>,
    prefill: Option<StartedEngine>,
    /// Prefill and decode roles: the KV layout both ends of a transfer share.
    layout: Option<KvLayout>,
    /// None: a gateway/router node started without `--model`, serving whatever models the
    /// mesh's workers serve.
    model: Option<ModelInfo>,
}

/// What a node tells others about its model, and what its gateway serves it with.
pub(super) struct ModelInfo {
    name: String,
    tokenizer: Arc<TextTokenizer>,
    max_model_len: usize,
    block_size: usize,
    device: String,
    fingerprint: String,
    /// The card its workers give gateways (nodes with an engine).
    card: Option<Arc<Vec<u8>>>,
}

impl ModelInfo {
    fn of(e: &StartedEngine) -> ModelInfo {
        ModelInfo {
            name: e.name.clone(),
            tokenizer: e.tokenizer.clone(),
            max_model_len: e.max_model_len,
            block_size: e.block_size,
            device: e.device.clone(),
            fingerprint: e.fingerprint.clone(),
            card: Some(e.card.clone()),
        }
    }

    /// A node without an engine given `--model` reads the model's files for its tokenizer
    /// and fingerprint: its gateway serves that name only with that model (computed by the
    /// model's math, or with `--backend sim` by the sim backend). Without `--model` it has
    /// none, and serves what the workers serve.
    fn without_engine(args: &EngineArgs) -> anyhow::Result<Option<ModelInfo>> {
        let Some(dir) = &args.model else {
            return Ok(None);
        };
        let m = LoadedModel::from_dir(dir).with_context(|| format!("loading {}", dir.display()))?;
        Ok(Some(ModelInfo {
            name: args.served_name(&m.name)?,
            tokenizer: m.tokenizer.clone(),
            max_model_len: args.max_model_len.unwrap_or_else(|| m.config.max_context()),
            block_size: args.block_size,
            device: "none".into(),
            fingerprint: m.fingerprint(args.numerics()),
            card: None,
        }))
    }

    pub(super) fn pinned(&self) -> Pinned {
        Pinned {
            name: self.name.clone(),
            fingerprint: self.fingerprint.clone(),
        }
    }
}

impl Engines {
    /// The plan's engines, or what a node without one needs of its `--model`.
    pub fn start(plan: &NodePlan) -> anyhow::Result<Engines> {
        let p = &plan.engines;
        // The model is read once, for both engines.
        let loaded = if p.runs_engine() {
            Some(load_model(&p.args)?)
        } else {
            None
        };
        // With --sm-split each engine runs on its side of the GPU's SMs.
        let start = |wanted: bool, side: SmSide| match (&loaded, wanted) {
            (Some(m), true) => {
                let mut args = p.args.clone();
                args.sm_partition = p.sm_split.map(|split| SmPartition { split, side });
                let decode = side == SmSide::Decode;
                args.kv_exportable = decode && plan.kv.as_ref().is_some_and(|k| k.cuda_ipc);
                args.kv_for_ucx = decode && plan.kv.as_ref().is_some_and(|k| k.ucx.is_some());
                start_engine_with(&args, m).map(Some)
            }
            _ => Ok(None),
        };
        let generate = start(p.generate.is_some(), SmSide::Decode)?;
        let prefill = start(p.prefill, SmSide::Prefill)?;
        let first = generate.as_ref().or(prefill.as_ref());
        let layout = match first {
            Some(e) if plan.kv.is_some() => Some(kv_layout(e)?),
            _ => None,
        };
        let model = match first {
            Some(e) => Some(ModelInfo::of(e)),
            None => ModelInfo::without_engine(&p.args)?,
        };
        Ok(Engines {
            generate,
            prefill,
            layout,
            model,
        })
    }
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

/// The node's sockets and its place in the registry.
struct Network {
    identity: NodeIdentity,
    allowed: AllowList,
    endpoint: NodeEndpoint,
    /// Where other nodes dial it.
    quic_addr: SocketAddr,
    /// Where the node publishes itself: etcd, or with `--no-etcd` this process.
    registry: Arc<dyn Registry>,
    /// The same registry when it is etcd, for what only etcd does (replicas' records share
    /// the node's lease).
    etcd: Option<Arc<EtcdRegistry>>,
    /// The gateway's listener, or the status listener of a node without one.
    listener: TcpListener,
    http_url: String,
    /// A decode node taking KV over TCP: its KV listener and the address it advertises.
    kv_listener: Option<Arc<TcpListener>>,
    kv_tcp_addr: Option<SocketAddr>,
    /// With --kv-transport ucx (or auto, where the library loads): the node's UCX.
    ucx: Option<Ucx>,
}

impl Network {
    async fn bind(
        net: &NetworkPlan,
        kv: Option<&KvPlan>,
        node_id: &str,
    ) -> anyhow::Result<Network> {
        // Before anything is bound or joined: a missing UCX fails the start at once.
        let ucx = start_ucx(kv)?;
        let identity = NodeIdentity::generate(node_id)?;
        let allowed = AllowList::default();
        let endpoint = NodeEndpoint::bind(net.listen, identity.clone(), allowed.clone())?;
        // The plan refused an unspecified --listen without --advertise-addr.
        let quic_addr = net.advertise.unwrap_or_else(|| endpoint.local_addr());
        let (registry, etcd): (Arc<dyn Registry>, _) = if let Some(dir) = &net.registry_dir {
            let r = DirRegistry::open(dir, &net.cluster, net.lease_ttl)
                .with_context(|| format!("joining cluster '{}'", net.cluster))?;
            (r, None)
        } else if net.etcd.is_empty() {
            (EmbeddedRegistry::new(&net.cluster), None)
        } else {
            let r = EtcdRegistry::connect(&net.etcd, &net.cluster, net.lease_ttl)
                .await
                .with_context(|| format!("joining cluster '{}'", net.cluster))?;
            (r.clone(), Some(r))
        };
        let listener = TcpListener::bind(&net.http_bind)
            .await
            .with_context(|| format!("binding {}", net.http_bind))?;
        let local_http = listener.local_addr()?;
        let http_host = if local_http.ip().is_unspecified() {
            quic_addr.ip()
        } else {
            local_http.ip()
        };
        let http_url = format!("http://{}", SocketAddr::new(http_host, local_http.port()));
        let kv_listener = match kv.and_then(|k| k.tcp_listener) {
            Some(at) => {
                let addr = at.unwrap_or_else(|| SocketAddr::new(quic_addr.ip(), 0));
                let l = TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the KV listener on {addr}"))?;
                Some(Arc::new(l))
            }
            None => None,
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
        Ok(Network {
            identity,
            allowed,
            endpoint,
            quic_addr,
            registry,
            etcd,
            listener,
            http_url,
            kv_listener,
            kv_tcp_addr,
            ucx,
        })
    }
}

/// The node's UCX, when its KV transport asks for it: `ucx` fails the start without it,
/// `auto` goes on without (TCP).
fn start_ucx(kv: Option<&KvPlan>) -> anyhow::Result<Option<Ucx>> {
    let Some(want) = kv.and_then(|k| k.ucx.as_ref()) else {
        return Ok(None);
    };
    let opts = UcxOptions {
        tls: want.tls.clone(),
    };
    match Ucx::start(&opts) {
        Ok(u) => Ok(Some(u)),
        Err(e) if want.required => bail!("--kv-transport ucx: {e}"),
        Err(e) => {
            tracing::info!("--kv-transport auto: no UCX ({e}); KV moves over TCP");
            Ok(None)
        }
    }
}

/// A node that has joined: what serving and draining it need.
pub struct Started {
    pub node: Arc<NodeState>,
    /// Kept for as long as the node runs: its watch feeds every view of the membership.
    pub registry: Arc<dyn Registry>,
    pub endpoint: NodeEndpoint,
    pub registration: Registration,
    pub replicas: Vec<Replica>,
    pub listener: TcpListener,
    pub app: Router,
    /// Ends the gateway's open streams when the shutdown grace period is over.
    pub streams: kvmesh_gateway::StreamCut,
}

/// Binds, publishes and starts every role of the node; the HTTP server is not serving yet.
pub async fn start(
    plan: &NodePlan,
    engines: Engines,
    spans: Arc<kvmesh_telemetry::SpanStore>,
) -> anyhow::Result<Started> {
    let node_id = &plan.node_id;
    let net = Network::bind(&plan.network, plan.kv.as_ref(), node_id).await?;
    let device = engines.model.as_ref().map_or("none", |m| m.device.as_str());
    let capacity = plan.engines.declared_capacity(device);
    let record = record(plan, &engines, &net, capacity);
    if let Some(l) = &record.kv_layout {
        let members = net.registry.list().await?;
        check_kv_partners(node_id, &plan.roles, &record.model, l, &members)?;
    }
    if let (Some(m), None, None) = (&engines.model, &engines.generate, &engines.prefill) {
        check_pinned_model(&plan.engines.args, m, &net.registry.list().await?)?;
    }
    let members = net.registry.subscribe();
    // Members (and only members) may dial this node.
    follow_allow_list(members.clone(), net.allowed.clone());
    let pace = Arc::new(ReportPace::default());
    follow_pace(members.clone(), pace.clone());
    let cores = cores(plan, &engines, &net, capacity);
    let serving = (!cores.is_empty()).then(|| Serving::paced(net.endpoint.clone(), pace.clone()));
    if let (Some(s), Some(m)) = (&serving, &engines.model) {
        if let Some(card) = &m.card {
            s.set_card(
                m.fingerprint.clone(),
                Arc::new(node_card(plan.debug.tamper_card, card, &record)?),
            );
        }
    }
    let router = plan.router.as_ref().map(|r| {
        Pools::new(
            node_id.clone(),
            engines.model.as_ref().map(ModelInfo::pinned),
            r.policy,
            r.config,
            net.endpoint.clone(),
        )
    });
    let (router_members_tx, router_members) = tokio::sync::watch::channel(Membership::default());
    let restarts = Arc::new(RoleRestarts::default());
    let supervisor = kvmesh_actors::supervisor::start(NodeRoles {
        router: router.clone().map(|r| (r, router_members)),
        serving: serving.clone(),
        generate: cores.iter().find(|c| c.role.generates()).cloned(),
        prefill: cores.iter().find(|c| c.role == Role::Prefill).cloned(),
        restarts: restarts.clone(),
    })
    .await
    .context("starting the node supervisor")?;
    for e in engines.generate.iter().chain(engines.prefill.iter()) {
        tokio::spawn(crate::engines::log_throughput(e.handle.clone()));
    }
    let registration = net.registry.register(record.clone()).await?;
    gate_router_members(members.clone(), node_id.clone(), router_members_tx);
    let replicas = start_replicas(plan, &net, &registration, &record, &pace).await?;
    let node = Arc::new(NodeState {
        spans: spans.clone(),
        record,
        started: Instant::now(),
        router: router.clone(),
        serving,
        cores,
        restarts,
        supervisor,
        fault_injection: plan.fault_injection,
        api_key: plan.api_key.clone(),
    });
    let (app, streams) = app(plan, &node, engines.model.as_ref(), members, spans);
    log_joined(plan, &node, &net, engines.layout.as_ref());
    Ok(Started {
        node,
        registry: net.registry,
        endpoint: net.endpoint,
        registration,
        replicas,
        listener: net.listener,
        app,
        streams,
    })
}

/// The card this node serves: its engine's, with the node's KV layout when it transfers
/// KV; with `--debug-tamper-card`, its chat template changed and its fingerprint not.
fn node_card(tamper: bool, card: &[u8], record: &NodeRecord) -> anyhow::Result<Vec<u8>> {
    let mut c = kvmesh_gpu::card::ModelCard::from_bytes(card)?;
    c.kv_layout = record.kv_layout.clone();
    if tamper {
        c.chat_template = Some("{{ messages[0]['content'] }}".into());
    }
    let bytes = c.to_bytes();
    check_card_size(&c, bytes.len())?;
    Ok(bytes)
}

/// A card longer than one frame carries could never reach a gateway (its model would be
/// listed and never served): the worker stops at start-up instead, naming the sizes.
fn check_card_size(card: &kvmesh_gpu::card::ModelCard, len: usize) -> anyhow::Result<()> {
    let max = kvmesh_transport::wire::CardReply::max_card_bytes();
    let mib = |n: usize| n as f64 / (1 << 20) as f64;
    if len > max {
        bail!(
            "the model card of '{}' is {len} bytes ({:.1} MiB), over the {max} bytes \
             ({:.1} MiB) a card may have on the wire (its frame limit), so no gateway could \
             fetch it; its tokenizer.json alone is {} bytes. This worker does not start: serve \
             the model with a smaller tokenizer.json, or with `kvmesh serve`, which needs no \
             card",
            card.name,
            mib(len),
            mib(max),
            card.tokenizer_json.len(),
        );
    }
    Ok(())
}

/// A gateway or router given `--model` serves that name only with that model: workers
/// already serving the name with another model stop it at start-up, naming both.
fn check_pinned_model(
    args: &EngineArgs,
    m: &ModelInfo,
    members: &[NodeRecord],
) -> anyhow::Result<()> {
    let other = members.iter().find(|r| {
        r.model == m.name
            && r.roles.iter().any(|role| role.runs_engine())
            && r.model_fingerprint.as_deref() != Some(m.fingerprint.as_str())
    });
    if let Some(w) = other {
        let sim_here = args.numerics() == Numerics::Simulated;
        let hint = match (sim_here, w.simulated()) {
            (false, true) => {
                " It runs the sim backend, whose tokens are not the model's: give the gateway \
                 --backend sim to stand for sim workers"
            }
            (true, false) => {
                " It computes the model, and this gateway's --backend sim stands for sim workers"
            }
            _ => "",
        };
        bail!(
            "--model {} is model '{}' of fingerprint {}, but worker {} serves '{}' with \
             fingerprint {}: another model (config, tokenizer, weights or backend) under that \
             name. Give the gateway the workers' model, or no --model to serve what the \
             workers serve.{hint}",
            args.model
                .as_ref()
                .map_or(String::new(), |d| d.display().to_string()),
            m.name,
            m.fingerprint,
            w.node_id,
            w.model,
            w.model_fingerprint.as_deref().unwrap_or("none"),
        );
    }
    Ok(())
}

/// The record this node publishes.
fn record(plan: &NodePlan, engines: &Engines, net: &Network, capacity: f64) -> NodeRecord {
    let m = engines.model.as_ref();
    NodeRecord {
        node_id: plan.node_id.clone(),
        cluster: plan.network.cluster.clone(),
        roles: plan.roles.clone(),
        quic_addr: net.quic_addr.to_string(),
        http_url: Some(net.http_url.clone()),
        model: m.map(|m| m.name.clone()).unwrap_or_default(),
        device: m.map_or("none", |m| m.device.as_str()).to_string(),
        capacity_tokens_per_s: capacity,
        max_model_len: m.map_or(0, |m| m.max_model_len),
        block_size: m.map_or(plan.engines.args.block_size, |m| m.block_size),
        cert_sha256: plan
            .debug
            .advertise_fingerprint
            .clone()
            .unwrap_or_else(|| net.identity.fingerprint.clone()),
        version: env!("CARGO_PKG_VERSION").into(),
        started_unix_ms: unix_ms(),
        kv_layout: engines.layout.as_ref().map(KvLayout::describe),
        kv_tcp_addr: net.kv_tcp_addr.map(|a| a.to_string()),
        kv_transports: match engines.layout {
            Some(_) => {
                let mut t = vec!["quic".to_string()];
                t.extend(net.kv_tcp_addr.map(|_| "tcp".to_string()));
                t.extend(net.ucx.as_ref().map(|_| "ucx".to_string()));
                // A prefill engine on a GPU copies into a decode node's exported cache.
                let gpu = |e: &StartedEngine| e.handle.info.device_kv.is_some();
                if engines.prefill.as_ref().is_some_and(gpu) {
                    t.push("cuda-ipc".to_string());
                    // ... and puts from its cache on the GPU where UCX has CUDA.
                    if net.ucx.as_ref().is_some_and(Ucx::supports_cuda) {
                        t.push("ucx-cuda".to_string());
                    }
                }
                t
            }
            None => Vec::new(),
        },
        draining: false,
        model_fingerprint: m.map(|m| m.fingerprint.clone()),
    }
}

/// The cores of the node's worker-type roles; its prefill and decode cores share one KV side,
/// and a decode core copies from its own node's prefill core in process.
fn cores(plan: &NodePlan, engines: &Engines, net: &Network, capacity: f64) -> Vec<Arc<WorkerCore>> {
    let kv = engines.layout.clone().zip(plan.kv.as_ref()).map(|(l, k)| {
        let streams = match net.kv_tcp_addr {
            Some(addr) => KvTransport::Tcp {
                addr,
                connections: k.streams,
            },
            None => KvTransport::Quic { streams: k.streams },
        };
        // `ucx`: QUIC from prefill nodes without UCX; `auto`: TCP (its listener is bound);
        // `cuda-ipc`: QUIC from prefill nodes without a GPU cache.
        let transport = match &net.ucx {
            Some(_) => KvTransport::Ucx {
                lanes: k.streams,
                otherwise: Box::new(streams),
            },
            None if k.cuda_ipc => KvTransport::CudaIpc {
                otherwise: Box::new(streams),
            },
            None => streams,
        };
        let ucx = net.ucx.clone().map(|u| UcxSide::new(u, k.checksum));
        KvSide::new(
            l,
            transport,
            k.transfer_timeout,
            net.endpoint.clone(),
            net.kv_listener.clone(),
            ucx,
        )
    });
    let core = |role, e: &StartedEngine| {
        WorkerCore::new(
            plan.node_id.clone(),
            role,
            e.handle.clone(),
            capacity,
            kv.clone(),
        )
    };
    let generate = engines
        .generate
        .as_ref()
        .zip(plan.engines.generate)
        .map(|(e, role)| core(role, e));
    let prefill = engines.prefill.as_ref().map(|e| core(Role::Prefill, e));
    if let (Some(g), Some(p)) = (&generate, &prefill) {
        if g.role == Role::Decode && kv.is_some() {
            *g.local_prefill.write() = Some(p.clone());
        }
    }
    generate.into_iter().chain(prefill).collect()
}

/// Replicas started at once.
const REPLICAS_STARTING: usize = 16;

async fn start_replicas(
    plan: &NodePlan,
    net: &Network,
    beside: &Registration,
    record: &NodeRecord,
    pace: &Arc<ReportPace>,
) -> anyhow::Result<Vec<Replica>> {
    let extra = plan.engines.extra_replicas;
    let mut replicas = Vec::with_capacity(extra);
    if extra == 0 {
        return Ok(replicas);
    }
    let etcd = net
        .etcd
        .as_ref()
        .context("--replicas registers its workers in etcd")?;
    let host = &Host {
        engine: &plan.engines.args,
        listen_ip: plan.network.listen.ip(),
        model: Arc::new(crate::engines::load_model(&plan.engines.args)?),
        registry: etcd,
        beside,
        node: record,
        pace,
        allowed: &net.allowed,
        // Sim engines model their steps' time: a thread per core waits it out for all.
        engines: Arc::new(kvmesh_gpu::engine::EnginePool::new(
            std::thread::available_parallelism().map_or(2, |n| n.get()),
        )),
    };
    // Several at once: each waits on etcd (its record) and makes a key pair.
    use futures::stream::{self, StreamExt, TryStreamExt};
    let started: Vec<Replica> = stream::iter(1..=extra)
        .map(|k| async move {
            Replica::start(host, format!("{}.{k}", record.node_id))
                .await
                .with_context(|| format!("starting replica {k} of {}", extra + 1))
        })
        .buffer_unordered(REPLICAS_STARTING)
        .try_collect()
        .await?;
    replicas.extend(started);
    tracing::info!("{} sim workers in this process", extra + 1);
    Ok(replicas)
}

/// The node's HTTP routes: the OpenAI API, metrics and trace viewer in front of its router
/// (a gateway), or its status routes; and what ends the gateway's open streams when a
/// shutdown's grace period is over.
fn app(
    plan: &NodePlan,
    node: &Arc<NodeState>,
    model: Option<&ModelInfo>,
    members: tokio::sync::watch::Receiver<Membership>,
    spans: Arc<kvmesh_telemetry::SpanStore>,
) -> (Router, kvmesh_gateway::StreamCut) {
    let (Some(r), Some(gateway)) = (node.router.as_ref(), plan.gateway.as_ref()) else {
        return (node_routes(node.clone(), true), Default::default());
    };
    // A trace's spans are on every node it crossed: the viewer asks them all.
    let me = node.record.node_id.clone();
    let peers = Box::new(move || {
        members
            .borrow()
            .values()
            .filter(|r| r.node_id != me)
            .filter_map(|r| r.http_url.clone())
            .collect::<Vec<_>>()
    });
    let pinned = model.map(|m| LocalModel {
        name: m.name.clone(),
        tokenizer: m.tokenizer.clone(),
        max_model_len: m.max_model_len,
        fingerprint: m.fingerprint.clone(),
    });
    let catalog = MeshCatalog::new(
        r.clone(),
        node.restarts.clone(),
        pinned,
        gateway.cache_dir.clone(),
        gateway.tool_call_parser,
    );
    if !node.cores.is_empty() {
        let n = node.clone();
        catalog.show_local_metrics(Box::new(move |o| n.render_workers(o)));
    }
    let state = AppState::new(
        catalog,
        plan.api_key.clone(),
        Some(kvmesh_gateway::traces::Traces::new(spans, peers)),
    );
    let streams = state.streams.clone();
    (
        node_routes(node.clone(), false).merge(kvmesh_gateway::router(state)),
        streams,
    )
}

fn log_joined(plan: &NodePlan, node: &NodeState, net: &Network, layout: Option<&KvLayout>) {
    let node_id = &node.record.node_id;
    let (quic_addr, http_url) = (net.quic_addr, &net.http_url);
    tracing::info!(
        "node {node_id} joined cluster '{}' as {} (QUIC {quic_addr}, HTTP {http_url}, policy {})",
        plan.network.cluster,
        plan.roles_joined(),
        plan.router.as_ref().map_or("none", |r| r.policy.as_str())
    );
    if let Some(l) = layout {
        tracing::info!(
            "KV transfers: {}{}",
            l.describe(),
            net.kv_tcp_addr
                .map_or(String::new(), |a| format!(", TCP listener {a}"))
                + &net
                    .ucx
                    .as_ref()
                    .map_or(String::new(), |u| format!(", {}", u.describe()))
        );
    }
    if plan.gateway.is_some() {
        println!("kvmesh listening on {http_url}");
    }
    println!("kvmesh node {node_id} ready: quic {quic_addr} http {http_url}");
}
