//! Cluster membership for kvmesh.
//!
//! Every node publishes a [`NodeRecord`] (roles, addresses, model, device, capacity, version)
//! under `/kvmesh/<cluster>/nodes/<node_id>` and everyone who needs the membership subscribes to
//! a live view of it. Two implementations of [`Registry`]:
//!
//! * [`EtcdRegistry`]: records are JSON values in etcd attached to a lease (TTL a few seconds)
//!   that a background task keeps alive; after a lease loss (etcd unreachable for longer than the
//!   TTL, the lease revoked, etcd restarted without its data) the record is re-published under a
//!   new lease without restarting anything. Subscribers get a view kept up to date by one watch
//!   per registry that resumes after disconnects.
//! * [`EmbeddedRegistry`]: in-process, for `kvmesh serve` (every role in one process, no etcd).
//!
//! [`testing::Etcd`] starts a throw-away etcd server for tests.

use std::collections::BTreeMap;
use std::sync::Arc;

mod embedded;
mod etcd;
mod role;
pub mod testing;

pub use async_trait::async_trait;
pub use embedded::EmbeddedRegistry;
pub use etcd::EtcdRegistry;
pub use role::Role;

/// The lease TTL, in seconds, that `kvmesh` uses unless told otherwise.
pub const DEFAULT_TTL_SECS: i64 = 3;

/// One node's entry under `/kvmesh/<cluster>/nodes/<node_id>`, JSON in etcd.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeRecord {
    pub node_id: String,
    pub cluster: String,
    /// Any of gateway, router, worker, prefill, decode.
    pub roles: Vec<Role>,
    /// "127.0.0.1:7001".
    pub quic_addr: String,
    /// The gateway's OpenAI base URL, or a worker's status/metrics URL.
    pub http_url: Option<String>,
    pub model: String,
    /// "cpu", "cuda:0", "sim".
    pub device: String,
    /// Declared/estimated capacity; routers weight by it until live reports arrive.
    pub capacity_tokens_per_s: f64,
    pub max_model_len: usize,
    pub block_size: usize,
    /// Hex SHA-256 of the node's QUIC certificate DER.
    pub cert_sha256: String,
    pub version: String,
    pub started_unix_ms: u64,
    /// Prefill and decode roles: the KV cache's layout (model fingerprint, dtype, shapes,
    /// block size), which both ends of a KV transfer must share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// A decode worker taking KV over TCP: its KV listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_tcp_addr: Option<String>,
    /// The node is shutting down: it finishes its requests and takes no new ones.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
    /// The model's fingerprint (config, vocabulary, weights): routers never mix nodes whose
    /// fingerprint differs from their own under one model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_fingerprint: Option<String>,
}

impl NodeRecord {
    /// Whether the record lists `role` among its roles.
    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }
}

/// The current members, by node_id.
pub type Membership = Arc<BTreeMap<String, NodeRecord>>;

/// Where nodes publish themselves and learn about each other.
#[async_trait::async_trait]
pub trait Registry: Send + Sync + 'static {
    /// Publishes the record and keeps it alive until the handle is dropped/deregistered. For etcd: a lease
    /// (TTL from the constructor, default 3 s), keep-alive at TTL/3, and if the lease is lost (expired while
    /// etcd was unreachable, or etcd restarted without it) a new lease and a new put, without restarting anything.
    ///
    /// Dropping the [`Registration`] without [`Registration::deregister`] stops the keep-alive
    /// (like a crash): with etcd the record disappears when the lease expires, with the embedded
    /// registry at once.
    async fn register(&self, record: NodeRecord) -> Result<Registration, DiscoveryError>;

    /// The current nodes, once (for `kvmesh cluster status`), sorted by node_id.
    async fn list(&self) -> Result<Vec<NodeRecord>, DiscoveryError>;

    /// A live view of the membership, kept up to date by a background task (etcd: initial get with
    /// prefix, then a watch from that revision + 1; after a disconnect it reconnects with backoff and resumes
    /// the watch from the last seen revision + 1, falling back to a fresh get if that revision was compacted).
    /// While etcd is unreachable the last known view is kept (not emptied).
    ///
    /// The view stops changing (and `changed()` reports the channel closed) once the registry
    /// itself is dropped, so keep the registry alive as long as the receiver is used.
    fn subscribe(&self) -> tokio::sync::watch::Receiver<Membership>;
}

/// Errors from the registries. The messages name the etcd endpoints or the node concerned.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// A constructor argument is unusable (no endpoints, a TTL below one second, ...).
    #[error("invalid discovery configuration: {0}")]
    InvalidConfig(String),
    /// The record cannot be published as given (empty node_id, wrong cluster, ...).
    #[error("invalid node record: {0}")]
    InvalidRecord(String),
    /// etcd did not answer when connecting.
    #[error("cannot reach etcd at {endpoints}: {reason}")]
    Unreachable { endpoints: String, reason: String },
    /// An etcd request failed or timed out.
    #[error("etcd {op} at {endpoints} failed: {reason}")]
    Etcd {
        op: &'static str,
        endpoints: String,
        reason: String,
    },
    /// The record could not be turned into JSON.
    #[error("cannot encode node record: {0}")]
    Encode(#[from] serde_json::Error),
    /// A live node already holds this node id.
    #[error("node id {node_id} is already taken by a live node ({holder}); give this node another --node-id, or stop that one first")]
    Duplicate { node_id: String, holder: String },
    /// Another registration of the same node_id replaced this one.
    #[error("the registration of node {0} was replaced by a newer registration of the same node")]
    Superseded(String),
}

/// The etcd key of a node's record: `/kvmesh/<cluster>/nodes/<node_id>`.
pub fn node_key(cluster: &str, node_id: &str) -> String {
    format!("{}{node_id}", nodes_prefix(cluster))
}

/// The etcd prefix under which a cluster's node records live: `/kvmesh/<cluster>/nodes/`.
pub fn nodes_prefix(cluster: &str) -> String {
    format!("/kvmesh/{cluster}/nodes/")
}

/// Checks what both registries require of a record.
fn validate_record(record: &NodeRecord, cluster: &str) -> Result<(), DiscoveryError> {
    if record.node_id.is_empty() {
        return Err(DiscoveryError::InvalidRecord("node_id is empty".into()));
    }
    if record.node_id.contains('/') {
        return Err(DiscoveryError::InvalidRecord(format!(
            "node_id {:?} contains '/'",
            record.node_id
        )));
    }
    if record.cluster != cluster {
        return Err(DiscoveryError::InvalidRecord(format!(
            "node {} says cluster {:?} but the registry is for cluster {:?}",
            record.node_id, record.cluster, cluster
        )));
    }
    Ok(())
}

fn validate_cluster(cluster: &str) -> Result<(), DiscoveryError> {
    if cluster.is_empty() || cluster.contains('/') {
        return Err(DiscoveryError::InvalidConfig(format!(
            "cluster name {cluster:?} must be non-empty and contain no '/'"
        )));
    }
    Ok(())
}

/// A published record; keeps it alive until dropped or [`deregister`](Registration::deregister)ed.
pub struct Registration {
    inner: RegistrationInner,
}

enum RegistrationInner {
    Etcd(etcd::EtcdRegistration),
    Embedded(embedded::EmbeddedRegistration),
}

impl Registration {
    /// Removes the record now (etcd: revokes the lease) and stops keep-alive. Used on SIGTERM.
    ///
    /// If etcd cannot be reached the keep-alive still stops, so the record expires after the TTL,
    /// and the error says so.
    pub async fn deregister(self) -> Result<(), DiscoveryError> {
        match self.inner {
            RegistrationInner::Etcd(r) => r.deregister().await,
            RegistrationInner::Embedded(r) => {
                r.deregister();
                Ok(())
            }
        }
    }

    /// Updates the published record (e.g. capacity) under the same lease.
    ///
    /// The node_id must stay the same. If etcd cannot be reached the error is returned, and the
    /// new record is still published by the keep-alive task once etcd is back.
    pub async fn update(&self, record: NodeRecord) -> Result<(), DiscoveryError> {
        match &self.inner {
            RegistrationInner::Etcd(r) => r.update(record).await,
            RegistrationInner::Embedded(r) => r.update(record),
        }
    }

    /// How many times the record was re-registered after a lease loss (for metrics/tests).
    pub fn reregistrations(&self) -> u64 {
        match &self.inner {
            RegistrationInner::Etcd(r) => r.reregistrations(),
            RegistrationInner::Embedded(_) => 0,
        }
    }

    /// The node_id this registration publishes.
    pub fn node_id(&self) -> &str {
        match &self.inner {
            RegistrationInner::Etcd(r) => r.node_id(),
            RegistrationInner::Embedded(r) => r.node_id(),
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("node_id", &self.node_id())
            .field("reregistrations", &self.reregistrations())
            .finish()
    }
}

#[cfg(test)]
pub(crate) fn test_record(cluster: &str, node_id: &str) -> NodeRecord {
    NodeRecord {
        node_id: node_id.to_string(),
        cluster: cluster.to_string(),
        roles: vec![Role::Worker],
        quic_addr: "127.0.0.1:7001".into(),
        http_url: Some("http://127.0.0.1:8001".into()),
        model: "tiny".into(),
        device: "sim".into(),
        capacity_tokens_per_s: 1000.0,
        max_model_len: 2048,
        block_size: 16,
        cert_sha256: "00".repeat(32),
        version: "0.1.0".into(),
        started_unix_ms: 1,
        kv_layout: None,
        kv_tcp_addr: None,
        draining: false,
        model_fingerprint: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_send_and_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Registration>();
        check::<EtcdRegistry>();
        check::<EmbeddedRegistry>();
        check::<DiscoveryError>();
        check::<std::sync::Arc<dyn Registry>>();
        fn send<T: Send>() {}
        send::<testing::Etcd>();
    }

    #[test]
    fn keys() {
        assert_eq!(node_key("c1", "n1"), "/kvmesh/c1/nodes/n1");
        assert!(node_key("c1", "n1").starts_with(&nodes_prefix("c1")));
    }

    #[test]
    fn record_json_round_trip() {
        let r = test_record("c", "n");
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<NodeRecord>(&json).unwrap(), r);
        assert!(r.has_role(Role::Worker) && !r.has_role(Role::Gateway));
    }

    #[test]
    fn validation() {
        assert!(validate_record(&test_record("c", "n"), "c").is_ok());
        assert!(validate_record(&test_record("c", ""), "c").is_err());
        assert!(validate_record(&test_record("c", "a/b"), "c").is_err());
        let e = validate_record(&test_record("other", "n"), "c").unwrap_err();
        assert!(e.to_string().contains("other"), "{e}");
        assert!(validate_cluster("").is_err() && validate_cluster("a/b").is_err());
    }
}
