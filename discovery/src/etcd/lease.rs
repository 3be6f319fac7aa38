//! How a registration keeps its record in etcd: the lease's keep-alive, publishing again
//! under a new lease when the old one is lost, and restoring a record deleted from under it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// from under it. Runs on the keeper's thread (`keeper`); what to do after each outcome
    /// is [`KeepAlive`]'s to decide.
    pub(super) async fn keep_alive(self: Arc<Self>) {
        let shared = self;
        let mut state = KeepAlive::new(Backoff::new(BACKOFF_MIN, shared.interval.min(BACKOFF_MAX)));
        let mut takeover_reported = false;
        loop {
            let lease = shared.lease.load(Ordering::SeqCst);
            let mut client = shared.client.clone();
            let end = match bounded(client.lease_keep_alive(lease)).await {
                Ok((mut keeper, mut stream)) => {
                    if let Some(after) = state.connected(Instant::now()) {
                        info!(node_id = %shared.node_id, ?after, "etcd is back; keep-alive resumed");
                    }
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
            let reregistered = match end {
                KeepAliveEnd::LeaseLost => Some(shared.reregister(lease).await),
                _ => None,
            };
            match state.ended(&end, reregistered, Instant::now()) {
                Next::Reconnect => {}
                Next::Wait { delay, report } => {
                    if let KeepAliveEnd::Broken(reason) = &end {
                        match report {
                            Report::Lost => warn!(
                                node_id = %shared.node_id,
                                endpoints = %shared.endpoints,
                                %reason,
                                "lost etcd while keeping the node's lease alive; retrying"
                            ),
                            Report::StillLost => {
                                debug!(node_id = %shared.node_id, %reason, "etcd still unavailable")
                            }
                            Report::Nothing => {}
                        }
                    }
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }
}

/// The keep-alive loop's decisions, apart from its I/O and driven by the clock it is given:
/// after each end of a keep-alive stream, whether to reconnect at once or wait (backing off
/// while etcd stays away), what to report, and how long etcd was gone once it is back.
pub(super) struct KeepAlive {
    backoff: Backoff,
    lost_since: Option<Instant>,
}

/// What the loop does next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Open a keep-alive on the (new) lease now.
    Reconnect,
    /// Wait `delay`, then try again; `report` says what to log about the outage.
    Wait { delay: Duration, report: Report },
}

/// What an outage is worth saying.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Report {
    /// Nothing (a re-registration that failed logs for itself).
    Nothing,
    /// etcd was just lost: a warning, once per outage.
    Lost,
    /// Still lost: a debug line.
    StillLost,
}

impl KeepAlive {
    pub(super) fn new(backoff: Backoff) -> KeepAlive {
        KeepAlive {
            backoff,
            lost_since: None,
        }
    }

    /// A keep-alive stream opened at `now`: the backoff starts over, and if etcd had been
    /// lost, how long it was gone.
    pub(super) fn connected(&mut self, now: Instant) -> Option<Duration> {
        self.backoff.reset();
        self.lost_since.take().map(|since| now - since)
    }

    /// A keep-alive stream ended as `end` at `now`; `reregistered` is whether publishing
    /// under a new lease worked, after a lost lease.
    pub(super) fn ended(
        &mut self,
        end: &KeepAliveEnd,
        reregistered: Option<bool>,
        now: Instant,
    ) -> Next {
        match end {
            KeepAliveEnd::LeaseReplaced => Next::Reconnect,
            KeepAliveEnd::LeaseLost if reregistered == Some(true) => Next::Reconnect,
            KeepAliveEnd::LeaseLost => Next::Wait {
                delay: self.backoff.next_delay(),
                report: Report::Nothing,
            },
            KeepAliveEnd::Broken(_) => {
                let report = if self.lost_since.is_none() {
                    self.lost_since = Some(now);
                    Report::Lost
                } else {
                    Report::StillLost
                };
                Next::Wait {
                    delay: self.backoff.next_delay(),
                    report,
                }
            }
        }
    }
}

/// How a keep-alive stream ended.
pub(super) enum KeepAliveEnd {
    /// `update` moved the record to a new lease.
    LeaseReplaced,
    /// etcd says the lease is gone.
    LeaseLost,
    /// The stream broke (etcd down or unreachable).
    Broken(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn machine() -> KeepAlive {
        KeepAlive::new(Backoff::new(ms(100), ms(400)).with_jitter(0.0))
    }

    #[test]
    fn an_outage_is_reported_once_backs_off_and_is_timed_when_etcd_returns() {
        let t0 = Instant::now();
        let mut k = machine();
        let broken = KeepAliveEnd::Broken("down".into());
        assert_eq!(
            k.ended(&broken, None, t0),
            Next::Wait {
                delay: ms(100),
                report: Report::Lost
            }
        );
        let delays: Vec<_> = (1..4)
            .map(|i| match k.ended(&broken, None, t0 + ms(100 * i)) {
                Next::Wait { delay, report } => {
                    assert_eq!(report, Report::StillLost);
                    delay
                }
                n => panic!("{n:?}"),
            })
            .collect();
        assert_eq!(
            delays,
            [ms(200), ms(400), ms(400)],
            "doubling up to the cap"
        );
        // Back after 1.5 s of simulated time: the outage's length, and a fresh backoff.
        assert_eq!(k.connected(t0 + ms(1500)), Some(ms(1500)));
        assert_eq!(k.connected(t0 + ms(1600)), None, "said once");
        assert_eq!(
            k.ended(&broken, None, t0 + ms(2000)),
            Next::Wait {
                delay: ms(100),
                report: Report::Lost
            }
        );
    }

    #[test]
    fn a_lost_lease_reconnects_once_republished_else_backs_off_quietly() {
        let now = Instant::now();
        let mut k = machine();
        assert_eq!(
            k.ended(&KeepAliveEnd::LeaseLost, Some(false), now),
            Next::Wait {
                delay: ms(100),
                report: Report::Nothing
            }
        );
        assert_eq!(
            k.ended(&KeepAliveEnd::LeaseLost, Some(true), now),
            Next::Reconnect
        );
        assert_eq!(
            k.ended(&KeepAliveEnd::LeaseReplaced, None, now),
            Next::Reconnect
        );
        // Neither counts as etcd being lost.
        assert_eq!(k.connected(now), None);
    }
}
