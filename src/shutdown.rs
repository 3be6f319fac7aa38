//! How `serve` and `node` stop: waiting for SIGINT or SIGTERM, and cutting the streams still
//! open when the grace period ends.

/// The grace period is over: every open stream gets an error event saying it was cut, and
/// a moment to send it, before the server's connections are closed.
pub async fn cut_streams<F: std::future::Future + Unpin>(
    streams: &kvmesh_gateway::StreamCut,
    server: &mut F,
) {
    tracing::warn!(
        "grace period over with HTTP connections still open; ending their streams with an \
         error event and closing them"
    );
    streams.cut();
    let _ = tokio::time::timeout(std::time::Duration::from_millis(500), server).await;
}

/// Resolves when the process is asked to stop (SIGINT, or SIGTERM on Unix).
pub async fn shutdown() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
