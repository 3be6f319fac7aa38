//! The in-process registry used by `kvmesh serve`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::error::DiscoveryError;
use crate::record::{validate_cluster, validate_record, Membership, NodeRecord};
use crate::registry::{Registered, Registration, Registry};

/// An in-process [`Registry`]: no etcd, no TTL. A record is there from `register` until
/// `deregister` or until its [`Registration`] is dropped.
pub struct EmbeddedRegistry {
    inner: Arc<Inner>,
}

struct Inner {
    cluster: String,
    state: Mutex<State>,
    tx: watch::Sender<Membership>,
}

#[derive(Default)]
struct State {
    /// node_id -> (registration token, record).
    nodes: BTreeMap<String, (u64, NodeRecord)>,
    next_token: u64,
}

impl EmbeddedRegistry {
    /// A registry for `cluster`. Panics if the name is empty or contains '/'.
    pub fn new(cluster: &str) -> Arc<Self> {
        if let Err(e) = validate_cluster(cluster) {
            panic!("{e}");
        }
        let (tx, _) = watch::channel(Membership::default());
        Arc::new(Self {
            inner: Arc::new(Inner {
                cluster: cluster.to_string(),
                state: Mutex::new(State::default()),
                tx,
            }),
        })
    }

    /// The cluster name.
    pub fn cluster(&self) -> &str {
        &self.inner.cluster
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, state: &State) {
        let view: BTreeMap<String, NodeRecord> = state
            .nodes
            .iter()
            .map(|(id, (_, r))| (id.clone(), r.clone()))
            .collect();
        self.tx.send_replace(Arc::new(view));
    }
}

#[async_trait::async_trait]
impl Registry for EmbeddedRegistry {
    async fn register(&self, record: NodeRecord) -> Result<Registration, DiscoveryError> {
        validate_record(&record, &self.inner.cluster)?;
        let node_id = record.node_id.clone();
        let token = {
            let mut state = self.inner.lock();
            state.next_token += 1;
            let token = state.next_token;
            state.nodes.insert(node_id.clone(), (token, record));
            self.inner.publish(&state);
            token
        };
        tracing::debug!(node_id, cluster = %self.inner.cluster, "registered node (embedded)");
        Ok(Registration::new(EmbeddedRegistration {
            registry: self.inner.clone(),
            node_id,
            token,
            active: true,
        }))
    }

    async fn list(&self) -> Result<Vec<NodeRecord>, DiscoveryError> {
        Ok(self
            .inner
            .lock()
            .nodes
            .values()
            .map(|(_, r)| r.clone())
            .collect())
    }

    fn subscribe(&self) -> watch::Receiver<Membership> {
        self.inner.tx.subscribe()
    }
}

pub(crate) struct EmbeddedRegistration {
    registry: Arc<Inner>,
    node_id: String,
    token: u64,
    active: bool,
}

#[async_trait::async_trait]
impl Registered for EmbeddedRegistration {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn reregistrations(&self) -> u64 {
        0
    }

    async fn update(&self, record: NodeRecord) -> Result<(), DiscoveryError> {
        validate_record(&record, &self.registry.cluster)?;
        if record.node_id != self.node_id {
            return Err(DiscoveryError::InvalidRecord(format!(
                "update changes node_id from {} to {}",
                self.node_id, record.node_id
            )));
        }
        let mut state = self.registry.lock();
        match state.nodes.get_mut(&self.node_id) {
            Some((token, r)) if *token == self.token => *r = record,
            _ => return Err(DiscoveryError::Superseded(self.node_id.clone())),
        }
        self.registry.publish(&state);
        Ok(())
    }

    async fn deregister(mut self: Box<Self>) -> Result<(), DiscoveryError> {
        self.remove();
        Ok(())
    }
}

impl EmbeddedRegistration {
    fn remove(&mut self) {
        if !std::mem::take(&mut self.active) {
            return;
        }
        let mut state = self.registry.lock();
        // Only remove our own entry, not a newer registration of the same node_id.
        if matches!(state.nodes.get(&self.node_id), Some((t, _)) if *t == self.token) {
            state.nodes.remove(&self.node_id);
            self.registry.publish(&state);
            tracing::debug!(node_id = %self.node_id, "deregistered node (embedded)");
        }
    }
}

impl Drop for EmbeddedRegistration {
    fn drop(&mut self) {
        self.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::test_record;

    #[tokio::test]
    async fn register_subscribe_deregister() {
        let reg = EmbeddedRegistry::new("c");
        let mut rx = reg.subscribe();
        assert!(rx.borrow_and_update().is_empty());

        let a = reg.register(test_record("c", "a")).await.unwrap();
        let _b = reg.register(test_record("c", "b")).await.unwrap();
        assert!(rx.has_changed().unwrap());
        let view = rx.borrow_and_update().clone();
        assert_eq!(view.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(view["a"], test_record("c", "a"));
        assert_eq!(reg.list().await.unwrap().len(), 2);
        assert_eq!(a.reregistrations(), 0);
        assert_eq!(a.node_id(), "a");

        a.deregister().await.unwrap();
        assert_eq!(rx.borrow_and_update().keys().collect::<Vec<_>>(), ["b"]);
    }

    #[tokio::test]
    async fn drop_removes_and_update_publishes() {
        let reg = EmbeddedRegistry::new("c");
        let rx = reg.subscribe();
        let a = reg.register(test_record("c", "a")).await.unwrap();
        let mut r = test_record("c", "a");
        r.capacity_tokens_per_s = 42.0;
        a.update(r.clone()).await.unwrap();
        assert_eq!(rx.borrow()["a"].capacity_tokens_per_s, 42.0);

        let e = a.update(test_record("c", "other")).await.unwrap_err();
        assert!(matches!(e, DiscoveryError::InvalidRecord(_)), "{e}");

        drop(a);
        assert!(rx.borrow().is_empty());
        assert!(reg.list().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn newer_registration_of_same_node_wins() {
        let reg = EmbeddedRegistry::new("c");
        let old = reg.register(test_record("c", "a")).await.unwrap();
        let mut r = test_record("c", "a");
        r.quic_addr = "127.0.0.1:9999".into();
        let new = reg.register(r.clone()).await.unwrap();

        let e = old.update(test_record("c", "a")).await.unwrap_err();
        assert!(matches!(e, DiscoveryError::Superseded(_)), "{e}");
        drop(old); // must not remove the newer record
        assert_eq!(reg.list().await.unwrap(), vec![r]);
        drop(new);
        assert!(reg.list().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn rejects_wrong_cluster() {
        let reg = EmbeddedRegistry::new("c");
        let e = reg.register(test_record("d", "a")).await.unwrap_err();
        assert!(matches!(e, DiscoveryError::InvalidRecord(_)), "{e}");
        assert_eq!(reg.cluster(), "c");
    }

    #[tokio::test]
    async fn works_as_trait_object() {
        let reg: Arc<dyn Registry> = EmbeddedRegistry::new("c");
        let _a = reg.register(test_record("c", "a")).await.unwrap();
        assert_eq!(reg.subscribe().borrow().len(), 1);
    }
}
