//! `kvmesh bench`: measures a running OpenAI-compatible server (kvmesh or any other) the way
//! serving benchmarks do. It sends streamed requests at a set concurrency or request rate,
//! times every chunk, and reports throughput and TTFT / TPOT / ITL / end-to-end latency; a
//! sweep over several settings ends in a table, JSON files and PNG charts.

mod args;
mod client;
mod conversation;
mod dataset;
mod metrics;
mod plot;
mod report;
mod run;
mod schedule;
mod sweep;

use anyhow::{Context, Result};

pub use args::BenchArgs;

/// Runs `kvmesh bench` as its flags say: a sweep against a server, or only charts of earlier
/// ones.
pub fn run(args: BenchArgs) -> Result<()> {
    args::check(&args)?;
    if args.plot_only {
        return sweep::plot_only(&args);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(sweep::bench(args))
}
