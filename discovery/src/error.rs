//! What can go wrong with a registry.

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
    /// A directory registry's file could not be written.
    #[error("registry directory {dir}: {op} failed: {reason}")]
    Directory {
        op: &'static str,
        dir: String,
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
