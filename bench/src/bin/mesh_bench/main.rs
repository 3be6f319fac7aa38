//! Cluster-mode benchmarks, on `sim` workers so they measure the mesh and the routing, not
//! the math. Each scenario starts its own etcd and `kvmesh` processes on loopback, runs a
//! fixed workload through the OpenAI API, prints a table and writes JSON.
//!
//! 1. **Mesh overhead**: a zero-cost sim worker (no prefill or decode time) behind
//!    gateway → router → QUIC → worker, against the same worker in-process (`kvmesh serve`):
//!    requests/s and the added p50/p99 latency, at concurrency 1 and 16.
//! 2. **Heterogeneous nodes**: two sim workers at 1x and 3x speed, `round-robin` against
//!    `least-loaded`: output throughput and p99 TTFT.
//! 3. **Prefix routing**: a multi-turn chat workload (each turn resends the conversation so
//!    far) over 4 workers, `prefix` against `round-robin`: prefix-cache hit rate (cached
//!    prompt tokens / prompt tokens, from the API's usage) and mean TTFT.
//! 4. **Router scale**: pick time in a running router over 8, 64 and 256 sim workers hosted
//!    by one `kvmesh node --replicas N` process.
//! 5. **Models**: pick time with 64 workers as 1 model x 64 and as 8 models x 8 (one pool
//!    per model: it must not grow with the models), and a gateway's first request for a
//!    model (its card fetched from a worker) against the next and against a restarted
//!    gateway with `--cache-dir`.
//!
//! `cargo build --release && target/release/mesh-bench [--quick] [--json PATH] [--only SECTIONS]`
//! (needs `etcd` on PATH, as the tests do; `bash scripts/test.sh` installs it).

mod ctx;
mod heterogeneous;
mod hop;
mod models;
mod overhead;
mod prefix;
mod routing;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kvmesh_bench::harness::load_client;
use kvmesh_bench::programs::{kvmesh, write_results};
use serde_json::json;

/// Cluster-mode benchmarks on sim workers: what the mesh and the routing cost and buy.
#[derive(Parser)]
#[command(name = "mesh-bench")]
struct Args {
    /// Fewer requests, smaller clusters and fewer iterations in every section.
    #[arg(long)]
    quick: bool,
    /// Where the results go.
    #[arg(long, value_name = "PATH", default_value = "bench/results/mesh.json")]
    json: PathBuf,
    /// The sections to run, comma-separated [default: all]
    #[arg(long, value_enum, value_delimiter = ',', value_name = "SECTIONS")]
    only: Option<Vec<Section>>,
}

/// A part of the benchmark, named as `--only` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Section {
    /// Gateway → router → QUIC → worker against the same worker in-process.
    Overhead,
    /// Workers of mixed speeds under each policy.
    Heterogeneous,
    /// Bursty open-loop arrivals on workers of mixed speeds.
    Bursty,
    /// Multi-turn chats: prefix routing against the other policies.
    Prefix,
    /// Where a hop's microseconds go, piece by piece, in-process.
    Hop,
    /// Routing decision time in-process, as the cluster grows.
    Picks,
    /// Routing decision time in a running router over up to 256 workers.
    Scale,
    /// Several models in one mesh: pick time by models, and a gateway's first request for a
    /// model (its card fetched) against the next.
    Models,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let runs = |s: Section| args.only.as_ref().is_none_or(|o| o.contains(&s));
    let ctx = ctx::Ctx {
        km: kvmesh(),
        http: load_client(Duration::from_secs(120)),
        quick: args.quick,
    };
    let mut out = json!({});
    if runs(Section::Overhead) {
        out["mesh_overhead"] = overhead::mesh_overhead(&ctx).await;
    }
    if runs(Section::Heterogeneous) {
        out["heterogeneous"] = heterogeneous::heterogeneous(&ctx).await;
    }
    if runs(Section::Bursty) {
        out["bursty"] = heterogeneous::bursty(&ctx);
    }
    if runs(Section::Prefix) {
        out["prefix_routing"] = prefix::prefix_routing(&ctx).await;
    }
    if runs(Section::Hop) {
        out["hop_profile"] = hop::hop_profile(ctx.quick);
    }
    if runs(Section::Picks) {
        out["pick_time"] = routing::pick_time(ctx.quick);
        out["shared_prefix_lookup"] = routing::shared_prefix_lookup(ctx.quick);
    }
    if runs(Section::Scale) {
        out["router_scale"] = routing::router_scale(&ctx).await;
    }
    if runs(Section::Models) {
        out["models"] = json!({
            "pick_time": models::pick_by_models(&ctx).await,
            "first_request": models::cold_card(&ctx).await,
        });
    }
    write_results(&args.json, args.quick, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::path::Path;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("mesh-bench").chain(args.iter().copied()))
    }

    #[test]
    fn flags_parse_as_the_readme_writes_them() {
        Args::command().debug_assert();
        let a = parse(&[]).unwrap();
        assert!(!a.quick);
        assert_eq!(a.json, Path::new("bench/results/mesh.json"));
        assert!(a.only.is_none());
        let a = parse(&["--quick", "--only", "overhead,hop", "--json", "x/y.json"]).unwrap();
        assert!(a.quick);
        assert_eq!(a.json, Path::new("x/y.json"));
        assert_eq!(a.only, Some(vec![Section::Overhead, Section::Hop]));
        let every = "overhead,heterogeneous,bursty,prefix,hop,picks,scale,models";
        assert_eq!(parse(&["--only", every]).unwrap().only.unwrap().len(), 8);
        assert!(parse(&["--only", "nothing"]).is_err());
    }
}
