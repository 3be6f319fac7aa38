//! Which workers a router routes to: the registry's members of its model, less those it
//! refuses (another model under the same name), with a grace period for members whose
//! record vanished while their connection lives on.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_discovery::{Membership, NodeRecord};
use parking_lot::{Mutex, RwLock};

use super::links::{AtomicSpeeds, KvSlot, PickState, Speeds, WorkerLink, Workers};
use crate::kv_index::KvIndex;

/// How long a worker whose record left the registry stays in routing while its connection
/// lives (and it is not draining): long enough for every node to register again after the
/// registry lost its data. Call `RouterCore::apply_membership` at least every second so
/// the grace ends on time.
pub const REGISTRY_GRACE: Duration = Duration::from_secs(30);

/// The model a router routes for: workers must serve it under the same name and publish the
/// same fingerprint.
pub(crate) struct Model<'a> {
    pub name: &'a str,
    pub fingerprint: &'a str,
}

/// The members that are workers of `model`, and why each other worker of that name is
/// refused.
fn wanted<'m>(
    members: &'m Membership,
    model: &Model,
) -> (
    BTreeMap<&'m String, &'m NodeRecord>,
    BTreeMap<String, String>,
) {
    let mut refused = BTreeMap::new();
    let wanted = members
        .iter()
        .filter(|(_, r)| r.model == model.name && r.roles.iter().any(|role| role.runs_engine()))
        .filter(|(id, r)| {
            // Same name, another model (vocabulary, config, weights): its token ids
            // would mean other text here. Never mix it in.
            let why = match &r.model_fingerprint {
                Some(f) if *f == model.fingerprint => return true,
                Some(f) => format!(
                    "serves another model under the name '{}' (fingerprint {f} on {}, this \
                     router's is {}){}",
                    model.name,
                    r.device,
                    model.fingerprint,
                    if r.simulated() {
                        "; the sim backend's tokens are not the model's, so its fingerprint is \
                         of its own"
                    } else {
                        ""
                    }
                ),
                None => format!(
                    "publishes no model fingerprint (version {}); cannot tell its model is this router's",
                    r.version
                ),
            };
            refused.insert((*id).clone(), why);
            false
        })
        .collect();
    (wanted, refused)
}

/// Whether a known link leaves the routing set: its worker restarted elsewhere or with a
/// new certificate, or left the registry and is past its grace.
fn departs(id: &str, link: &WorkerLink, record: Option<&&NodeRecord>) -> bool {
    match record {
        // Restarted elsewhere, or with a new certificate: replace at once.
        Some(r) => {
            if r.quic_addr != link.record.quic_addr || r.cert_sha256 != link.record.cert_sha256 {
                return true;
            }
            *link.vanished.lock() = None;
            false
        }
        // Gone from the registry. A live connection says the worker is not: the registry
        // may have lost its data (etcd restarted empty) and everyone is registering again,
        // so the link stays for a grace period.
        None => {
            let mut since = link.vanished.lock();
            let first = since.is_none();
            let at = *since.get_or_insert_with(Instant::now);
            // Reports every 200 ms say it lives; a crashed worker's connection lingers
            // until the idle timeout, but its reports stop at once.
            let reporting = link.reported_within(Duration::from_secs(1));
            if link.connected() && reporting && at.elapsed() < REGISTRY_GRACE {
                if first {
                    tracing::warn!(
                        "worker {id} left the registry but its connection is alive; \
                         routing on to it for up to {} s while it registers again",
                        REGISTRY_GRACE.as_secs()
                    );
                }
                false
            } else {
                true
            }
        }
    }
}

/// A link for a new worker, not yet connected.
pub(super) fn new_link(
    rec: &NodeRecord,
    index: &Arc<KvIndex>,
    next_slot: &AtomicU32,
) -> WorkerLink {
    let kv = KvSlot::new(index, next_slot);
    WorkerLink {
        record: rec.clone(),
        conn: Mutex::new(None),
        hot: PickState {
            up: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            generates: rec.roles.iter().any(|r| r.generates()),
            slot: kv.slot,
            max_model_len: rec.max_model_len,
            outstanding: AtomicI64::new(0),
            queued_prompt: AtomicI64::new(0),
            streamed: AtomicBool::new(false),
            speed: AtomicSpeeds::new(Speeds::of(None, rec.capacity_tokens_per_s)),
        },
        prefill_load: Default::default(),
        kv,
        outstanding_tokens: AtomicI64::new(0),
        prefills: AtomicI64::new(0),
        prefill_tokens: AtomicI64::new(0),
        routed: AtomicU64::new(0),
        prefilled: AtomicU64::new(0),
        gone: AtomicBool::new(false),
        vanished: Mutex::new(None),
        reported_at: AtomicU64::new(0),
    }
}

/// Brings the worker set in line with the registry: departed workers are closed and
/// forgotten, changed records (a restarted node: new address or certificate) replaced, and
/// the refusals updated. Returns the new links, which the caller keeps connected.
pub(crate) fn apply(
    workers: &RwLock<Workers>,
    refused: &Mutex<BTreeMap<String, String>>,
    members: &Membership,
    model: &Model,
    index: &Arc<KvIndex>,
    next_slot: &AtomicU32,
) -> Vec<Arc<WorkerLink>> {
    let (wanted, now_refused) = wanted(members, model);
    {
        let mut known = refused.lock();
        for (id, why) in &now_refused {
            if known.get(id) != Some(why) {
                tracing::warn!("not routing to worker {id}: it {why}");
            }
        }
        *known = now_refused;
    }
    // Most calls change nothing (one a second keeps the grace periods on time): at 10,000
    // workers, rebuilding the set under the write lock would hold every pick up for
    // milliseconds, so what changes is found under the read lock first.
    {
        let guard = workers.read();
        let departing = guard
            .by_id
            .iter()
            .any(|(id, link)| departs(id, link, wanted.get(id)));
        if !departing && wanted.keys().all(|id| guard.by_id.contains_key(*id)) {
            return Vec::new();
        }
    }
    let mut guard = workers.write();
    let links = &mut guard.by_id;
    let departed: Vec<String> = links
        .iter()
        .filter(|(id, link)| departs(id, link, wanted.get(id)))
        .map(|(id, _)| id.clone())
        .collect();
    for id in departed {
        if let Some(link) = links.remove(&id) {
            link.gone.store(true, Ordering::Relaxed);
            if let Some(c) = link.connection() {
                c.close(0u32.into(), b"left the cluster");
            }
            tracing::info!("worker {id} left the routing set");
        }
    }
    let mut added = Vec::new();
    for (id, rec) in wanted {
        if links.contains_key(id) {
            continue;
        }
        let link = Arc::new(new_link(rec, index, next_slot));
        links.insert(id.clone(), link.clone());
        added.push(link);
    }
    guard.list = guard.by_id.values().cloned().collect();
    guard.by_slot = super::shortlist::by_slot(&guard.list);
    added
}
