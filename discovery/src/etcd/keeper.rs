//! A thread of its own for a process's registrations: their leases' keep-alives and their
//! record writes run there, over an etcd connection of their own.
//!
//! A node's lease lives a few seconds past its last keep-alive (3 s by default). On the
//! process's runtime, a keep-alive waits its turn behind everything else that is ready: in a
//! process hosting thousands of workers that a restarted router dials at once, that wait
//! was measured at up to 5 s, the lease expired, and every record under it left the
//! membership. Here nothing else runs, so a lease lives as long as its process does.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The thread, its runtime and its etcd client. The thread ends when this is dropped, and
/// the tasks it runs with it.
pub(super) struct Keeper {
    runtime: Handle,
    client: Client,
    _stop: oneshot::Sender<()>,
}

/// Why the lease thread has no connection.
#[derive(Debug, thiserror::Error)]
pub(super) enum KeeperError {
    #[error("cannot start its runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot start a thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("{0}")]
    Connect(#[source] etcd_client::Error),
    #[error("its thread ended")]
    ThreadEnded,
    #[error("no answer within {secs} s")]
    NoAnswer { secs: u64 },
}

impl Keeper {
    /// Starts the thread and connects its client to `endpoints`; `Err` holds why not, as
    /// `Client::connect` or the OS says it. Gives up after `deadline`.
    pub(super) async fn start(
        endpoints: &[String],
        options: ConnectOptions,
        deadline: Duration,
    ) -> Result<Keeper, KeeperError> {
        let (ready, connected) = oneshot::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let endpoints = endpoints.to_vec();
        std::thread::Builder::new()
            .name("etcd-leases".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready.send(Err(KeeperError::Runtime(e)));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match Client::connect(&endpoints, Some(options)).await {
                        Ok(client) => {
                            if ready.send(Ok((client, Handle::current()))).is_ok() {
                                // Runs the tasks spawned here until the keeper is dropped.
                                let _ = stopped.await;
                            }
                        }
                        Err(e) => {
                            let _ = ready.send(Err(KeeperError::Connect(e)));
                        }
                    }
                });
            })
            .map_err(KeeperError::Thread)?;
        match tokio::time::timeout(deadline, connected).await {
            Ok(Ok(Ok((client, runtime)))) => Ok(Keeper {
                runtime,
                client,
                _stop: stop,
            }),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(KeeperError::ThreadEnded),
            Err(_) => Err(KeeperError::NoAnswer {
                secs: deadline.as_secs(),
            }),
        }
    }

    /// The client whose connection this thread drives.
    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    /// Runs `task` on this thread.
    pub(super) fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime.spawn(task)
    }
}
