//! The registry as nodes use it: publish a record and keep it alive, list the members,
//! follow them.

use crate::error::DiscoveryError;
use crate::record::{Membership, NodeRecord};

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

/// A published record; keeps it alive until dropped or [`deregister`](Registration::deregister)ed.
pub struct Registration {
    inner: Box<dyn Registered>,
}

/// What a registry's own registration does for [`Registration`].
#[async_trait::async_trait]
pub(crate) trait Registered: Send + Sync {
    async fn deregister(self: Box<Self>) -> Result<(), DiscoveryError>;
    async fn update(&self, record: NodeRecord) -> Result<(), DiscoveryError>;
    fn reregistrations(&self) -> u64;
    fn node_id(&self) -> &str;
    /// The registration itself, for a registry that builds on its own registrations.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl Registration {
    pub(crate) fn new(inner: impl Registered + 'static) -> Registration {
        Registration {
            inner: Box::new(inner),
        }
    }

    /// Removes the record now (etcd: revokes the lease) and stops keep-alive. Used on SIGTERM.
    ///
    /// If etcd cannot be reached the keep-alive still stops, so the record expires after the TTL,
    /// and the error says so.
    pub async fn deregister(self) -> Result<(), DiscoveryError> {
        self.inner.deregister().await
    }

    /// Updates the published record (e.g. capacity) under the same lease.
    ///
    /// The node_id must stay the same. If etcd cannot be reached the error is returned, and the
    /// new record is still published by the keep-alive task once etcd is back.
    pub async fn update(&self, record: NodeRecord) -> Result<(), DiscoveryError> {
        self.inner.update(record).await
    }

    /// How many times the record was re-registered after a lease loss (for metrics/tests).
    pub fn reregistrations(&self) -> u64 {
        self.inner.reregistrations()
    }

    pub(crate) fn inner(&self) -> &dyn Registered {
        self.inner.as_ref()
    }

    /// The node_id this registration publishes.
    pub fn node_id(&self) -> &str {
        self.inner.node_id()
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
