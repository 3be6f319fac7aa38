//! A router's pools: one [`RouterCore`] per served model, each routing among the workers
//! that serve that model under its name with one fingerprint. A request's `model` picks the
//! pool; policies, the prefix index, disaggregation and migration all work inside it, so
//! picking costs the same however many models the mesh serves.
//!
//! Which fingerprint a name stands for: the one a gateway was started with (`--model`),
//! else the one its pool already routes to while any worker of it is left, else that of the
//! earliest-started worker of the name. Workers of another fingerprint under that name are
//! refused, each with the reason, in their pool's `refused`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_discovery::{Membership, NodeRecord};
use kvmesh_transport::wire::{self, CardReply, StreamRequest};
use kvmesh_transport::{NodeEndpoint, TransportError};
use parking_lot::{Mutex, RwLock};

use super::config::RouterConfig;
use super::{RouterCore, WorkerLink};
use crate::policy::Policy;

/// A model a node serves itself, or a gateway was started with: its name always means this
/// fingerprint.
#[derive(Clone, Debug)]
pub struct Pinned {
    pub name: String,
    pub fingerprint: String,
}

pub struct Pools {
    node_id: String,
    policy: Policy,
    config: RouterConfig,
    endpoint: NodeEndpoint,
    pinned: Option<Pinned>,
    pools: RwLock<BTreeMap<String, Arc<RouterCore>>>,
    /// Pools with no worker and no member of their name, since when: forgotten after
    /// [`POOL_GRACE`].
    emptied: Mutex<BTreeMap<String, Instant>>,
}

/// How long a pool whose last worker left is kept: a request that lost its worker waits this
/// long for a replacement ([`super::UNSTARTED_PATIENCE`]), and a replacement of the same
/// model joins the same pool. Requests for the model meanwhile get 503; after it, the model
/// is unknown (404).
pub const POOL_GRACE: Duration = super::UNSTARTED_PATIENCE;

impl Pools {
    pub fn new(
        node_id: String,
        pinned: Option<Pinned>,
        policy: Policy,
        config: RouterConfig,
        endpoint: NodeEndpoint,
    ) -> Arc<Pools> {
        let pools = Arc::new(Pools {
            node_id,
            policy,
            config,
            endpoint,
            pinned: pinned.clone(),
            pools: RwLock::new(BTreeMap::new()),
            emptied: Mutex::new(BTreeMap::new()),
        });
        if let Some(p) = pinned {
            pools.pools.write().insert(p.name.clone(), pools.core(&p));
        }
        pools
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    fn core(&self, model: &Pinned) -> Arc<RouterCore> {
        RouterCore::new(
            self.node_id.clone(),
            model.name.clone(),
            model.fingerprint.clone(),
            self.policy,
            self.config,
            self.endpoint.clone(),
        )
    }

    /// The pool serving `name`, if the mesh has one.
    pub fn get(&self, name: &str) -> Option<Arc<RouterCore>> {
        self.pools.read().get(name).cloned()
    }

    /// Every pool, by model name.
    pub fn all(&self) -> Vec<Arc<RouterCore>> {
        self.pools.read().values().cloned().collect()
    }

    /// The model a gateway was started with, if any.
    pub fn pinned(&self) -> Option<&Pinned> {
        self.pinned.as_ref()
    }

    /// Brings every pool in line with the registry: a pool for each model name some worker
    /// serves, each pool's workers updated, and a pool left with no worker and no member of
    /// its name forgotten (the pinned one is kept).
    pub fn apply_membership(&self, members: &Membership) {
        let mut by_name: BTreeMap<&str, Vec<&NodeRecord>> = BTreeMap::new();
        for r in members.values() {
            if r.roles.iter().any(|role| role.runs_engine()) {
                by_name.entry(r.model.as_str()).or_default().push(r);
            }
        }
        let mut pools = self.pools.write();
        for (name, records) in &by_name {
            let current = pools.get(*name);
            let keep = current.is_some_and(|core| {
                // A pool keeps its fingerprint while it has workers or members of it.
                !core.workers().is_empty()
                    || records
                        .iter()
                        .any(|r| r.model_fingerprint.as_deref() == Some(&core.model_fingerprint))
                    || self.pinned.as_ref().is_some_and(|p| p.name == *name)
            });
            if keep {
                continue;
            }
            // The earliest-started worker of the name says which model it is.
            let Some(first) = records
                .iter()
                .filter(|r| r.model_fingerprint.is_some())
                .min_by_key(|r| (r.started_unix_ms, r.node_id.as_str()))
            else {
                continue;
            };
            let model = Pinned {
                name: name.to_string(),
                fingerprint: first.model_fingerprint.clone().unwrap_or_default(),
            };
            tracing::info!(
                "model '{}' (fingerprint {}) joined the mesh with worker {}",
                model.name,
                model.fingerprint,
                first.node_id
            );
            pools.insert(model.name.clone(), self.core(&model));
        }
        let all: Vec<Arc<RouterCore>> = pools.values().cloned().collect();
        drop(pools);
        for core in &all {
            core.apply_membership(members);
        }
        let mut pools = self.pools.write();
        let mut emptied = self.emptied.lock();
        let now = Instant::now();
        pools.retain(|name, core| {
            let empty = !by_name.contains_key(name.as_str())
                && core.workers().is_empty()
                && self.pinned.as_ref().is_none_or(|p| &p.name != name);
            if !empty {
                emptied.remove(name);
                return true;
            }
            let since = *emptied.entry(name.clone()).or_insert_with(|| {
                tracing::info!(
                    "model '{name}': its last worker left; forgotten in {} s unless one joins",
                    POOL_GRACE.as_secs()
                );
                now
            });
            if now.duration_since(since) < POOL_GRACE {
                return true;
            }
            emptied.remove(name);
            tracing::info!("model '{name}' left the mesh: no worker serves it");
            false
        });
    }
}

/// Fetches the model card of the model of `fingerprint` from the worker of `link`, as the
/// JSON bytes it sent, waiting at most `within` for it (a worker that takes the stream and
/// never answers is given up on, named).
pub async fn fetch_card_from(
    link: &WorkerLink,
    fingerprint: &str,
    within: Duration,
) -> Result<Vec<u8>, CardFetchError> {
    let node = link.record.node_id.clone();
    let Some(conn) = link.connection() else {
        return Err(CardFetchError::NotConnected { node });
    };
    let got = async {
        let stream = |source| CardFetchError::Stream {
            node: node.clone(),
            source,
        };
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| stream(TransportError::from(e)))?;
        let ask = StreamRequest::Card {
            fingerprint: fingerprint.to_string(),
        };
        wire::write_msg(&mut send, &ask).await.map_err(stream)?;
        let _ = send.finish();
        match wire::read_msg::<CardReply>(&mut recv)
            .await
            .map_err(stream)?
        {
            Some(CardReply::Card(bytes)) => Ok(bytes),
            Some(CardReply::Refused { message }) => Err(CardFetchError::Refused {
                node: node.clone(),
                message,
            }),
            None => Err(CardFetchError::Closed { node: node.clone() }),
        }
    };
    match tokio::time::timeout(within, got).await {
        Ok(r) => r,
        Err(_) => Err(CardFetchError::TimedOut {
            node,
            secs: within.as_secs_f64(),
        }),
    }
}

/// Why a worker gave no model card.
#[derive(Debug, thiserror::Error)]
pub enum CardFetchError {
    #[error("{node}: not connected")]
    NotConnected { node: String },
    #[error("{node}: {source}")]
    Stream {
        node: String,
        #[source]
        source: TransportError,
    },
    /// The worker's own words.
    #[error("{node}: {message}")]
    Refused { node: String, message: String },
    #[error("{node}: the worker closed the stream")]
    Closed { node: String },
    #[error("{node}: no card came within {secs:.1} s")]
    TimedOut { node: String, secs: f64 },
}
