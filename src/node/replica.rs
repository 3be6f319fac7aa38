//! `--replicas`: sim workers hosted beside the node in its process, each a cluster member of
//! its own, for scale tests of routers over hundreds of workers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;

use kvmesh_actors::pace::ReportPace;
use kvmesh_actors::{NodeMsg, NodeRoles, Role, RoleRestarts, Serving, WorkerCore};
use kvmesh_discovery::{EtcdRegistry, NodeRecord, Registration};
use kvmesh_gpu::model::LoadedModel;
use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};

use crate::engines::EngineArgs;

/// One of `--replicas`: a sim worker beside the node in its process, a cluster member of
/// its own (record, lease, QUIC endpoint, engine, supervised roles).
pub struct Replica {
    pub serving: Arc<Serving>,
    endpoint: NodeEndpoint,
    registration: kvmesh_discovery::Registration,
    _supervisor: kvmesh_actors::ActorRef<NodeMsg>,
}

/// What every replica of a node shares: the node's engine flags and interface, model,
/// registry and registration (whose lease its replicas' records share), record, report
/// pace, allow list and engine driver.
pub struct Host<'a> {
    pub engine: &'a EngineArgs,
    /// Replicas listen on the node's interface, each on a port of its own.
    pub listen_ip: std::net::IpAddr,
    pub model: Arc<LoadedModel>,
    pub registry: &'a Arc<EtcdRegistry>,
    pub beside: &'a Registration,
    pub node: &'a NodeRecord,
    pub pace: &'a Arc<ReportPace>,
    pub allowed: &'a AllowList,
    /// The threads that drive every replica's engine.
    pub engines: Arc<kvmesh_gpu::engine::EnginePool>,
}

impl Replica {
    pub async fn start(host: &Host<'_>, node_id: String) -> anyhow::Result<Replica> {
        let (model, registry, beside) = (&host.model, host.registry, host.beside);
        let (node, pace, allowed) = (host.node, host.pace, host.allowed);
        // The engine and key pair are work for a thread, not for the runtime that keeps the
        // node's lease alive.
        let (engine, identity) = tokio::task::spawn_blocking({
            let (engine_args, model, id) = (host.engine.clone(), model.clone(), node_id.clone());
            let engines = host.engines.clone();
            move || -> anyhow::Result<_> {
                Ok((
                    crate::engines::start_engine_on(&engine_args, &model, Some(&engines))?,
                    NodeIdentity::generate(&id)?,
                ))
            }
        })
        .await??;
        // Beside the node: its interface, a port of its own.
        let node_addr: SocketAddr = node.quic_addr.parse()?;
        let bind = SocketAddr::new(host.listen_ip, 0);
        let endpoint = NodeEndpoint::bind(bind, identity.clone(), allowed.clone())?;
        let quic_addr = SocketAddr::new(node_addr.ip(), endpoint.local_addr().port());
        let capacity = node.capacity_tokens_per_s;
        let core = WorkerCore::new(
            node_id.clone(),
            Role::Worker,
            engine.handle.clone(),
            capacity,
            None,
        );
        let serving = Serving::paced(endpoint.clone(), pace.clone());
        serving.set_card(engine.fingerprint.clone(), engine.card.clone());
        let supervisor = kvmesh_actors::supervisor::start(NodeRoles {
            router: None,
            serving: Some(serving.clone()),
            generate: Some(core),
            prefill: None,
            restarts: Arc::new(RoleRestarts::default()),
        })
        .await
        .context("starting the node supervisor")?;
        // Its own record, under the node's lease (they live and die together); the node's
        // HTTP listener answers for the process.
        let record = NodeRecord {
            node_id,
            quic_addr: quic_addr.to_string(),
            http_url: None,
            cert_sha256: identity.fingerprint.clone(),
            started_unix_ms: unix_ms(),
            ..node.clone()
        };
        let registration = registry.register_beside(beside, record).await?;
        Ok(Replica {
            serving,
            endpoint,
            registration,
            _supervisor: supervisor,
        })
    }

    pub async fn leave(self) {
        if let Err(e) = self.registration.deregister().await {
            tracing::warn!("{e}");
        }
        self.endpoint.close();
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
