//! `kvmesh node`'s flags as clap reads them; `plan` checks them together.

use std::net::SocketAddr;

use clap::Args;

use kvmesh_actors::policy::PrefixTuning;
use kvmesh_actors::router::{DisaggConfig, RouterConfig};
use kvmesh_actors::worker::KvSide;
use kvmesh_actors::{Policy, Role};

use crate::engines::EngineArgs;
use crate::flags::{HttpArgs, TraceFlags};

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// Roles this node takes: any of gateway, router, worker, prefill, decode (a gateway
    /// needs a router; a worker prefills itself, so it goes without prefill and decode).
    #[arg(long, value_delimiter = ',', default_value = "worker", value_parser = role)]
    pub roles: Vec<Role>,
    /// etcd endpoints, comma-separated (http://HOST:2379).
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present_any = ["no_etcd", "registry_dir"]
    )]
    pub etcd: Vec<String>,
    /// No etcd, several processes on this machine: the nodes publish themselves as files in
    /// this directory (one per node, kept alive like etcd's leases, `--lease-ttl`) and read
    /// each other's from it. Every node of the cluster names the same directory.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["etcd", "no_etcd"])]
    pub registry_dir: Option<std::path::PathBuf>,
    /// No etcd: this node is the whole cluster, its roles finding each other in process
    /// (e.g. `--roles gateway,router,prefill,decode` on one machine); no other node can join.
    #[arg(long, conflicts_with = "etcd")]
    pub no_etcd: bool,
    /// Prefill and decode engines on one GPU, each on its own share of the SMs (green
    /// contexts): SM counts (`prefill:96,decode:36`, or one side, the other taking the rest)
    /// or prefill's share (`0.75`). Needs a prefill or decode role on a CUDA device: with
    /// both, each engine takes its side; with one, its engine takes that side and another
    /// process of this host the other (`--kv-transport cuda-ipc` between them).
    #[arg(long, value_name = "SPLIT")]
    pub sm_split: Option<kvmesh_gpu::backend::sm_split::SmSplit>,
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
    /// Router: round-robin, least-loaded, power-of-two or prefix.
    #[arg(long, default_value = "least-loaded")]
    pub policy: Policy,
    /// Worker: generated tokens per second one sequence gets here, until measured.
    #[arg(long)]
    pub capacity: Option<f64>,
    /// Router: prefill on a prefill node only prompts with at least this many tokens the
    /// decode node does not cache; shorter ones are prefilled by the decode node.
    #[arg(long, default_value_t = DisaggConfig::default().min_tokens)]
    pub disagg_min_tokens: usize,
    /// Router: a prefill node with this many prompts queued has no room; the decode node
    /// then prefills itself.
    #[arg(long, default_value_t = DisaggConfig::default().max_queue)]
    pub disagg_max_queue: usize,
    /// Router: how many times a request whose worker is lost mid-stream moves to another
    /// worker (which continues the sequence from the tokens already streamed) before it
    /// ends with an error event. 0 turns migration off.
    #[arg(long, default_value_t = RouterConfig::default().migration_limit)]
    pub migration_limit: u32,
    /// Router, prefix policy: a cache hit may not send a request to a worker whose backlog
    /// (the time a request spends there apart from computing its own prompt) is more than
    /// (1 + this) times the lowest.
    /// `inf` lifts the bound.
    #[arg(long, value_parser = imbalance, default_value_t = PrefixTuning::default().max_imbalance)]
    pub prefix_max_imbalance: f64,
    /// How KV moves between prefill and decode nodes. Decode: quic (streams on the node's
    /// QUIC connection), tcp (plain TCP to --kv-listen, for trusted networks), ucx (UCX
    /// puts into this node's registered KV pool: RDMA where the fabric has it, shared
    /// memory on one host, else TCP; QUIC from prefill nodes without UCX) or auto (UCX
    /// where both ends have it, else TCP) or cuda-ipc (prefill nodes of this host on GPUs
    /// copy on the device into this node's KV cache, exported once by CUDA IPC; QUIC from
    /// the others). Prefill: ucx or auto load UCX so decode nodes can ask for it; a prefill
    /// node on a GPU takes CUDA IPC whenever a decode node asks. UCX is the system's
    /// libucp.so.0 (Debian: libucx0).
    #[arg(long, value_enum, default_value = "quic")]
    pub kv_transport: KvTransportArg,
    /// With --kv-transport ucx or auto: the UCX transports to use, as UCX_TLS takes them
    /// (e.g. `rc,sm,tcp`, `sm`, `tcp`); by default UCX's own choice (its environment).
    #[arg(long, value_name = "LIST")]
    pub ucx_tls: Option<String>,
    /// Decode: ask prefill nodes for a checksum of every UCX piece and verify it (reads
    /// every landed byte once more; for testing a fabric).
    #[arg(long)]
    pub kv_checksum: bool,
    /// Decode: parallel streams (QUIC) or connections (TCP) per transfer.
    #[arg(long, default_value_t = KvSide::DEFAULT_STREAMS)]
    pub kv_streams: usize,
    /// Decode with --kv-transport tcp: the KV listener (default: the QUIC address's host,
    /// a free port).
    #[arg(long)]
    pub kv_listen: Option<SocketAddr>,
    /// Decode: a transfer that makes no progress for this many seconds is abandoned and
    /// the prompt prefilled locally.
    #[arg(long, default_value_t = KvSide::DEFAULT_TIMEOUT.as_secs_f64())]
    pub kv_transfer_timeout: f64,
    /// Registry lease, in seconds: how long a node that vanished stays listed at most.
    #[arg(long, default_value_t = kvmesh_discovery::DEFAULT_TTL_SECS)]
    pub lease_ttl: i64,
    /// Gateway: require `Authorization: Bearer <key>` on /v1 routes (and, on any node, on
    /// /debug routes).
    #[arg(long, env = "KVMESH_API_KEY", value_parser = crate::flags::api_key)]
    pub api_key: Option<String>,
    /// Gateway: how the models write tool calls: hermes, llama3_json or mistral (default:
    /// the format each model's chat template shows; without one, tool_choice "auto" is
    /// refused and "required" or a named function force calls as a JSON array).
    #[arg(long, value_parser = crate::flags::tool_call_parser)]
    pub tool_call_parser: Option<kvmesh_gateway::tools::ToolFormat>,
    /// Serve `POST /debug/crash/{router|worker|prefill|decode}`, which makes that role panic
    /// (to check that it is restarted). Off by default.
    #[arg(long)]
    pub enable_fault_injection: bool,
    /// On SIGTERM: seconds to let running requests finish (a worker stops taking new ones
    /// and routers see it draining at once; a gateway stops accepting connections) before
    /// the node leaves the cluster and exits. Streams still running then move to another
    /// worker.
    #[arg(long, default_value_t = crate::flags::SHUTDOWN_GRACE_S)]
    pub shutdown_grace: f64,
    /// Scale tests: host this many sim workers in this one process, each its own cluster
    /// member (node id `ID.K` for K from 1, its own QUIC endpoint, registry record and
    /// engine) beside the node itself. Worker role and `--backend sim` only. Each sim
    /// engine's KV pool is real memory (about 48 KiB a block for the default model): size
    /// it with `--num-kv-blocks`.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Gateway: keep the model cards fetched from workers in this folder too (as
    /// `cards/<fingerprint>.json`), so that a restarted gateway serves its first request
    /// without fetching them again. Cards are kept in memory either way.
    #[arg(long)]
    pub cache_dir: Option<std::path::PathBuf>,
    /// Publish this fingerprint instead of the node's own (tests: a record that does not
    /// match the certificate must be refused by routers).
    #[arg(long, hide = true)]
    pub debug_advertise_fingerprint: Option<String>,
    /// Give gateways a model card whose chat template was changed after it was made (tests:
    /// a card that does not match its fingerprint must be refused).
    #[arg(long, hide = true)]
    pub debug_tamper_card: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub trace: TraceFlags,
    #[command(flatten)]
    pub http: HttpArgs,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum KvTransportArg {
    Quic,
    Tcp,
    Ucx,
    Auto,
    CudaIpc,
}

/// `--roles`: one role's name; unknown names are refused with the list of known ones.
fn role(s: &str) -> Result<Role, String> {
    s.parse::<Role>().map_err(|e| format!("{e} in --roles"))
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

pub fn default_node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "node".into());
    format!("{host}-{}", std::process::id())
}
