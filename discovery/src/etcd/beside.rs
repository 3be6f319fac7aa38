//! Records published under another registration's lease.
//!
//! `kvmesh node --replicas N` publishes thousands of workers from one process, which live
//! and die with it. Each is a record of its own, but they share the process's lease and its
//! one keep-alive: a lease each would mean thousands of keep-alives and checks a second,
//! which is what etcd would then spend its time on. When the lease is lost and the node
//! registers again, its records beside it are published again under the new lease.
//!
//! Records started together are created together: etcd spends its time per transaction
//! (a raft proposal and a disk sync each), so a thousand records written one by one keep it
//! busy for seconds on a small machine, and a lease's keep-alive may starve meanwhile. Up to
//! [`BATCH`] records waiting at once go out in one transaction; where that one fails (a
//! record of that id exists), each is created on its own, with the checks and waits a
//! registration of its own gets.
//!
//! Unlike a registration of its own, a record beside another is not restored by its
//! keep-alive if an operator deletes it, and dropping its registration without
//! `deregister` leaves it until the shared lease ends.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::sync::oneshot;
use tracing::warn;

use super::{
    bounded, put, Child, Children, EtcdRegistration, EtcdRegistry, Failure, Shared, Waiting,
};
use crate::error::DiscoveryError;
use crate::record::{node_key, validate_record, NodeRecord};
use crate::registry::{Registered, Registration};

/// A lock no panic elsewhere poisons: what it guards is replaced whole.
trait Locked<T> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Records in one transaction at most (etcd refuses more than `--max-txn-ops`, 128 by
/// default).
const BATCH: usize = 64;

/// How long the first record of a batch waits for others to join it.
const GATHER: std::time::Duration = std::time::Duration::from_millis(5);

impl Shared {
    /// Creates `key` under this registration's lease in a batch with the records waiting
    /// beside it: the lease it went under, or `None` where that did not work (the caller
    /// creates it on its own).
    async fn create_in_batch(self: &Arc<Self>, key: &str, value: &str) -> Option<i64> {
        let (reply, answer) = oneshot::channel();
        let waiting: Waiting = (key.to_owned(), value.to_owned(), reply);
        let first = {
            let mut queue = self.creating.locked();
            let first = queue.is_none();
            queue.get_or_insert_with(Vec::new).push(waiting);
            first
        };
        if first {
            let shared = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(GATHER).await;
                let all = shared.creating.locked().take().unwrap_or_default();
                let lease = shared.lease.load(Ordering::SeqCst);
                let mut all = all.into_iter().peekable();
                while all.peek().is_some() {
                    let batch: Vec<Waiting> = all.by_ref().take(BATCH).collect();
                    let pairs = batch.iter().map(|(k, v, _)| (k.as_str(), v.as_str()));
                    let created = put_all(&shared, pairs, lease, true).await.unwrap_or(false);
                    for (_, _, reply) in batch {
                        let _ = reply.send(created.then_some(lease));
                    }
                }
            });
        }
        answer.await.ok().flatten()
    }
}

/// Puts every record in one transaction under `lease`; with `create`, only if none of them
/// exists (false where one does).
async fn put_all<'a>(
    shared: &Shared,
    records: impl IntoIterator<Item = (&'a str, &'a str)> + Clone,
    lease: i64,
    create: bool,
) -> Result<bool, Failure> {
    let compares: Vec<Compare> = if create {
        records
            .clone()
            .into_iter()
            .map(|(k, _)| Compare::create_revision(k, CompareOp::Equal, 0))
            .collect()
    } else {
        Vec::new()
    };
    let puts: Vec<TxnOp> = records
        .into_iter()
        .map(|(k, v)| TxnOp::put(k, v, Some(PutOptions::new().with_lease(lease))))
        .collect();
    let txn = Txn::new().when(compares).and_then(puts);
    Ok(bounded(shared.client.kv_client().txn(txn))
        .await?
        .succeeded())
}

impl Children {
    fn add(&self, child: &Arc<Child>) {
        let mut list = self.0.locked();
        list.retain(|c| c.strong_count() > 0);
        list.push(Arc::downgrade(child));
    }

    /// Publishes every live record under `lease` (the registration's new one), in a task of
    /// its own so that the registration's keep-alive goes on meanwhile, several at a time.
    /// Stops if the lease is replaced again (its successor republishes).
    pub(super) fn publish_all(&self, shared: &Arc<Shared>, lease: i64) {
        let live: Vec<Arc<Child>> = self.0.locked().iter().filter_map(Weak::upgrade).collect();
        if live.is_empty() {
            return;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            for batch in live.chunks(BATCH) {
                if shared.lease.load(Ordering::SeqCst) != lease {
                    return;
                }
                let values: Vec<(String, String)> = batch
                    .iter()
                    .map(|c| (c.key.clone(), c.value.locked().clone()))
                    .collect();
                let pairs = values.iter().map(|(k, v)| (k.as_str(), v.as_str()));
                if let Err(f) = put_all(&shared, pairs, lease, false).await {
                    warn!(records = batch.len(), first = %batch[0].node_id, error = %f, "could not publish records again under the node's new lease");
                }
            }
        });
    }
}

impl EtcdRegistry {
    /// Publishes `record` under the lease of `beside`, a registration of this registry: it
    /// lives as long as that one, with no keep-alive of its own (see the module's notes).
    pub async fn register_beside(
        &self,
        beside: &Registration,
        record: NodeRecord,
    ) -> Result<Registration, DiscoveryError> {
        validate_record(&record, &self.cluster)?;
        let parent = beside
            .inner()
            .as_any()
            .downcast_ref::<EtcdRegistration>()
            .ok_or_else(|| {
                DiscoveryError::InvalidConfig(format!(
                    "{} is not registered in etcd: nothing to publish {} beside",
                    beside.node_id(),
                    record.node_id
                ))
            })?
            .shared
            .clone();
        let value = serde_json::to_string(&record)?;
        let key = node_key(&self.cluster, &record.node_id);
        // The shared lease may lapse while a busy process starts thousands of records: the
        // node registers again under a new one, and the record follows it.
        let mut lease = parent.lease.load(Ordering::SeqCst);
        let mut tries = 0;
        let batched = parent.create_in_batch(&key, &value).await;
        if let Some(l) = batched {
            lease = l;
        }
        while batched.is_none() {
            match self.create(&key, &record.node_id, &value, lease).await {
                Ok(()) => break,
                Err(e) if e.to_string().contains("lease not found") && tries < 3 => {
                    tries += 1;
                    lease = new_lease(&parent, lease, self.ttl).await;
                }
                Err(e) => return Err(e),
            }
        }
        let child = Arc::new(Child {
            key,
            node_id: record.node_id,
            value: Mutex::new(value),
        });
        parent.children.add(&child);
        // The lease was replaced meanwhile: the new one's republishing may have missed it.
        let now = parent.lease.load(Ordering::SeqCst);
        if now != lease {
            let value = child.value.locked().clone();
            put(&parent.client, &child.key, &value, now)
                .await
                .map_err(|f| parent.etcd_error("put", f))?;
        }
        Ok(Registration::new(Beside { parent, child }))
    }
}

/// Waits (about a lease's time at most) for `parent` to hold another lease than `lost`.
async fn new_lease(parent: &Shared, lost: i64, ttl: i64) -> i64 {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(ttl as u64 + 2);
    loop {
        let now = parent.lease.load(Ordering::SeqCst);
        if now != lost || tokio::time::Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

struct Beside {
    parent: Arc<Shared>,
    child: Arc<Child>,
}

#[async_trait::async_trait]
impl Registered for Beside {
    fn node_id(&self) -> &str {
        &self.child.node_id
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn reregistrations(&self) -> u64 {
        self.parent.reregistrations.load(Ordering::SeqCst)
    }

    async fn update(&self, record: NodeRecord) -> Result<(), DiscoveryError> {
        validate_record(&record, &self.parent.cluster)?;
        if record.node_id != self.child.node_id {
            return Err(DiscoveryError::InvalidRecord(format!(
                "update changes node_id from {} to {}",
                self.child.node_id, record.node_id
            )));
        }
        let value = serde_json::to_string(&record)?;
        *self.child.value.locked() = value.clone();
        let lease = self.parent.lease.load(Ordering::SeqCst);
        put(&self.parent.client, &self.child.key, &value, lease)
            .await
            .map_err(|f| self.parent.etcd_error("put", f))
    }

    async fn deregister(self: Box<Self>) -> Result<(), DiscoveryError> {
        let key = self.child.key.clone();
        drop(self.child);
        bounded(self.parent.client.kv_client().delete(key, None))
            .await
            .map(|_| ())
            .map_err(|f| self.parent.etcd_error("delete", f))
    }
}
