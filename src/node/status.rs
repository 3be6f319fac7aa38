//! What a node says about itself over HTTP: `/status` (JSON: roles, load, uptime, its
//! router's view), `/metrics` (node-level lines), `/health`, its spans of a trace, and the
//! fault-injection hook.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use kvmesh_actors::router::WorkerLink;
use kvmesh_actors::{NodeMsg, Pools, Role, RoleRestarts, RouterCore, Serving, WorkerCore};
use kvmesh_discovery::NodeRecord;
use kvmesh_gateway::dispatch::Reply;
use kvmesh_gateway::error::ApiError;
use kvmesh_gateway::Dispatch;
use kvmesh_gpu::engine::{EngineHandle, Request};
use kvmesh_telemetry::metrics::{Exposition, CONTENT_TYPE};

/// The router as a gateway's dispatch target.
pub struct RoutedDispatch(pub Arc<RouterCore>, pub Arc<RoleRestarts>);

impl Dispatch for RoutedDispatch {
    fn submit(&self, req: Request) -> Result<Reply, ApiError> {
        Ok(self.0.submit(req))
    }

    fn max_model_len(&self) -> Option<usize> {
        self.0.max_model_len()
    }

    fn render_metrics(&self, out: &Exposition, _model: &str) {
        kvmesh_actors::router::render_pools(std::slice::from_ref(&self.0), out);
        render_restarts(out, &self.1);
    }
}

pub struct NodeState {
    /// This node's recent spans (served to gateways gathering a trace).
    pub spans: Arc<kvmesh_telemetry::SpanStore>,
    pub record: NodeRecord,
    pub started: Instant,
    pub router: Option<Arc<Pools>>,
    pub serving: Option<Arc<Serving>>,
    /// The node's worker-type cores: worker, decode, prefill.
    pub cores: Vec<Arc<WorkerCore>>,
    pub restarts: Arc<RoleRestarts>,
    pub supervisor: kvmesh_actors::ActorRef<NodeMsg>,
    pub fault_injection: bool,
    /// When set, /debug routes need it as the API routes do.
    pub api_key: Option<String>,
}

impl NodeState {
    fn status(&self, listed: usize) -> Value {
        let mut v = json!({
            "node_id": self.record.node_id,
            "cluster": self.record.cluster,
            "roles": self.record.roles,
            "model": self.record.model,
            "device": self.record.device,
            "quic_addr": self.record.quic_addr,
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "draining": self.serving.as_ref().is_some_and(|s| s.draining()),
            "in_flight": self.serving.as_ref().map(|s| s.in_flight()),
            "role_restarts": Role::SUPERVISED
                .iter()
                .map(|r| (r.as_str().to_string(), json!(self.restarts.get(*r))))
                .collect::<serde_json::Map<_, _>>(),
        });
        if let Some(r) = self.serving.as_ref().and_then(|s| s.load_report()) {
            v["load"] = json!({
                "running": r.running,
                "waiting": r.waiting,
                "tokens_in_flight": r.tokens_in_flight,
                "kv_usage": r.kv_usage,
                "gen_tokens_per_s": r.gen_tokens_per_s,
                "capacity_tokens_per_s": r.capacity_tokens_per_s,
                "requests_served": self
                    .cores
                    .iter()
                    .map(|c| c.requests_served.load(Ordering::Relaxed))
                    .sum::<u64>(),
            });
            if let Some(p) = r.prefill {
                v["load"]["prefill"] = json!({
                    "running": p.running,
                    "waiting": p.waiting,
                    "tokens_in_flight": p.tokens_in_flight,
                    "kv_usage": p.kv_usage,
                    "tokens_per_s": p.tokens_per_s,
                });
            }
        }
        if let Some(kv) = self.cores.iter().find_map(|c| c.kv.as_ref()) {
            {
                let st = &kv.stats;
                v["kv"] = json!({
                    "transport": kv.transport.name(),
                    "layout": kv.layout.describe(),
                    "remote": st.remote.load(Ordering::Relaxed),
                    "cached_locally": st.cached_locally.load(Ordering::Relaxed),
                    "fallback": st.fallback.load(Ordering::Relaxed),
                    "sent": st.served.load(Ordering::Relaxed),
                    "failed": st.failed.load(Ordering::Relaxed),
                    "bytes_in": st.bytes_in.load(Ordering::Relaxed),
                    "bytes_out": st.bytes_out.load(Ordering::Relaxed),
                });
            }
        }
        if let Some(pools) = &self.router {
            v["router"] = router_view(pools, listed);
        }
        v
    }

    fn metrics(&self) -> String {
        let o = Exposition::new();
        render_restarts(&o, &self.restarts);
        self.render_workers(&o);
        o.render()
    }

    /// The families of the node's engines (labelled by role when there are two) and of its
    /// KV side.
    pub(super) fn render_workers(&self, o: &Exposition) {
        let labelled = self.cores.len() > 1;
        let engines: Vec<(Option<&str>, &EngineHandle)> = self
            .cores
            .iter()
            .map(|c| (labelled.then(|| c.role.as_str()), &c.engine))
            .collect();
        if !engines.is_empty() {
            kvmesh_gateway::metrics::render_engines(o, &self.record.model, &engines);
        }
        // A node's prefill and decode cores share one KV side.
        if let Some(kv) = self.cores.iter().find_map(|c| c.kv.as_ref()) {
            kv.render_metrics(o);
        }
    }
}

/// `/status?workers=N|all`: how many of a router's workers are listed one by one (the
/// summary counts them all).
struct StatusQuery {
    workers: Option<String>,
}

/// Workers a router's `/status` lists unless asked for more or fewer.
const LISTED_WORKERS: usize = 1000;

impl StatusQuery {
    fn listed(&self) -> Result<usize, ApiError> {
        match self.workers.as_deref() {
            None => Ok(LISTED_WORKERS),
            Some("all") => Ok(usize::MAX),
            Some(n) => n.parse().map_err(|_| {
                ApiError::param(
                    "workers",
                    format!(
                        "workers={}: a number of workers to list, or all",
                        kvmesh_gateway::error::quoted(n)
                    ),
                )
            }),
        }
    }
}

/// A router's view: every pool's, and over all pools the workers, refusals, migrations,
/// pick times (the recent percentiles: the busiest pool's) and prefix predictions.
fn router_view(pools: &Pools, listed: usize) -> Value {
    let all = pools.all();
    let mut left = listed;
    let views: Vec<Value> = all.iter().map(|p| pool_view(p, &mut left)).collect();
    let links: Vec<_> = all.iter().flat_map(|p| p.workers()).collect();
    let count = |f: &dyn Fn(&WorkerLink) -> bool| links.iter().filter(|w| f(w)).count();
    let sum = |f: &dyn Fn(&RouterCore) -> u64| all.iter().map(|p| f(p)).sum::<u64>();
    let picks = sum(&|p| p.stats.picks.count.load(Ordering::Relaxed));
    let busiest = all
        .iter()
        .max_by_key(|p| p.stats.picks.count.load(Ordering::Relaxed));
    let recent = busiest.map_or(Vec::new(), |p| {
        p.stats.picks.recent_percentiles_us(&[50.0, 99.0])
    });
    let mean_us = if picks == 0 {
        0.0
    } else {
        all.iter()
            .map(|p| p.stats.picks.mean_us() * p.stats.picks.count.load(Ordering::Relaxed) as f64)
            .sum::<f64>()
            / picks as f64
    };
    let concat = |key: &str| {
        views
            .iter()
            .flat_map(|v| v[key].as_array().cloned().unwrap_or_default())
            .collect::<Vec<Value>>()
    };
    json!({
        "policy": pools.policy().as_str(),
        "workers_summary": {
            "total": links.len(),
            "connected": count(&|w| w.connected()),
            "routable": count(&|w| w.available() && w.generates()),
            "draining": count(&|w| w.draining()),
            "listed": links.len().min(listed),
        },
        "workers": concat("workers"),
        "refused": concat("refused"),
        "migrations": sum(&|p| p.stats.migrations.load(Ordering::Relaxed)),
        "pick_time": {
            "count": picks,
            "mean_us": mean_us,
            "max_us": all.iter().map(|p| p.stats.picks.max_ns.load(Ordering::Relaxed)).max().unwrap_or(0) as f64 / 1e3,
            "recent_p50_us": recent.first(),
            "recent_p99_us": recent.get(1),
        },
        "prefix_predictions": {
            "exact": sum(&|p| p.stats.predictions[0].load(Ordering::Relaxed)),
            "fewer": sum(&|p| p.stats.predictions[1].load(Ordering::Relaxed)),
            "more": sum(&|p| p.stats.predictions[2].load(Ordering::Relaxed)),
        },
        "pools": views,
    })
}

/// One pool: its model, fingerprint and workers, what it refused, and its pick times.
fn pool_view(r: &RouterCore, left: &mut usize) -> Value {
    let workers = r.workers();
    let shown = workers.len().min(*left);
    *left -= shown;
    let model = r.model.as_str();
    // p50 and p99 from one sort of the recent picks.
    let recent = r.stats.picks.recent_percentiles_us(&[50.0, 99.0]);
    json!({
        "model": model,
        "fingerprint": r.model_fingerprint,
        "max_model_len": r.max_model_len(),
        "workers": workers[..shown].iter().map(|w| json!({
            "node_id": w.record.node_id,
            "model": model,
            "connected": w.connected(),
            "draining": w.draining(),
            "load": w.load(),
            "capacity_tokens_per_s": w.capacity(),
            "prompt_tokens_per_s": w.prompt_rate(),
            "routed": w.routed.load(Ordering::Relaxed),
            "kv_blocks_reported": w.kv.held(),
            "kv_events_synced": w.kv.synced(),
        })).collect::<Vec<_>>(),
        "refused": r.refused.lock().iter().map(|(id, why)| json!({
            "node_id": id,
            "model": model,
            "reason": why,
        })).collect::<Vec<_>>(),
        "migrations": r.stats.migrations.load(Ordering::Relaxed),
        "pick_time": {
            "count": r.stats.picks.count.load(Ordering::Relaxed),
            "mean_us": r.stats.picks.mean_us(),
            "max_us": r.stats.picks.max_ns.load(Ordering::Relaxed) as f64 / 1e3,
            "recent_p50_us": recent.first(),
            "recent_p99_us": recent.get(1),
        },
    })
}

pub(super) fn render_restarts(o: &Exposition, restarts: &RoleRestarts) {
    o.counters(
        "kvmesh:role_restarts_total",
        "Roles restarted by the node supervisor after a crash.",
        &["role"],
        Role::SUPERVISED.map(|r| (vec![r.as_str()], restarts.get(r) as f64)),
    );
}

/// `/status`, `/metrics` (node-level lines), `/health`, the node's spans of a trace, and
/// the fault-injection hook. A gateway serves the API's, metrics and trace routes itself.
pub fn node_routes(node: Arc<NodeState>, with_metrics: bool) -> Router {
    let mut r = Router::new().route(
        "/status",
        get(
            |State(n): State<Arc<NodeState>>,
             Query(mut q): Query<std::collections::HashMap<String, String>>| async move {
                let q = StatusQuery {
                    workers: q.remove("workers"),
                };
                match q.listed() {
                    Ok(listed) => Json(n.status(listed)).into_response(),
                    Err(e) => e.into_response(),
                }
            },
        ),
    );
    if with_metrics {
        r = r.route(
            "/traces/api/spans/{trace}",
            get(
                |State(n): State<Arc<NodeState>>,
                 Path(t): Path<String>,
                 headers: axum::http::HeaderMap| async move {
                    // Spans quote requests (their errors): behind the key, as on a gateway.
                    if let Some(key) = &n.api_key {
                        if !kvmesh_gateway::authorized(&headers, key) {
                            return ApiError::unauthorized().into_response();
                        }
                    }
                    Json(n.spans.trace(&t)).into_response()
                },
            ),
        );
        r = r
            .route(
                "/metrics",
                get(|State(n): State<Arc<NodeState>>| async move {
                    ([(header::CONTENT_TYPE, CONTENT_TYPE)], n.metrics())
                }),
            )
            .route(
                "/health",
                get(|State(n): State<Arc<NodeState>>| async move {
                    // A draining worker is alive but takes nothing new: not ready.
                    if n.serving.as_ref().is_some_and(|s| s.draining()) {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            Json(json!({"status": "draining"})),
                        )
                    } else {
                        (StatusCode::OK, Json(json!({"status": "ok"})))
                    }
                }),
            );
    }
    r.route("/debug/crash/{role}", post(crash)).with_state(node)
}

async fn crash(
    State(n): State<Arc<NodeState>>,
    Path(role): Path<String>,
    headers: axum::http::HeaderMap,
) -> Response {
    if let Some(key) = &n.api_key {
        if !kvmesh_gateway::authorized(&headers, key) {
            return ApiError::unauthorized().into_response();
        }
    }
    if !n.fault_injection {
        return ApiError {
            status: StatusCode::NOT_FOUND,
            message: "fault injection is off (--enable-fault-injection)".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
        .into_response();
    }
    let Some(role) = Role::SUPERVISED.into_iter().find(|r| r.as_str() == role) else {
        return ApiError::param(
            "role",
            format!(
                "unknown role {} ({})",
                kvmesh_gateway::error::quoted(&role),
                Role::list(&Role::SUPERVISED)
            ),
        )
        .into_response();
    };
    let _ = n.supervisor.cast(NodeMsg::Crash(role));
    Json(json!({"crashed": role.as_str()})).into_response()
}
