//! `kvmesh`: one binary for every role of the serving mesh.

mod engines;
mod flags;
mod model_cmd;
mod node;
mod serve;
mod shutdown;
mod trace_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvmesh",
    version,
    about = "A distributed LLM serving mesh: OpenAI API, paged KV cache, continuous batching"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over the OpenAI API, every role in this one process.
    Serve(serve::ServeArgs),
    /// Join a cluster through etcd as a gateway, router and/or worker.
    Node(Box<node::NodeArgs>),
    /// Look at a cluster.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Make and inspect model checkpoints.
    Model {
        #[command(subcommand)]
        command: model_cmd::ModelCommand,
    },
    /// Measure a running OpenAI-compatible server: throughput and TTFT / TPOT / ITL / E2E
    /// latency under a set concurrency or request rate, swept, tabled and charted.
    Bench(kvmesh_loadgen::BenchArgs),
    /// A request's trace across the mesh as a text waterfall (or the recent requests).
    Trace(trace_cmd::TraceArgs),
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// The nodes registered in etcd: roles, addresses, model, device, capacity, load, uptime.
    Status(node::ClusterStatusArgs),
}

fn main() -> anyhow::Result<()> {
    // Steps reuse their activations' memory (see the function).
    kvmesh_gpu::backend::cpu::keep_freed_memory();
    let cli = Cli::parse();
    // serve and node set up tracing themselves (they know their node's name); the other
    // commands only log.
    if !matches!(cli.command, Command::Serve(_) | Command::Node(_)) {
        tracing_subscriber::fmt()
            .with_env_filter(kvmesh_telemetry::log_filter())
            .with_writer(std::io::stderr)
            .init();
    }
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Node(args) => node::run(*args),
        Command::Trace(args) => trace_cmd::run(args),
        Command::Cluster {
            command: ClusterCommand::Status(args),
        } => node::cluster_status(args),
        Command::Model { command } => model_cmd::run(command),
        Command::Bench(args) => kvmesh_loadgen::run(args),
    }
}
