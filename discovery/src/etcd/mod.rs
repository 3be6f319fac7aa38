//! The etcd-backed registry.
//!
//! Layout: one JSON [`NodeRecord`] per node under [`node_key`], attached to a lease of the
//! registry's TTL. Each [`Registration`] owns a keep-alive task, run on the registry's thread
//! for leases (`keeper`); each [`EtcdRegistry`] owns one watch task that maintains the
//! membership view. Every etcd request is bounded by a timeout:
//! etcd-client's balanced channel can otherwise wait for an unreachable endpoint indefinitely.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use tokio::sync::{watch, Mutex, Notify};
use tokio::task::JoinHandle;

use crate::Backoff;
use tracing::{debug, info, warn};

use crate::error::DiscoveryError;
use crate::record::{
    node_key, nodes_prefix, validate_cluster, validate_record, Membership, NodeRecord,
};
use crate::registry::{Registered, Registration, Registry};

mod beside;
mod keeper;
mod lease;
mod view;

use view::{parse_record, Applied, Change, Nodes, Outage, View, WatchMsg};

/// `connect` gives up after this long (the brief allows ~5 s).
const CONNECT_DEADLINE: Duration = Duration::from_secs(4);
/// Bound on every other request (get, put, grant, revoke, opening a stream).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// Reconnect backoff bounds for the watch and keep-alive tasks.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A [`Registry`] backed by etcd (v3 API; works with etcd 3.4 and later).
pub struct EtcdRegistry {
    client: Client,
    endpoints: String,
    cluster: String,
    prefix: String,
    ttl: i64,
    rx: watch::Receiver<Membership>,
    watcher: JoinHandle<()>,
    /// Where registrations keep their leases alive and write their records.
    keeper: Arc<keeper::Keeper>,
}

impl EtcdRegistry {
    /// Connects to etcd at `endpoints` (e.g. `http://127.0.0.1:2379`; several for an etcd
    /// cluster), for the nodes of `cluster`, with leases of `ttl_secs` seconds
    /// ([`DEFAULT_TTL_SECS`](crate::DEFAULT_TTL_SECS) is 3).
    ///
    /// Reads the current membership before returning, so [`subscribe`](Registry::subscribe)
    /// starts from a complete view, and starts the task that keeps it up to date. Fails within
    /// about 4 s, with an error naming the endpoints, if etcd does not answer.
    pub async fn connect(
        endpoints: &[String],
        cluster: &str,
        ttl_secs: i64,
    ) -> Result<Arc<Self>, DiscoveryError> {
        validate_cluster(cluster)?;
        let eps: Vec<String> = endpoints
            .iter()
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect();
        if eps.is_empty() {
            return Err(DiscoveryError::InvalidConfig(
                "no etcd endpoints given".into(),
            ));
        }
        if ttl_secs < 1 {
            return Err(DiscoveryError::InvalidConfig(format!(
                "the lease TTL must be at least 1 s, got {ttl_secs}"
            )));
        }
        let names = eps.join(",");
        let unreachable = |reason: String| DiscoveryError::Unreachable {
            endpoints: names.clone(),
            reason,
        };
        let no_answer = || {
            unreachable(format!(
                "no answer within {} s (is etcd running and listening there?)",
                CONNECT_DEADLINE.as_secs()
            ))
        };

        let started = Instant::now();
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            // Detect dead connections that never saw a FIN/RST. etcd refuses pings more often
            // than every 5 s (grpc-keepalive-min-time).
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            // Fail requests and streams on a member cut off from its cluster instead of
            // letting a watch hang there silently.
            .with_require_leader(true);
        let client = match tokio::time::timeout(
            CONNECT_DEADLINE,
            Client::connect(&eps, Some(options.clone())),
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(
                e @ (etcd_client::Error::InvalidUri(_) | etcd_client::Error::InvalidArgs(_)),
            )) => {
                return Err(DiscoveryError::InvalidConfig(format!(
                    "etcd endpoints {names}: {e}"
                )))
            }
            Ok(Err(e)) => return Err(unreachable(e.to_string())),
            Err(_) => return Err(no_answer()),
        };
        let prefix = nodes_prefix(cluster);
        let left = CONNECT_DEADLINE.saturating_sub(started.elapsed());
        let (nodes, revision) = match tokio::time::timeout(left, load(&client, &prefix)).await {
            Ok(Ok(loaded)) => loaded,
            Ok(Err(e)) => return Err(unreachable(e.to_string())),
            Err(_) => return Err(no_answer()),
        };
        let left = CONNECT_DEADLINE.saturating_sub(started.elapsed());
        let keeper = keeper::Keeper::start(&eps, options, left)
            .await
            .map_err(|e| unreachable(format!("the connection for leases: {e}")))?;
        info!(endpoints = %names, cluster, nodes = nodes.len(), revision, "connected to etcd");

        let (tx, rx) = watch::channel(Arc::new(nodes.clone()));
        let watcher = tokio::spawn(
            Watcher {
                client: client.clone(),
                endpoints: names.clone(),
                tx,
                view: View {
                    prefix: prefix.clone(),
                    nodes,
                    revision,
                },
                next_publish: Instant::now(),
                unpublished: false,
            }
            .run(),
        );
        Ok(Arc::new(Self {
            client,
            endpoints: names,
            cluster: cluster.to_string(),
            prefix,
            ttl: ttl_secs,
            rx,
            watcher,
            keeper: Arc::new(keeper),
        }))
    }

    /// The endpoints, comma-separated, as used in messages.
    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// The cluster name.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The lease TTL asked for, in seconds.
    pub fn ttl_secs(&self) -> i64 {
        self.ttl
    }

    fn etcd_error(&self, op: &'static str, failure: Failure) -> DiscoveryError {
        failure.into_error(op, &self.endpoints)
    }

    /// Puts the record only where no record of that node id exists. One that does may be a
    /// crashed predecessor's, whose lease expires within its TTL: wait that long (plus a
    /// second) for it to go; one still there is kept alive by a live node, and two nodes
    /// under one id would take each other out of routing, so the registration is refused.
    async fn create(
        &self,
        key: &str,
        node_id: &str,
        value: &str,
        lease: i64,
    ) -> Result<(), DiscoveryError> {
        let mut deadline: Option<Instant> = None;
        let mut warned = false;
        loop {
            let txn = Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key,
                    value,
                    Some(PutOptions::new().with_lease(lease)),
                )])
                .or_else([TxnOp::get(key, None)]);
            let resp = bounded(self.client.kv_client().txn(txn))
                .await
                .map_err(|f| self.etcd_error("put", f))?;
            if resp.succeeded() {
                return Ok(());
            }
            let holder = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                    let rec = serde_json::from_slice::<NodeRecord>(kv.value()).ok();
                    (kv.lease(), rec)
                }),
                _ => None,
            });
            let Some((their_lease, rec)) = holder else {
                continue; // gone between the compare and the get
            };
            let wait = match deadline {
                Some(d) => d,
                None => {
                    let ttl =
                        match bounded(self.client.lease_client().time_to_live(their_lease, None))
                            .await
                        {
                            Ok(t) if t.granted_ttl() > 0 => t.granted_ttl(),
                            _ => self.ttl,
                        };
                    let d = Instant::now() + Duration::from_secs(ttl as u64 + 1);
                    deadline = Some(d);
                    d
                }
            };
            let describe = || match &rec {
                Some(r) => format!(
                    "QUIC {}, roles {}, started at unix ms {}",
                    r.quic_addr,
                    r.roles
                        .iter()
                        .map(|r| r.as_str())
                        .collect::<Vec<_>>()
                        .join(","),
                    r.started_unix_ms
                ),
                None => "an unreadable record".into(),
            };
            if Instant::now() >= wait {
                return Err(DiscoveryError::Duplicate {
                    node_id: node_id.to_string(),
                    holder: describe(),
                });
            }
            if !warned {
                info!(node_id, holder = %describe(), "a record of this node id exists; waiting for its lease to expire (a crashed predecessor) or refusing (a live node)");
                warned = true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for EtcdRegistry {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

#[async_trait::async_trait]
impl Registry for EtcdRegistry {
    async fn register(&self, record: NodeRecord) -> Result<Registration, DiscoveryError> {
        validate_record(&record, &self.cluster)?;
        let value = serde_json::to_string(&record)?;
        let key = node_key(&self.cluster, &record.node_id);
        let (lease, granted_ttl) = grant(&self.client, self.ttl)
            .await
            .map_err(|f| self.etcd_error("lease grant", f))?;
        if let Err(e) = self.create(&key, &record.node_id, &value, lease).await {
            let _ = bounded(self.client.clone().lease_revoke(lease)).await;
            return Err(e);
        }
        info!(
            node_id = %record.node_id,
            key,
            lease = format_args!("{lease:x}"),
            ttl = granted_ttl,
            "registered node in etcd"
        );

        let shared = Arc::new(Shared {
            client: self.keeper.client().clone(),
            _keeper: self.keeper.clone(),
            endpoints: self.endpoints.clone(),
            cluster: self.cluster.clone(),
            node_id: record.node_id,
            key,
            ttl: self.ttl,
            interval: keep_alive_interval(granted_ttl),
            published: Mutex::new(Published {
                value,
                lease,
                dirty: false,
            }),
            lease: AtomicI64::new(lease),
            reregistrations: AtomicU64::new(0),
            lease_replaced: Notify::new(),
            children: Default::default(),
            creating: Default::default(),
        });
        let keeper = self.keeper.spawn(shared.clone().keep_alive());
        Ok(Registration::new(EtcdRegistration { shared, keeper }))
    }

    async fn list(&self) -> Result<Vec<NodeRecord>, DiscoveryError> {
        let (nodes, _) = bounded(load(&self.client, &self.prefix))
            .await
            .map_err(|f| self.etcd_error("get", f))?;
        Ok(nodes.into_values().collect())
    }

    fn subscribe(&self) -> watch::Receiver<Membership> {
        self.rx.clone()
    }
}

/// Records read per request (10,000 in one answer, ~4 MB, are over a gRPC message).
const PAGE: i64 = 1000;

/// Reads every record under `prefix`, a page at a time, all at one revision; returns them
/// with that revision.
async fn load(client: &Client, prefix: &str) -> Result<(Nodes, i64), etcd_client::Error> {
    // The end of the prefix's range: its last byte raised by one ('/' becomes '0').
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = 0;
    let mut nodes = Nodes::new();
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let resp = client.kv_client().get(from.clone(), Some(options)).await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        let kvs = resp.kvs().iter();
        nodes.extend(kvs.filter_map(|kv| parse_record(prefix, kv.key(), kv.value())));
        match resp.kvs().last() {
            Some(kv) if resp.more() => {
                from = kv.key().to_vec();
                from.push(0);
            }
            _ => return Ok((nodes, revision)),
        }
    }
}

/// Why an etcd request failed.
enum Failure {
    Etcd(etcd_client::Error),
    Timeout,
}

impl Failure {
    /// The lease no longer exists (expired, revoked, or etcd lost its data).
    fn is_lease_not_found(&self) -> bool {
        match self {
            Failure::Etcd(etcd_client::Error::LeaseKeepAliveError(m)) => {
                m.contains("lease not found")
            }
            Failure::Etcd(etcd_client::Error::GRpcStatus(s)) => {
                s.message().contains("lease not found")
            }
            _ => false,
        }
    }

    fn into_error(self, op: &'static str, endpoints: &str) -> DiscoveryError {
        DiscoveryError::Etcd {
            op,
            endpoints: endpoints.to_string(),
            reason: self.to_string(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Etcd(e) => write!(f, "{e}"),
            Failure::Timeout => write!(f, "no answer within {} s", REQUEST_TIMEOUT.as_secs()),
        }
    }
}

/// Runs one etcd request with [`REQUEST_TIMEOUT`].
async fn bounded<T>(
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Failure::Etcd(e)),
        Err(_) => Err(Failure::Timeout),
    }
}

/// Grants a lease; returns its id and the TTL etcd actually gave (it may raise small TTLs).
async fn grant(client: &Client, ttl: i64) -> Result<(i64, i64), Failure> {
    let resp = bounded(client.lease_client().grant(ttl, None)).await?;
    Ok((resp.id(), resp.ttl()))
}

/// Puts `value` under `lease` where `key` does not exist; false where it does.
async fn put_if_absent(
    client: &Client,
    key: &str,
    value: &str,
    lease: i64,
) -> Result<bool, Failure> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )]);
    Ok(bounded(client.kv_client().txn(txn)).await?.succeeded())
}

async fn put(client: &Client, key: &str, value: &str, lease: i64) -> Result<(), Failure> {
    let options = PutOptions::new().with_lease(lease);
    bounded(client.kv_client().put(key, value, Some(options))).await?;
    Ok(())
}

fn keep_alive_interval(ttl_secs: i64) -> Duration {
    Duration::from_millis((ttl_secs.max(1) as u64 * 1000 / 3).max(300))
}

// ----- the membership watch -------------------------------------------------------------------

struct Watcher {
    client: Client,
    endpoints: String,
    tx: watch::Sender<Membership>,
    /// The membership and the revision it reflects; what each message does to it is
    /// `View::apply`'s to decide.
    view: View,
    /// When the view may be published next, and whether a change waits for it.
    next_publish: Instant,
    unpublished: bool,
}

/// Views of the membership are published at most this often: while thousands of nodes
/// join, each watch message would otherwise copy the whole membership for every follower.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// How one watch session ended.
enum SessionEnd {
    /// etcd went away or refused; retry with backoff, keeping the view.
    Lost(String),
    /// The view must be rebuilt from a fresh get (compaction, or etcd's store went back).
    Resync(String),
}

impl Watcher {
    async fn run(mut self) {
        let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
        let mut resync = false;
        let mut outage = Outage::default();
        loop {
            let end = self.session(&mut resync, &mut outage, &mut backoff).await;
            if self.unpublished {
                self.publish();
            }
            match end {
                SessionEnd::Resync(reason) => {
                    info!(endpoints = %self.endpoints, prefix = %self.view.prefix, %reason, "re-reading the membership from etcd");
                    resync = true;
                }
                SessionEnd::Lost(reason) => {
                    if outage.lost(Instant::now()) {
                        warn!(
                            endpoints = %self.endpoints,
                            %reason,
                            nodes = self.view.nodes.len(),
                            "lost the etcd watch on the membership; keeping the last known view and reconnecting"
                        );
                    } else {
                        debug!(endpoints = %self.endpoints, %reason, "etcd still unavailable");
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    fn publish(&mut self) {
        self.tx.send_replace(Arc::new(self.view.nodes.clone()));
        self.unpublished = false;
        self.next_publish = Instant::now() + PUBLISH_EVERY;
    }

    /// Publishes a change now, or at `next_publish` if one was published just before.
    fn changed(&mut self) {
        if Instant::now() >= self.next_publish {
            self.publish();
        } else {
            self.unpublished = true;
        }
    }

    async fn session(
        &mut self,
        resync: &mut bool,
        outage: &mut Outage,
        backoff: &mut Backoff,
    ) -> SessionEnd {
        if *resync {
            match bounded(load(&self.client, &self.view.prefix)).await {
                Ok((nodes, revision)) => {
                    if nodes != self.view.nodes {
                        self.view.nodes = nodes;
                        self.publish();
                    }
                    self.view.revision = revision;
                    *resync = false;
                }
                Err(f) => return SessionEnd::Lost(format!("get: {f}")),
            }
        }
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(self.view.revision + 1);
        let mut client = self.client.clone();
        let mut stream = match bounded(client.watch(self.view.prefix.as_str(), Some(options))).await
        {
            Ok(stream) => stream,
            Err(f) => return SessionEnd::Lost(format!("watch: {f}")),
        };
        loop {
            let message = if self.unpublished {
                let due = tokio::time::Instant::from_std(self.next_publish);
                tokio::select! {
                    m = stream.message() => m,
                    _ = tokio::time::sleep_until(due) => {
                        self.publish();
                        continue;
                    }
                }
            } else {
                stream.message().await
            };
            let resp = match message {
                Ok(Some(resp)) => resp,
                Ok(None) => return SessionEnd::Lost("the watch stream ended".into()),
                Err(e) => return SessionEnd::Lost(e.to_string()),
            };
            for msg in watch_msgs(&resp) {
                match self.view.apply(msg) {
                    Applied::Continue { changed } => {
                        if changed {
                            self.changed();
                        }
                    }
                    Applied::Resumed => {
                        backoff.reset();
                        if let Some(after) = outage.resumed(Instant::now()) {
                            info!(
                                endpoints = %self.endpoints,
                                ?after,
                                nodes = self.view.nodes.len(),
                                "etcd is back; the membership watch resumed"
                            );
                        }
                    }
                    Applied::Resync(why) => return SessionEnd::Resync(why),
                    Applied::Lost(why) => return SessionEnd::Lost(why),
                }
            }
        }
    }
}

/// One etcd watch response as the view's messages, in the order they apply: a cancel stands
/// alone; a creation comes before the events that may ride with it.
fn watch_msgs(resp: &etcd_client::WatchResponse) -> Vec<WatchMsg> {
    if resp.canceled() {
        return vec![WatchMsg::Canceled {
            compacted: resp.compact_revision(),
            reason: resp.cancel_reason().to_string(),
        }];
    }
    let mut msgs = Vec::with_capacity(2);
    if resp.created() {
        msgs.push(WatchMsg::Created {
            head: resp.header().map_or(0, |h| h.revision()),
        });
    }
    let changes: Vec<Change> = resp
        .events()
        .iter()
        .filter_map(|event| {
            let kv = event.kv()?;
            Some(Change {
                put: matches!(event.event_type(), EventType::Put),
                key: kv.key().to_vec(),
                value: kv.value().to_vec(),
                mod_revision: kv.mod_revision(),
            })
        })
        .collect();
    if !changes.is_empty() {
        msgs.push(WatchMsg::Events(changes));
    }
    msgs
}

// ----- registrations and their keep-alive ---------------------------------------------------

pub(crate) struct EtcdRegistration {
    shared: Arc<Shared>,
    keeper: JoinHandle<()>,
}

struct Shared {
    /// The keeper's client: requests made with it are driven on the keeper's thread.
    client: Client,
    /// Its thread runs while a registration needs it, the registry gone or not.
    _keeper: Arc<keeper::Keeper>,
    endpoints: String,
    cluster: String,
    node_id: String,
    key: String,
    ttl: i64,
    interval: Duration,
    /// What is (to be) in etcd. Held while publishing, so re-registration and `update` never
    /// interleave.
    published: Mutex<Published>,
    /// Mirror of `published.lease` for the keep-alive task.
    lease: AtomicI64,
    reregistrations: AtomicU64,
    /// Signalled when `update` replaced a lost lease, so the keep-alive task follows.
    lease_replaced: Notify,
    /// Records published under this registration's lease ([`EtcdRegistry::register_beside`]),
    /// published again under a new lease with this one's.
    children: Children,
    /// Records beside it waiting to be created together (`Some` while a batch gathers).
    creating: std::sync::Mutex<Option<Vec<Waiting>>>,
}

/// A record beside a registration waiting to be created with others (see `beside`): its
/// key, its value, and where the lease it went under goes (`None`: the batch failed).
type Waiting = (String, String, tokio::sync::oneshot::Sender<Option<i64>>);

/// One record beside a registration (`beside`): its key and current value.
struct Child {
    key: String,
    node_id: String,
    value: std::sync::Mutex<String>,
}

/// The records beside a registration.
#[derive(Default)]
struct Children(std::sync::Mutex<Vec<std::sync::Weak<Child>>>);

struct Published {
    value: String,
    lease: i64,
    /// `value` has not reached etcd yet (an `update` while etcd was away).
    dirty: bool,
}

impl Shared {
    fn etcd_error(&self, op: &'static str, failure: Failure) -> DiscoveryError {
        failure.into_error(op, &self.endpoints)
    }
}

#[async_trait::async_trait]
impl Registered for EtcdRegistration {
    fn node_id(&self) -> &str {
        &self.shared.node_id
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn reregistrations(&self) -> u64 {
        self.shared.reregistrations.load(Ordering::SeqCst)
    }

    async fn update(&self, record: NodeRecord) -> Result<(), DiscoveryError> {
        let shared = &self.shared;
        validate_record(&record, &shared.cluster)?;
        if record.node_id != shared.node_id {
            return Err(DiscoveryError::InvalidRecord(format!(
                "update changes node_id from {} to {}",
                shared.node_id, record.node_id
            )));
        }
        let value = serde_json::to_string(&record)?;
        let mut published = shared.published.lock().await;
        published.value = value;
        published.dirty = true;
        match put(
            &shared.client,
            &shared.key,
            &published.value,
            published.lease,
        )
        .await
        {
            Ok(()) => {
                published.dirty = false;
                Ok(())
            }
            Err(f) if f.is_lease_not_found() => {
                // The lease is gone and the keep-alive task has not noticed yet.
                let lost = published.lease;
                drop(published);
                if shared.reregister(lost).await {
                    shared.lease_replaced.notify_one();
                    Ok(())
                } else {
                    Err(shared.etcd_error("put", f))
                }
            }
            Err(f) => Err(shared.etcd_error("put", f)),
        }
    }

    async fn deregister(mut self: Box<Self>) -> Result<(), DiscoveryError> {
        self.keeper.abort();
        let _ = (&mut self.keeper).await;
        let shared = &self.shared;
        let published = shared.published.lock().await;
        match bounded(shared.client.lease_client().revoke(published.lease)).await {
            Ok(_) => {
                info!(node_id = %shared.node_id, key = %shared.key, "deregistered node (lease revoked)");
                Ok(())
            }
            // Already expired, so the record is gone too.
            Err(f) if f.is_lease_not_found() => Ok(()),
            Err(f) => Err(DiscoveryError::Etcd {
                op: "lease revoke",
                endpoints: shared.endpoints.clone(),
                reason: format!(
                    "{f}; keep-alive has stopped, so the record expires within {} s",
                    shared.ttl
                ),
            }),
        }
    }
}

impl Drop for EtcdRegistration {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

#[cfg(test)]
mod tests;
