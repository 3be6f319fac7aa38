//! What `kvmesh node`'s flags decide, checked once before anything starts: one plan with a
//! part for each thing the node starts (its engines, its network, the KV transfers of the
//! prefill and decode roles, the router, the gateway). `start` reads the plan top to
//! bottom and never looks at a flag again; every refusal and every default is here, where
//! unit tests reach it without starting a process.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure};

use kvmesh_actors::policy::PrefixTuning;
use kvmesh_actors::router::{DisaggConfig, RouterConfig};
use kvmesh_actors::{Policy, Role};
use kvmesh_gateway::http::HttpLimits;
use kvmesh_gateway::tools::ToolFormat;

use super::args::{default_node_id, KvTransportArg, NodeArgs};
use crate::engines::{BackendArg, EngineArgs};
use crate::flags::TraceFlags;
use kvmesh_gpu::backend::sm_split::SmSplit;

/// A node's start, every flag checked.
#[derive(Debug)]
pub struct NodePlan {
    pub node_id: String,
    pub roles: Vec<Role>,
    pub trace: TraceFlags,
    pub engines: EnginePlan,
    pub network: NetworkPlan,
    /// The prefill and decode roles: how their KV moves. None for other nodes.
    pub kv: Option<KvPlan>,
    pub router: Option<RouterPlan>,
    pub gateway: Option<GatewayPlan>,
    /// Bearer key of the /v1 routes (gateway) and of /debug routes (any node).
    pub api_key: Option<String>,
    /// How long running requests may finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// `POST /debug/crash/{role}` is served.
    pub fault_injection: bool,
    pub debug: DebugPlan,
}

/// The engines a node runs, or, for a gateway/router node, the model it may be pinned to.
#[derive(Debug)]
pub struct EnginePlan {
    /// The engine that generates: `Worker` (prefills its own prompts) or `Decode`.
    pub generate: Option<Role>,
    /// A prefill engine (beside a decode engine when the node has both roles).
    pub prefill: bool,
    /// The engines' flags; two engines on one device have half its memory share each.
    pub args: EngineArgs,
    /// `--capacity`: a worker's declared tokens/s per sequence, until measured.
    pub capacity: Option<f64>,
    /// Sim workers hosted beside the node (`--replicas` less the node itself).
    pub extra_replicas: usize,
    /// `--sm-split`: the prefill and decode engines each on their share of the GPU's SMs.
    pub sm_split: Option<SmSplit>,
}

/// Where the node listens, and where it joins its cluster.
#[derive(Debug)]
pub struct NetworkPlan {
    /// etcd's endpoints; empty with `--no-etcd` (the cluster is this process) or
    /// `--registry-dir`.
    pub etcd: Vec<String>,
    /// `--registry-dir`: the cluster's records are files there (processes of one machine).
    pub registry_dir: Option<std::path::PathBuf>,
    pub cluster: String,
    pub lease_ttl: i64,
    pub listen: SocketAddr,
    /// The address other nodes dial, when it is not the bound one.
    pub advertise: Option<SocketAddr>,
    /// The gateway's HTTP address, or the status listener's of a node without one.
    pub http_bind: String,
    pub http_limits: HttpLimits,
}

/// How KV moves between the prefill and decode roles.
#[derive(Debug)]
pub struct KvPlan {
    /// UCX, when the transport asks for it.
    pub ucx: Option<UcxPlan>,
    /// `--kv-transport cuda-ipc` on a decode node: its engine's KV cache is exportable,
    /// and prefill nodes of this host on GPUs copy into it (QUIC from the others).
    pub cuda_ipc: bool,
    /// A decode node taking KV over TCP binds a listener: at `Some(addr)` (`--kv-listen`),
    /// or with None on the QUIC address's host, a free port.
    pub tcp_listener: Option<Option<SocketAddr>>,
    /// Parallel streams (QUIC), connections (TCP) or lanes (UCX) per transfer.
    pub streams: usize,
    /// Every UCX piece checksummed and verified.
    pub checksum: bool,
    /// A transfer without progress this long is abandoned and prefilled locally.
    pub transfer_timeout: Duration,
}

#[derive(Debug, PartialEq)]
pub struct UcxPlan {
    /// `--kv-transport ucx`: the start fails without UCX; `auto`: it goes on over TCP.
    pub required: bool,
    /// `--ucx-tls`.
    pub tls: Option<String>,
}

#[derive(Debug)]
pub struct RouterPlan {
    pub policy: Policy,
    pub config: RouterConfig,
}

#[derive(Debug)]
pub struct GatewayPlan {
    pub tool_call_parser: Option<ToolFormat>,
    /// Where fetched model cards are kept between restarts.
    pub cache_dir: Option<PathBuf>,
}

/// Hidden flags of tests that check what peers refuse.
#[derive(Debug, Default)]
pub struct DebugPlan {
    pub advertise_fingerprint: Option<String>,
    pub tamper_card: bool,
}

impl NodePlan {
    /// Checks the flags together and splits them into the plan's parts; refuses flags that
    /// cannot work together, naming them, before anything is loaded, bound or joined.
    pub fn from_args(args: NodeArgs) -> anyhow::Result<NodePlan> {
        check_roles(&args.roles)?;
        ensure!(
            args.lease_ttl >= 2,
            "--lease-ttl must be at least 2 seconds"
        );
        ensure!(
            args.kv_transfer_timeout > 0.0 && args.kv_transfer_timeout.is_finite(),
            "--kv-transfer-timeout must be positive"
        );
        ensure!(
            (1..=16).contains(&args.kv_streams),
            "--kv-streams must be between 1 and 16"
        );
        ensure!(
            args.shutdown_grace.is_finite(),
            "--shutdown-grace must be a number of seconds"
        );
        let engines = EnginePlan::of(&args)?;
        let network = NetworkPlan::of(&args)?;
        let has = |r| args.roles.contains(&r);
        let kv = (has(Role::Prefill) || has(Role::Decode)).then_some(KvPlan::of(&args));
        let router = has(Role::Router).then_some(RouterPlan {
            policy: args.policy,
            config: RouterConfig {
                disagg: DisaggConfig {
                    min_tokens: args.disagg_min_tokens,
                    max_queue: args.disagg_max_queue,
                },
                migration_limit: args.migration_limit,
                prefix: PrefixTuning {
                    max_imbalance: args.prefix_max_imbalance,
                },
            },
        });
        let gateway = has(Role::Gateway).then(|| GatewayPlan {
            tool_call_parser: args.tool_call_parser,
            cache_dir: args.cache_dir.clone(),
        });
        Ok(NodePlan {
            node_id: args.node_id.clone().unwrap_or_else(default_node_id),
            roles: args.roles,
            trace: args.trace,
            engines,
            network,
            kv,
            router,
            gateway,
            api_key: args.api_key,
            // Negative means none, as a timeout of 0 does.
            shutdown_grace: Duration::from_secs_f64(args.shutdown_grace.max(0.0)),
            fault_injection: args.enable_fault_injection,
            debug: DebugPlan {
                advertise_fingerprint: args.debug_advertise_fingerprint,
                tamper_card: args.debug_tamper_card,
            },
        })
    }

    /// The roles as `--roles` spells them.
    pub fn roles_joined(&self) -> String {
        roles_joined(&self.roles)
    }
}

fn roles_joined(roles: &[Role]) -> String {
    roles
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// Roles that cannot go together in one node.
fn check_roles(roles: &[Role]) -> anyhow::Result<()> {
    let has = |r| roles.contains(&r);
    if has(Role::Gateway) && !has(Role::Router) {
        bail!("the gateway role sends requests to a router in the same node: use --roles gateway,router");
    }
    if has(Role::Worker) && (has(Role::Prefill) || has(Role::Decode)) {
        bail!(
            "a worker prefills and decodes its own requests: use --roles worker, or \
             --roles prefill,decode for the two roles on separate engines"
        );
    }
    Ok(())
}

impl EnginePlan {
    fn of(args: &NodeArgs) -> anyhow::Result<EnginePlan> {
        let has = |r| args.roles.contains(&r);
        let generate = if has(Role::Decode) {
            Some(Role::Decode)
        } else {
            has(Role::Worker).then_some(Role::Worker)
        };
        let prefill = has(Role::Prefill);
        let mut engine = args.engine.clone();
        if generate.is_some() || prefill {
            // The limits an engine refuses, refused before the model is read.
            engine.engine_config()?;
        }
        if generate.is_some() || prefill || engine.model.is_some() {
            engine.check_served_model_name()?;
        }
        // Two engines on one device split its memory share between them.
        if generate.is_some() && prefill {
            engine.gpu_memory_utilization /= 2.0;
        }
        if let Some(split) = args.sm_split {
            // Both engines here, or one of them, the other side's in another process of
            // this host (with --kv-transport cuda-ipc between them).
            ensure!(
                generate != Some(Role::Worker) && (generate.is_some() || prefill),
                "--sm-split {split} shares one GPU between a prefill and a decode engine: it \
                 needs --roles with prefill, decode or both (an engine per side; a side's \
                 engine may be another process's), not {}",
                roles_joined(&args.roles)
            );
            ensure!(
                !matches!(args.engine.backend, BackendArg::Sim),
                "--sm-split {split} splits a GPU's SMs, and --backend sim runs no GPU"
            );
        }
        ensure!(args.replicas >= 1, "--replicas must be at least 1");
        if args.replicas > 1 {
            ensure!(
                args.roles == [Role::Worker],
                "--replicas hosts extra workers: it needs --roles worker alone, not {}",
                roles_joined(&args.roles)
            );
            ensure!(
                matches!(args.engine.backend, BackendArg::Sim),
                "--replicas is for scale tests on --backend sim (real engines in one process \
                 would share its compute and memory)"
            );
            ensure!(
                args.debug_advertise_fingerprint.is_none(),
                "--replicas and --debug-advertise-fingerprint do not go together"
            );
        }
        Ok(EnginePlan {
            generate,
            prefill,
            args: engine,
            capacity: args.capacity,
            extra_replicas: args.replicas - 1,
            sm_split: args.sm_split,
        })
    }

    /// Whether the node runs an engine of its own.
    pub fn runs_engine(&self) -> bool {
        self.generate.is_some() || self.prefill
    }

    /// What a worker declares before it has measured itself: one sequence's tokens/s on
    /// `device`.
    pub fn declared_capacity(&self, device: &str) -> f64 {
        if let Some(c) = self.capacity {
            return c;
        }
        let e = &self.args;
        match e.backend {
            BackendArg::Sim => {
                let step_s = (e.sim_decode_ms / 1e3 + e.sim_decode_us_per_seq / 1e6).max(1e-6);
                e.sim_speed / step_s
            }
            BackendArg::Cpu if device.starts_with("cuda") => 100.0,
            BackendArg::Cpu => 20.0,
        }
    }
}

impl NetworkPlan {
    fn of(args: &NodeArgs) -> anyhow::Result<NetworkPlan> {
        if args.no_etcd {
            let has = |r| args.roles.contains(&r);
            ensure!(
                has(Role::Router) && (has(Role::Worker) || has(Role::Decode)),
                "--no-etcd makes this node the whole cluster, so it needs a router and a worker \
                 (or decode) role of its own, not --roles {}; nodes on several machines find \
                 each other through --etcd",
                roles_joined(&args.roles)
            );
        }
        if args.listen.ip().is_unspecified() && args.advertise_addr.is_none() {
            bail!(
                "--listen {} is on every interface: say which address other nodes dial with \
                 --advertise-addr HOST:PORT",
                args.listen
            );
        }
        let http_bind = if args.roles.contains(&Role::Gateway) {
            format!("{}:{}", args.host, args.port)
        } else {
            // The status listener is on the QUIC listener's interface (IPv4's every
            // interface for either family's).
            let ip = match args.listen.ip() {
                ip if ip.is_unspecified() => Ipv4Addr::UNSPECIFIED.into(),
                ip => ip,
            };
            SocketAddr::new(ip, args.status_port).to_string()
        };
        Ok(NetworkPlan {
            etcd: args.etcd.clone(),
            registry_dir: args.registry_dir.clone(),
            cluster: args.cluster.clone(),
            lease_ttl: args.lease_ttl,
            listen: args.listen,
            advertise: args.advertise_addr,
            http_bind,
            http_limits: args.http.limits(),
        })
    }
}

impl KvPlan {
    fn of(args: &NodeArgs) -> KvPlan {
        let decode = args.roles.contains(&Role::Decode);
        let ucx = match args.kv_transport {
            KvTransportArg::Ucx | KvTransportArg::Auto => Some(UcxPlan {
                required: matches!(args.kv_transport, KvTransportArg::Ucx),
                tls: args.ucx_tls.clone(),
            }),
            KvTransportArg::Quic | KvTransportArg::Tcp | KvTransportArg::CudaIpc => None,
        };
        let tcp_listener = match args.kv_transport {
            KvTransportArg::Tcp | KvTransportArg::Auto if decode => Some(args.kv_listen),
            _ => None,
        };
        KvPlan {
            ucx,
            cuda_ipc: decode && matches!(args.kv_transport, KvTransportArg::CudaIpc),
            tcp_listener,
            streams: args.kv_streams,
            checksum: args.kv_checksum,
            transfer_timeout: Duration::from_secs_f64(args.kv_transfer_timeout),
        }
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
