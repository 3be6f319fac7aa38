//! Serving until SIGTERM, then draining: a worker stops taking new requests (its routers see
//! it draining at once) and finishes what it has; a gateway stops accepting connections and
//! finishes its open streams; then the node leaves the cluster.

use std::time::Duration;

use anyhow::Context;

use super::plan::NodePlan;
use super::start::Started;

/// Serves HTTP until the process is signalled, drains for at most `--shutdown-grace`, and
/// leaves the cluster.
pub async fn serve_then_drain(plan: &NodePlan, started: Started) -> anyhow::Result<()> {
    let Started {
        node,
        registry,
        endpoint,
        registration,
        replicas,
        listener,
        app,
        streams,
    } = started;
    let gateway = plan.gateway.is_some();
    // SIGTERM: a worker drains first (its status listener stays up meanwhile, saying so); a
    // gateway stops accepting at once and finishes its open streams.
    let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
    let (drained_tx, drained) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        crate::shutdown::shutdown().await;
        signalled_tx.send_replace(true);
    });
    let http_stop = {
        let mut until = if gateway {
            signalled.clone()
        } else {
            drained.clone()
        };
        async move {
            let _ = until.wait_for(|v| *v).await;
        }
    };
    let server =
        kvmesh_gateway::http::serve(listener, app, plan.network.http_limits.clone(), http_stop);
    tokio::pin!(server);
    let mut server_done = false;
    tokio::select! {
        r = &mut server => {
            r.context("serving HTTP")?;
            server_done = true;
        }
        _ = signalled.wait_for(|v| *v) => {}
    }
    let grace = plan.shutdown_grace;
    let deadline = tokio::time::Instant::now() + grace;
    tracing::info!(
        "shutting down: finishing running requests for at most {:.0} s",
        grace.as_secs_f64()
    );
    for r in &replicas {
        r.serving.start_draining();
    }
    if let Some(serving) = &node.serving {
        serving.start_draining();
        let mut rec = node.record.clone();
        rec.draining = true;
        if let Err(e) = registration.update(rec).await {
            tracing::warn!("could not mark this node draining in the registry: {e}");
        }
        if serving.wait_idle(deadline).await {
            tracing::info!("drained: no request running");
        } else {
            tracing::warn!(
                "grace period over with {} request(s) still running; their routers move them to other workers",
                serving.in_flight()
            );
        }
    }
    for r in &replicas {
        r.serving.wait_idle(deadline).await;
    }
    drained_tx.send_replace(true);
    if !server_done {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left.max(Duration::from_millis(200)), &mut server).await {
            Ok(r) => r.context("serving HTTP")?,
            Err(_) => crate::shutdown::cut_streams(&streams, &mut server).await,
        }
    }
    tracing::info!("leaving the cluster");
    for r in replicas {
        r.leave().await;
    }
    if let Err(e) = registration.deregister().await {
        tracing::warn!("{e}");
    }
    endpoint.close();
    // Give the close frames a moment to leave.
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(registry);
    Ok(())
}
