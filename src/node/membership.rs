//! How a node follows the cluster's membership: who may dial it, when its router starts
//! dialling, and whether its KV partners can fill its blocks at all.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use tokio::sync::watch;

use kvmesh_actors::pace::ReportPace;
use kvmesh_actors::Role;
use kvmesh_discovery::{Membership, NodeRecord};
use kvmesh_transport::AllowList;

/// Keeps `allowed` (who may dial this node) to the members' certificates. A member that left
/// the registry may still dial for the routers' grace period: after the registry lost its
/// data, everyone is registering again.
pub fn follow_allow_list(mut members: watch::Receiver<Membership>, allowed: AllowList) {
    tokio::spawn(async move {
        let mut seen: HashMap<String, Instant> = HashMap::new();
        loop {
            let m = members.borrow_and_update().clone();
            let now = Instant::now();
            for r in m.values() {
                seen.insert(r.cert_sha256.clone(), now);
            }
            seen.retain(|_, at| now.duration_since(*at) < kvmesh_actors::router::REGISTRY_GRACE);
            allowed.set(seen.keys().cloned());
            tokio::select! {
                r = members.changed() => if r.is_err() {
                    return;
                },
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    });
}

/// Keeps this process's load-report pace at what the cluster's worker count calls for
/// ([`kvmesh_actors::pace`]).
pub fn follow_pace(mut members: watch::Receiver<Membership>, pace: Arc<ReportPace>) {
    tokio::spawn(async move {
        loop {
            let workers = members
                .borrow_and_update()
                .values()
                .filter(|r| r.roles.iter().any(|role| role.runs_engine()))
                .count();
            pace.set_workers(workers);
            if members.changed().await.is_err() {
                return;
            }
        }
    });
}

/// Shows the router the membership only once this node's own record has come back through
/// the registry's watch. A member checks a dialling router's certificate against the records
/// it has seen; by then the others' watches have this node's record too, so the router's
/// first dial is not refused.
pub fn gate_router_members(
    mut members: watch::Receiver<Membership>,
    me: String,
    router_members: watch::Sender<Membership>,
) {
    tokio::spawn(async move {
        let mut listed = false;
        loop {
            let m = members.borrow_and_update().clone();
            listed = listed || m.contains_key(&me);
            if listed && router_members.send(m).is_err() {
                return;
            }
            if members.changed().await.is_err() {
                return;
            }
        }
    });
}

/// Refuses to join next to a prefill or decode node of the same model whose KV layout
/// differs from ours: one could never fill the other's blocks.
pub fn check_kv_partners(
    node_id: &str,
    roles: &[Role],
    model: &str,
    layout: &str,
    members: &[NodeRecord],
) -> anyhow::Result<()> {
    let mine: Vec<&str> = [Role::Prefill, Role::Decode]
        .into_iter()
        .filter(|r| roles.contains(r))
        .map(Role::as_str)
        .collect();
    for m in members {
        if m.node_id == node_id || m.model != model {
            continue;
        }
        let partner = (roles.contains(&Role::Prefill) && m.has_role(Role::Decode))
            || (roles.contains(&Role::Decode) && m.has_role(Role::Prefill));
        if partner && m.kv_layout.as_deref() != Some(layout) {
            bail!(
                "refusing to join: this {} node {node_id} has {layout}; its partner {} node {} has {}",
                mine.join(","),
                if m.has_role(Role::Prefill) { "prefill" } else { "decode" },
                m.node_id,
                m.kv_layout.as_deref().unwrap_or("no KV layout (an older version?)")
            );
        }
    }
    Ok(())
}
