//! `kvmesh`: one binary for every role of the serving mesh.

mod embedded;
mod model_cmd;
mod serve;

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
    /// Make and inspect model checkpoints.
    Model {
        #[command(subcommand)]
        command: model_cmd::ModelCommand,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Serve(args) => serve::run(args),
        Command::Model { command } => model_cmd::run(command),
    }
}
