//! `kvmesh node`: one member of a cluster. It publishes itself in etcd, watches the other
//! members, and takes the roles it is given:
//!
//! - `worker`: runs the engine and serves requests from routers over QUIC;
//! - `prefill`: runs an engine that computes prompts for decode workers and streams them
//!   the KV, layer by layer;
//! - `decode`: runs an engine that decodes, taking long prompts' KV from a prefill worker
//!   when the router says so (and prefilling short or cached ones itself);
//! - `router`: connects to every worker, keeps one pool per served model, and picks a worker
//!   of the request's model (`--policy`), and a prefill worker for a decode worker's long
//!   prompts;
//! - `gateway`: the OpenAI HTTP API in front of this node's router, for every model the
//!   mesh serves: it fetches each model's card (tokenizer, chat template, generation
//!   defaults) from one of its workers, so it needs no model files (`--model` pins one).
//!
//! `--roles prefill,decode` runs both engines in one process; their KV moves by a copy from
//! one pool into the other.
//!
//! Every node also serves `/status` (JSON: roles, load, uptime) and `/metrics` over HTTP,
//! on the gateway's port or, for a node without a gateway, on `--status-port`. `kvmesh
//! cluster status` reads the records in etcd and each node's `/status`.
//!
//! A node's life: its flags (`args`) are checked into one plan (`plan`), its engines,
//! endpoints, record and roles started from the plan (`start`), then it serves until
//! SIGTERM and drains (`drain`).

mod args;
mod card_files;
mod catalog;
mod cluster;
mod drain;
mod membership;
mod plan;
mod replica;
mod start;
mod status;

use anyhow::Context;

pub use args::NodeArgs;
pub use cluster::{cluster_status, ClusterStatusArgs};

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let plan = plan::NodePlan::from_args(args)?;
    let telemetry = plan.trace.init(&plan.node_id)?;
    let engines = start::Engines::start(&plan)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let started = start::start(&plan, engines, telemetry.store.clone()).await?;
        drain::serve_then_drain(&plan, started).await
    })?;
    telemetry.shutdown();
    Ok(())
}
