//! What a node publishes about itself, and where: its record under
//! `/kvmesh/<cluster>/nodes/<node_id>`, and the checks every registry makes of it.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::DiscoveryError;
use crate::role::Role;

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
    /// Prefill and decode roles: the KV transports it can move KV over (`quic`, `tcp`,
    /// `ucx`), so a decode worker on `--kv-transport auto` picks one both ends have.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_transports: Vec<String>,
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

    /// Whether the node runs the sim backend, whose tokens are a timing model's and not its
    /// model's (its fingerprint is of its own for that reason).
    pub fn simulated(&self) -> bool {
        self.device.split([' ', ':']).next() == Some("sim")
    }
}

/// The current members, by node_id.
pub type Membership = Arc<BTreeMap<String, NodeRecord>>;

/// The etcd key of a node's record: `/kvmesh/<cluster>/nodes/<node_id>`.
pub fn node_key(cluster: &str, node_id: &str) -> String {
    format!("{}{node_id}", nodes_prefix(cluster))
}

/// The etcd prefix under which a cluster's node records live: `/kvmesh/<cluster>/nodes/`.
pub fn nodes_prefix(cluster: &str) -> String {
    format!("/kvmesh/{cluster}/nodes/")
}

/// Checks what both registries require of a record.
pub(crate) fn validate_record(record: &NodeRecord, cluster: &str) -> Result<(), DiscoveryError> {
    if record.node_id.is_empty() {
        return Err(DiscoveryError::InvalidRecord("node_id is empty".into()));
    }
    if record.node_id.contains('/') {
        return Err(DiscoveryError::InvalidRecord(format!(
            "node_id {:?} contains '/'",
            record.node_id
        )));
    }
    if let Some(why) = record_model_problem(record) {
        return Err(DiscoveryError::InvalidRecord(why));
    }
    if record.cluster != cluster {
        return Err(DiscoveryError::InvalidRecord(format!(
            "node {} says cluster {:?} but the registry is for cluster {:?}",
            record.node_id, record.cluster, cluster
        )));
    }
    Ok(())
}

/// Why `name` cannot name a served model (the `model` of API requests and of node
/// records), or `Ok` when it can: it must not be empty or only whitespace, and must hold no
/// control character (a newline, tab or NUL would split or cut it in logs, metrics labels
/// and the API's replies).
pub fn check_model_name(name: &str) -> Result<(), ModelNameError> {
    if name.is_empty() {
        return Err(ModelNameError::Empty);
    }
    if let Some((at, c)) = name.char_indices().find(|(_, c)| c.is_control()) {
        return Err(ModelNameError::Control { code: c as u32, at });
    }
    if name.trim().is_empty() {
        return Err(ModelNameError::Blank);
    }
    Ok(())
}

/// Why a name cannot name a served model: one variant per rule of [`check_model_name`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelNameError {
    #[error("must not be empty")]
    Empty,
    #[error("contains a control character (U+{code:04X}) at byte {at}")]
    Control { code: u32, at: usize },
    #[error("must not be only whitespace")]
    Blank,
}

/// Why a record's model name cannot be served, naming the node. A node that runs an engine
/// serves its model under that name; a gateway or router started without a model publishes
/// none (empty), which is fine.
pub(crate) fn record_model_problem(record: &NodeRecord) -> Option<String> {
    let engine = record.roles.iter().any(|r| r.runs_engine());
    if record.model.is_empty() && !engine {
        return None;
    }
    check_model_name(&record.model).err().map(|why| {
        format!(
            "node {}: its model name {:?} {why}",
            record.node_id, record.model
        )
    })
}

pub(crate) fn validate_cluster(cluster: &str) -> Result<(), DiscoveryError> {
    if cluster.is_empty() || cluster.contains('/') {
        return Err(DiscoveryError::InvalidConfig(format!(
            "cluster name {cluster:?} must be non-empty and contain no '/'"
        )));
    }
    Ok(())
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
        kv_transports: Vec::new(),
        draining: false,
        model_fingerprint: None,
    }
}
