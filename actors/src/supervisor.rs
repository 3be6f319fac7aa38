//! The node's roles as ractor actors under one supervisor.
//!
//! Each role actor owns its role's long-running loop (the router's membership sync, the
//! worker's accept loop) and nothing on the per-token path: requests flow through tokio
//! tasks, channels and QUIC streams, whose state lives in `RouterCore` / `WorkerCore` and
//! survives a role restart. When a role actor panics the supervisor starts it again with the
//! same core, counts the restart, and the other roles never notice.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvmesh_discovery::{Membership, Role};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::router::Pools;
use crate::worker::{Serving, WorkerCore};

/// Messages a role actor takes.
pub enum RoleMsg {
    /// Panics inside the actor: how tests (and `--enable-fault-injection`) check that a
    /// crashed role is restarted while the node keeps serving.
    Crash,
}

/// Restart counts per role, read by the node's metrics.
#[derive(Default)]
pub struct RoleRestarts {
    counts: [AtomicU64; Role::ALL.len()],
}

impl RoleRestarts {
    pub fn get(&self, role: Role) -> u64 {
        self.counts[role as usize].load(Ordering::Relaxed)
    }

    fn bump(&self, role: Role) {
        self.counts[role as usize].fetch_add(1, Ordering::Relaxed);
    }
}

struct RouterActor;

impl Actor for RouterActor {
    type Msg = RoleMsg;
    type State = JoinHandle<()>;
    type Arguments = (Arc<Pools>, watch::Receiver<Membership>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (core, mut members): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(tokio::spawn(async move {
            loop {
                let m = members.borrow_and_update().clone();
                core.apply_membership(&m);
                // Also every second: links whose record vanished have a grace period.
                tokio::select! {
                    r = members.changed() => if r.is_err() {
                        return;
                    },
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                }
            }
        }))
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RoleMsg::Crash => panic!("router role: crash requested (fault injection)"),
        }
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        task: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        task.abort();
        Ok(())
    }
}

/// A worker, prefill or decode role: while it runs, its core takes requests on the node's
/// endpoint; a decode role taking KV over TCP also runs its KV listener.
struct CoreActor;

struct CoreState {
    serving: Arc<Serving>,
    core: Arc<WorkerCore>,
    tasks: Vec<JoinHandle<()>>,
}

impl Actor for CoreActor {
    type Msg = RoleMsg;
    type State = CoreState;
    type Arguments = (Arc<Serving>, Arc<WorkerCore>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (serving, core): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut tasks = Vec::new();
        if let Some(kv) = &core.kv {
            if let Some(l) = &kv.tcp_listener {
                tasks.push(tokio::spawn(kv.inbox.clone().serve_tcp(l.clone())));
            }
        }
        serving.set(core.role, Some(core.clone()));
        Ok(CoreState {
            serving,
            core,
            tasks,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RoleMsg::Crash => panic!(
                "{} role: crash requested (fault injection)",
                state.core.role.as_str()
            ),
        }
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.serving.set(state.core.role, None);
        for t in &state.tasks {
            t.abort();
        }
        Ok(())
    }
}

/// What the supervisor starts: the cores of the roles this node takes.
#[derive(Clone)]
pub struct NodeRoles {
    pub router: Option<(Arc<Pools>, watch::Receiver<Membership>)>,
    /// The node's endpoint and the worker-type roles serving on it.
    pub serving: Option<Arc<Serving>>,
    /// The worker or decode role's core.
    pub generate: Option<Arc<WorkerCore>>,
    pub prefill: Option<Arc<WorkerCore>>,
    pub restarts: Arc<RoleRestarts>,
}

impl NodeRoles {
    fn core(&self, role: Role) -> Option<Arc<WorkerCore>> {
        [&self.generate, &self.prefill]
            .into_iter()
            .flatten()
            .find(|c| c.role == role)
            .cloned()
    }
}

pub enum NodeMsg {
    /// Asks a role to crash (fault injection).
    Crash(Role),
}

pub struct NodeSupervisor;

pub struct SupervisorState {
    roles: NodeRoles,
    children: BTreeMap<Role, ActorRef<RoleMsg>>,
    accept: Option<JoinHandle<()>>,
}

async fn start_role(
    role: Role,
    roles: &NodeRoles,
    sup: ActorCell,
) -> Result<ActorRef<RoleMsg>, ActorProcessingErr> {
    let name = Some(format!("{}-{}", role.as_str(), ractor_unique()));
    let r = match role {
        Role::Router => {
            let args = roles.router.clone().ok_or("this node has no router role")?;
            Actor::spawn_linked(name, RouterActor, args, sup).await?.0
        }
        _ => {
            let core = roles
                .core(role)
                .ok_or_else(|| format!("this node has no {} role", role.as_str()))?;
            let serving = roles
                .serving
                .clone()
                .ok_or("a worker role needs an endpoint")?;
            Actor::spawn_linked(name, CoreActor, (serving, core), sup)
                .await?
                .0
        }
    };
    Ok(r)
}

/// Actor names must be unique in the process; a restarted role gets a fresh one.
fn ractor_unique() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl Actor for NodeSupervisor {
    type Msg = NodeMsg;
    type State = SupervisorState;
    type Arguments = NodeRoles;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        roles: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut children = BTreeMap::new();
        // Serving roles first, so a router never finds its own node's roles missing.
        for role in [Role::Prefill, Role::Decode, Role::Worker, Role::Router] {
            let present = match role {
                Role::Router => roles.router.is_some(),
                other => roles.core(other).is_some(),
            };
            if present {
                let r = start_role(role, &roles, myself.get_cell()).await?;
                children.insert(role, r);
            }
        }
        let accept = roles.serving.clone().map(|s| tokio::spawn(s.accept_loop()));
        Ok(SupervisorState {
            roles,
            children,
            accept,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(a) = &state.accept {
            a.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Crash(role) => {
                if let Some(child) = state.children.get(&role) {
                    let _ = child.cast(RoleMsg::Crash);
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match &evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell.clone(), err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                cell.clone(),
                reason.clone().unwrap_or_else(|| "stopped".into()),
            ),
            _ => return Ok(()),
        };
        let Some(role) = state
            .children
            .iter()
            .find(|(_, r)| r.get_id() == cell.get_id())
            .map(|(role, _)| *role)
        else {
            return Ok(());
        };
        tracing::error!("the {} role failed ({why}); restarting it", role.as_str());
        let r = start_role(role, &state.roles, myself.get_cell()).await?;
        state.children.insert(role, r);
        // Counted once the role serves again: a restart seen on `/metrics` is one done.
        state.roles.restarts.bump(role);
        Ok(())
    }
}

/// Starts the supervisor and its roles; ractor's error says which role did not start.
pub async fn start(roles: NodeRoles) -> Result<ActorRef<NodeMsg>, ractor::SpawnErr> {
    let (sup, _join) = Actor::spawn(
        Some(format!("node-{}", ractor_unique())),
        NodeSupervisor,
        roles,
    )
    .await?;
    Ok(sup)
}
