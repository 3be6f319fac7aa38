//! How a registration keeps its record in etcd: the lease's keep-alive, publishing again
//! under a new lease when the old one is lost, and restoring a record deleted from under it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, info, warn};

use super::{
    bounded, grant, put, put_if_absent, Shared, BACKOFF_MAX, BACKOFF_MIN, REQUEST_TIMEOUT,
};
use crate::Backoff;

impl Shared {
    /// Publishes the record under a new lease after `lost` was lost. Returns false if etcd
    /// could not be reached (the caller retries).
    pub(super) async fn reregister(self: &Arc<Self>, lost: i64) -> bool {
        let mut published = self.published.lock().await;
        if published.lease != lost {
            return true; // somebody else already did
        }
        let lease = match grant(&self.client, self.ttl).await {
            Ok((lease, _)) => lease,
            Err(f) => {
                warn!(node_id = %self.node_id, endpoints = %self.endpoints, error = %f, "lease lost and cannot grant a new one yet; retrying");
                return false;
            }
        };
        match put_if_absent(&self.client, &self.key, &published.value, lease).await {
            Ok(true) => {}
            Ok(false) => {
                let _ = bounded(self.client.lease_client().revoke(lease)).await;
                warn!(node_id = %self.node_id, key = %self.key, "lease lost, and meanwhile another node registered under this node id; not overwriting it (retrying)");
                return false;
            }
            Err(f) => {
                let _ = bounded(self.client.lease_client().revoke(lease)).await;
                warn!(node_id = %self.node_id, endpoints = %self.endpoints, error = %f, "lease lost and cannot re-publish the record yet; retrying");
                return false;
            }
        }
        published.lease = lease;
        published.dirty = false;
        self.lease.store(lease, Ordering::SeqCst);
        self.children.publish_all(self, lease);
        let n = self.reregistrations.fetch_add(1, Ordering::SeqCst) + 1;
        info!(
            node_id = %self.node_id,
            key = %self.key,
            old_lease = format_args!("{lost:x}"),
            new_lease = format_args!("{lease:x}"),
            reregistrations = n,
            "etcd lease was lost; re-registered the node under a new lease"
        );
        true
    }

    /// Puts the record back if its key was deleted while the lease lives (an operator's
    /// `etcdctl del`, say): otherwise the node would run on, out of every router's view, with
    /// nothing in its log. A key held under another lease is another registration of this
    /// node id, which is left alone and reported.
    async fn restore_if_deleted(&self, takeover_reported: &mut bool) {
        let Ok(published) = self.published.try_lock() else {
            return;
        };
        let Ok(resp) = bounded(self.client.kv_client().get(self.key.as_str(), None)).await else {
            return;
        };
        match resp.kvs().first() {
            None => {
                match put_if_absent(&self.client, &self.key, &published.value, published.lease)
                    .await
                {
                    Ok(true) => warn!(
                        node_id = %self.node_id,
                        key = %self.key,
                        "the node's record was deleted from etcd while the node runs; published it again"
                    ),
                    Ok(false) => {}
                    Err(f) => {
                        debug!(node_id = %self.node_id, error = %f, "cannot restore the deleted record yet")
                    }
                }
            }
            Some(kv) if kv.lease() != published.lease => {
                if !*takeover_reported {
                    tracing::error!(
                        node_id = %self.node_id,
                        key = %self.key,
                        "another process registered under this node's id and replaced its record; this node is out of routing until that one leaves"
                    );
                    *takeover_reported = true;
                }
            }
            Some(_) => *takeover_reported = false,
        }
    }

    /// Publishes an update that could not reach etcd earlier. Skips if someone is publishing.
    async fn flush_if_dirty(&self) {
        let Ok(mut published) = self.published.try_lock() else {
            return;
        };
        if !published.dirty {
            return;
        }
        match put(&self.client, &self.key, &published.value, published.lease).await {
            Ok(()) => {
                published.dirty = false;
                info!(node_id = %self.node_id, "published the node record updated while etcd was unreachable");
            }
            Err(f) => {
                debug!(node_id = %self.node_id, error = %f, "still cannot publish the updated record")
            }
        }
    }

    /// Keeps the lease alive (a keep-alive a third of its TTL apart), publishes the record
    /// again under a new lease when etcd lost the old one, and puts back a record deleted
    /// from under it. Runs on the keeper's thread (`keeper`).
    pub(super) async fn keep_alive(self: Arc<Self>) {
        let shared = self;
        let mut backoff = Backoff::new(BACKOFF_MIN, shared.interval.min(BACKOFF_MAX));
        let mut lost_since: Option<Instant> = None;
        let mut takeover_reported = false;
        loop {
            let lease = shared.lease.load(Ordering::SeqCst);
            let mut client = shared.client.clone();
            let end = match bounded(client.lease_keep_alive(lease)).await {
                Ok((mut keeper, mut stream)) => {
                    if let Some(since) = lost_since.take() {
                        info!(node_id = %shared.node_id, after = ?since.elapsed(), "etcd is back; keep-alive resumed");
                    }
                    backoff.reset();
                    shared.flush_if_dirty().await;
                    loop {
                        tokio::select! {
                            _ = tokio::time::sleep(shared.interval) => {}
                            _ = shared.lease_replaced.notified() => {}
                        }
                        if shared.lease.load(Ordering::SeqCst) != lease {
                            break KeepAliveEnd::LeaseReplaced;
                        }
                        shared.flush_if_dirty().await;
                        if let Err(e) = keeper.keep_alive().await {
                            break KeepAliveEnd::Broken(e.to_string());
                        }
                        match tokio::time::timeout(REQUEST_TIMEOUT, stream.message()).await {
                            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                                shared.restore_if_deleted(&mut takeover_reported).await;
                            }
                            Ok(Ok(Some(_))) => break KeepAliveEnd::LeaseLost,
                            Ok(Ok(None)) => {
                                break KeepAliveEnd::Broken("the keep-alive stream ended".into())
                            }
                            Ok(Err(e)) => break KeepAliveEnd::Broken(e.to_string()),
                            Err(_) => {
                                break KeepAliveEnd::Broken(format!(
                                    "no keep-alive answer within {} s",
                                    REQUEST_TIMEOUT.as_secs()
                                ))
                            }
                        }
                    }
                }
                Err(f) if f.is_lease_not_found() => KeepAliveEnd::LeaseLost,
                Err(f) => KeepAliveEnd::Broken(f.to_string()),
            };
            match end {
                KeepAliveEnd::LeaseReplaced => {}
                KeepAliveEnd::LeaseLost => {
                    if !shared.reregister(lease).await {
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
                KeepAliveEnd::Broken(reason) => {
                    if lost_since.is_none() {
                        warn!(
                            node_id = %shared.node_id,
                            endpoints = %shared.endpoints,
                            %reason,
                            "lost etcd while keeping the node's lease alive; retrying"
                        );
                        lost_since = Some(Instant::now());
                    } else {
                        debug!(node_id = %shared.node_id, %reason, "etcd still unavailable");
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }
}

/// How a keep-alive stream ended.
enum KeepAliveEnd {
    /// `update` moved the record to a new lease.
    LeaseReplaced,
    /// etcd says the lease is gone.
    LeaseLost,
    /// The stream broke (etcd down or unreachable).
    Broken(String),
}
