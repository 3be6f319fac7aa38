//! A worker-type role's core: its engine, what it measures of itself, and its KV side. It
//! outlives the role's actor, so a restarted role serves on with the same engine.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use kvmesh_discovery::Role;
use kvmesh_gpu::engine::EngineHandle;
use kvmesh_transport::wire::LoadReport;
use parking_lot::{Mutex, RwLock};

use super::kv_side::KvSide;
use super::load::Meter;

pub struct WorkerCore {
    pub node_id: String,
    /// Worker, prefill or decode.
    pub role: Role,
    pub engine: EngineHandle,
    /// Declared capacity (tokens/s) until a measurement replaces it.
    pub declared_capacity: f64,
    meter: Mutex<Meter>,
    pub requests_served: AtomicU64,
    /// Prefill and decode roles: KV transfer settings, peers and counters.
    pub kv: Option<Arc<KvSide>>,
    /// A decode role's own node's prefill role, when it has one: transfers between them are
    /// a copy from one pool into the other.
    pub local_prefill: RwLock<Option<Arc<WorkerCore>>>,
}

impl WorkerCore {
    pub fn new(
        node_id: String,
        role: Role,
        engine: EngineHandle,
        declared_capacity: f64,
        kv: Option<Arc<KvSide>>,
    ) -> Arc<WorkerCore> {
        debug_assert!(role.runs_engine(), "a {role} role has no engine");
        Arc::new(WorkerCore {
            node_id,
            role,
            meter: Mutex::new(Meter::new(&engine)),
            engine,
            declared_capacity,
            requests_served: AtomicU64::new(0),
            kv,
            local_prefill: RwLock::new(None),
        })
    }

    /// The current load. Rates are recomputed at most every half report interval, so many
    /// router connections asking at once share one measurement.
    pub fn load_report(&self) -> LoadReport {
        self.meter.lock().report(
            &self.engine,
            self.declared_capacity,
            self.role == Role::Prefill,
        )
    }
}
