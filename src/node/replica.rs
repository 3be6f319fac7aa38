//! `--replicas`: sim workers hosted beside the node in its process, each a cluster member of
//! its own, for scale tests of routers over hundreds of workers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvmesh_actors::{NodeMsg, NodeRoles, Role, RoleRestarts, Serving, WorkerCore};
use kvmesh_discovery::{EtcdRegistry, NodeRecord, Registry};
use kvmesh_gpu::model::LoadedModel;
use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};

use super::NodeArgs;

/// One of `--replicas`: a sim worker beside the node in its process, a cluster member of
/// its own (record, lease, QUIC endpoint, engine, supervised roles).
pub struct Replica {
    pub serving: Arc<Serving>,
    endpoint: NodeEndpoint,
    registration: kvmesh_discovery::Registration,
    _supervisor: kvmesh_actors::ActorRef<NodeMsg>,
}

impl Replica {
    pub async fn start(
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
            Role::Worker,
            engine.handle.clone(),
            capacity,
            None,
        );
        let serving = Serving::new(endpoint.clone());
        serving.set_card(engine.fingerprint.clone(), engine.card.clone());
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
