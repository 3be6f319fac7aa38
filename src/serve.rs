//! `kvmesh serve`: the engine and the OpenAI gateway in one process.

use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use kvmesh_gateway::http;
use kvmesh_gateway::tools::ToolFormat;
use kvmesh_gateway::{AppState, OneModel, ServedModel};

use crate::engines::{log_throughput, start_engine, EngineArgs};
use crate::flags::{api_key, tool_call_parser, HttpArgs, TraceFlags, SHUTDOWN_GRACE_S};
use crate::shutdown::{cut_streams, shutdown};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub trace: TraceFlags,
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on /v1 routes.
    #[arg(long, env = "KVMESH_API_KEY", value_parser = api_key)]
    pub api_key: Option<String>,
    /// How the model writes tool calls: hermes, llama3_json or mistral (default: the format
    /// its chat template shows; without one, tool_choice "auto" is refused and "required" or
    /// a named function force calls as a JSON array).
    #[arg(long, value_parser = tool_call_parser)]
    pub tool_call_parser: Option<ToolFormat>,
    /// On SIGTERM: stop accepting connections and give open streams this many seconds to
    /// finish before exiting.
    #[arg(long, default_value_t = SHUTDOWN_GRACE_S)]
    pub shutdown_grace: f64,
    #[command(flatten)]
    pub http: HttpArgs,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let telemetry = args.trace.init("serve")?;
    let e = start_engine(&args.engine)?;
    let model = ServedModel::new(
        e.name,
        e.tokenizer,
        Arc::new(e.handle.clone()),
        e.max_model_len,
    )
    .with_tool_parser(args.tool_call_parser);
    let state = AppState::new(
        Arc::new(OneModel(Arc::new(model))),
        args.api_key.clone(),
        Some(kvmesh_gateway::traces::Traces::new(
            telemetry.store.clone(),
            Box::new(Vec::new),
        )),
    );
    let handle = e.handle;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        tracing::info!("serving the OpenAI API on http://{local}");
        // A line tests and scripts can wait for.
        println!("kvmesh listening on http://{local}");
        tokio::spawn(log_throughput(handle));
        let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown().await;
            signalled_tx.send_replace(true);
        });
        let stop = {
            let mut s = signalled.clone();
            async move {
                let _ = s.wait_for(|v| *v).await;
            }
        };
        let streams = state.streams.clone();
        let server = http::serve(
            listener,
            kvmesh_gateway::router(state),
            args.http.limits(),
            stop,
        );
        tokio::pin!(server);
        tokio::select! {
            r = &mut server => r.context("serving HTTP")?,
            _ = signalled.wait_for(|v| *v) => {
                let grace = std::time::Duration::from_secs_f64(args.shutdown_grace.max(0.0));
                tracing::info!(
                    "shutting down: finishing open streams for at most {:.0} s",
                    grace.as_secs_f64()
                );
                match tokio::time::timeout(grace, &mut server).await {
                    Ok(r) => r.context("serving HTTP")?,
                    Err(_) => cut_streams(&streams, &mut server).await,
                }
            }
        }
        tracing::info!("shut down");
        Ok::<_, anyhow::Error>(())
    })?;
    telemetry.shutdown();
    Ok(())
}
