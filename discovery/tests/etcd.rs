//! EtcdRegistry against a real etcd server started by each test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_discovery::testing::Etcd;
use kvmesh_discovery::{node_key, DiscoveryError, EtcdRegistry, Membership, NodeRecord, Registry};
use tokio::sync::watch;

const TTL: i64 = 2;

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kvmesh_discovery=debug".into()),
        )
        .with_test_writer()
        .try_init();
}

fn record(cluster: &str, node_id: &str) -> NodeRecord {
    NodeRecord {
        node_id: node_id.to_string(),
        cluster: cluster.to_string(),
        roles: vec![kvmesh_discovery::Role::Worker],
        quic_addr: "127.0.0.1:7001".into(),
        http_url: Some("http://127.0.0.1:8001".into()),
        model: "tiny".into(),
        device: "sim".into(),
        capacity_tokens_per_s: 1000.0,
        max_model_len: 2048,
        block_size: 16,
        cert_sha256: "ab".repeat(32),
        version: env!("CARGO_PKG_VERSION").into(),
        started_unix_ms: 1_700_000_000_000,
        kv_layout: None,
        kv_tcp_addr: None,
        kv_transports: Vec::new(),
        draining: false,
        model_fingerprint: None,
    }
}

async fn connect(etcd: &Etcd, cluster: &str) -> Arc<EtcdRegistry> {
    EtcdRegistry::connect(&etcd.endpoints(), cluster, TTL)
        .await
        .expect("connect to the test etcd")
}

/// Waits until the view satisfies `pred`; panics after `within` with `what` and the last view.
async fn wait_view(
    rx: &mut watch::Receiver<Membership>,
    within: Duration,
    what: &str,
    pred: impl FnMut(&Membership) -> bool,
) -> Membership {
    let result = match tokio::time::timeout(within, rx.wait_for(pred)).await {
        Ok(Ok(view)) => Some(view.clone()),
        Ok(Err(_)) => panic!("membership channel closed while waiting for: {what}"),
        Err(_) => None,
    };
    result.unwrap_or_else(|| {
        panic!(
            "not within {within:?}: {what}; last view: {:?}",
            rx.borrow().keys().collect::<Vec<_>>()
        )
    })
}

/// Polls `list()` on `registry` until `pred` holds.
async fn wait_list(
    registry: &EtcdRegistry,
    within: Duration,
    what: &str,
    mut pred: impl FnMut(&[NodeRecord]) -> bool,
) -> Vec<NodeRecord> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(nodes) = registry.list().await {
            if pred(&nodes) {
                return nodes;
            }
        }
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `cond` until it holds. (A re-registration's put can reach a watcher a moment before
/// the registration's counter is incremented.)
async fn wait_until(within: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn raw_client(etcd: &Etcd) -> etcd_client::Client {
    etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_is_seen_by_another_client_and_deregister_removes_it() {
    init_tracing();
    let etcd = Etcd::start();
    let node = connect(&etcd, "c").await;
    let observer = connect(&etcd, "c").await;
    let mut rx = observer.subscribe();
    assert!(rx.borrow_and_update().is_empty());

    let reg = node.register(record("c", "w1")).await.unwrap();
    let view = wait_view(&mut rx, Duration::from_secs(1), "w1 appears", |m| {
        m.contains_key("w1")
    })
    .await;
    assert_eq!(view["w1"], record("c", "w1"));
    assert_eq!(observer.list().await.unwrap(), vec![record("c", "w1")]);

    // A registry connected later starts from the full view.
    let late = connect(&etcd, "c").await;
    assert!(late.subscribe().borrow().contains_key("w1"));

    // update() is visible to subscribers.
    let mut updated = record("c", "w1");
    updated.capacity_tokens_per_s = 1234.5;
    reg.update(updated.clone()).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w1 updated", |m| {
        m.get("w1") == Some(&updated)
    })
    .await;

    let started = Instant::now();
    reg.deregister().await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w1 gone", |m| m.is_empty()).await;
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(observer.list().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_are_separate_and_records_are_validated() {
    init_tracing();
    let etcd = Etcd::start();
    let a = connect(&etcd, "a").await;
    let b = connect(&etcd, "b").await;
    let _ra = a.register(record("a", "n1")).await.unwrap();
    let mut rx_a = a.subscribe();
    wait_view(&mut rx_a, Duration::from_secs(1), "n1 in a", |m| {
        m.contains_key("n1")
    })
    .await;
    assert!(b.list().await.unwrap().is_empty());
    assert!(b.subscribe().borrow().is_empty());

    let e = b.register(record("a", "n2")).await.unwrap_err();
    assert!(matches!(e, DiscoveryError::InvalidRecord(_)), "{e}");
    let e = b.register(record("b", "x/y")).await.unwrap_err();
    assert!(matches!(e, DiscoveryError::InvalidRecord(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_registration_expires_after_ttl() {
    init_tracing();
    let etcd = Etcd::start();
    let node = connect(&etcd, "c").await;
    let observer = connect(&etcd, "c").await;
    let mut rx = observer.subscribe();

    let reg = node.register(record("c", "crashy")).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "crashy appears", |m| {
        m.contains_key("crashy")
    })
    .await;
    // Keep-alive works: the record outlives several TTLs while the handle lives.
    tokio::time::sleep(Duration::from_secs(TTL as u64 * 2)).await;
    assert!(
        rx.borrow().contains_key("crashy"),
        "expired despite keep-alive"
    );

    drop(reg); // stops keep-alive without revoking, like a crash
    let dropped = Instant::now();
    assert!(
        observer
            .list()
            .await
            .unwrap()
            .iter()
            .any(|r| r.node_id == "crashy"),
        "dropping must not remove the record at once"
    );
    wait_view(
        &mut rx,
        Duration::from_secs(TTL as u64 + 3),
        "crashy expires after the TTL",
        |m| m.is_empty(),
    )
    .await;
    let took = dropped.elapsed();
    assert!(
        took >= Duration::from_millis(TTL as u64 * 1000 / 3),
        "gone after only {took:?}"
    );
}

/// A process too busy to run its tasks for longer than a lease's TTL keeps its lease and
/// its record: keep-alives run on a thread of their own.
#[tokio::test(flavor = "current_thread")]
async fn a_lease_outlives_a_runtime_blocked_past_its_ttl() {
    init_tracing();
    let etcd = Etcd::start();
    let node = connect(&etcd, "c").await;
    let reg = node.register(record("c", "busy")).await.unwrap();
    let mut raw = raw_client(&etcd).await;
    let key = node_key("c", "busy");
    let lease = raw.get(key.as_str(), None).await.unwrap().kvs()[0].lease();
    // The runtime's only thread does nothing else for over twice the TTL.
    std::thread::sleep(Duration::from_secs(TTL as u64 * 2 + 1));
    let now = raw.get(key.as_str(), None).await.unwrap();
    assert_eq!(
        now.kvs().first().map(|kv| kv.lease()),
        Some(lease),
        "the record expired while the runtime was blocked"
    );
    assert_eq!(reg.reregistrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_etcd_kill_and_restart() {
    init_tracing();
    let mut etcd = Etcd::start();
    let node = connect(&etcd, "c").await;
    let observer = connect(&etcd, "c").await;
    let mut rx = observer.subscribe();
    let reg = node.register(record("c", "w1")).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w1 appears", |m| {
        m.contains_key("w1")
    })
    .await;

    etcd.kill();
    // Longer than the TTL: the view must be kept meanwhile, not emptied.
    tokio::time::sleep(Duration::from_secs(TTL as u64 + 1)).await;
    assert!(
        rx.borrow().contains_key("w1"),
        "the view was emptied while etcd was down"
    );
    assert!(observer.list().await.is_err(), "list() with etcd down");

    etcd.restart();
    // The record is still (or again) there and stays there: keep-alive resumed.
    wait_list(&observer, Duration::from_secs(5), "w1 after restart", |n| {
        n.iter().any(|r| r.node_id == "w1")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(TTL as u64 * 2)).await;
    let nodes = observer.list().await.unwrap();
    assert!(
        nodes.iter().any(|r| r.node_id == "w1"),
        "w1 expired after the restart: keep-alive did not resume"
    );

    // The subscriber's watch resumed: it sees a node registered after the restart, using the
    // same registry objects (no process restart).
    let reg2 = node.register(record("c", "w2")).await.unwrap();
    let view = wait_view(&mut rx, Duration::from_secs(5), "w2 after restart", |m| {
        m.contains_key("w2")
    })
    .await;
    assert!(view.contains_key("w1"));

    // And removals still propagate.
    reg2.deregister().await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w2 gone", |m| {
        !m.contains_key("w2")
    })
    .await;
    drop(reg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reregisters_after_etcd_loses_its_data() {
    init_tracing();
    let mut etcd = Etcd::start();
    let node = connect(&etcd, "c").await;
    let observer = connect(&etcd, "c").await;
    let mut rx = observer.subscribe();
    let reg = node.register(record("c", "w1")).await.unwrap();
    // Push the old store's revision well past what the new one will have.
    for i in 0..20 {
        let mut r = record("c", "w1");
        r.capacity_tokens_per_s = i as f64;
        reg.update(r).await.unwrap();
    }
    wait_view(&mut rx, Duration::from_secs(1), "w1 appears", |m| {
        m.get("w1").map(|r| r.capacity_tokens_per_s) == Some(19.0)
    })
    .await;

    etcd.wipe();
    etcd.restart(); // empty store, same ports: the lease no longer exists

    wait_list(
        &observer,
        Duration::from_secs(TTL as u64 + 5),
        "w1 re-registered",
        |n| n.iter().any(|r| r.node_id == "w1"),
    )
    .await;
    wait_until(Duration::from_secs(1), "reregistrations() >= 1", || {
        reg.reregistrations() >= 1
    })
    .await;
    // The watcher notices the store went back and re-reads it; later changes reach it.
    let _reg2 = node.register(record("c", "w2")).await.unwrap();
    wait_view(
        &mut rx,
        Duration::from_secs(5),
        "w1 and w2 after wipe",
        |m| m.contains_key("w1") && m.contains_key("w2"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_lease_is_replaced() {
    init_tracing();
    let etcd = Etcd::start();
    let node = connect(&etcd, "c").await;
    let observer = connect(&etcd, "c").await;
    let mut rx = observer.subscribe();
    let reg = node.register(record("c", "w1")).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w1 appears", |m| {
        m.contains_key("w1")
    })
    .await;
    assert_eq!(reg.reregistrations(), 0);

    let mut raw = raw_client(&etcd).await;
    let key = node_key("c", "w1");
    let lease = raw.get(key.as_str(), None).await.unwrap().kvs()[0].lease();
    assert_ne!(lease, 0, "the record must be attached to a lease");
    raw.lease_revoke(lease).await.unwrap();
    let revoked = Instant::now();
    // The revoke deletes the record and the keep-alive puts it back under a new lease, which
    // can be so soon after that the observer's view never shows it gone (a watch channel
    // keeps the latest view only; CI saw the re-registration 3 ms after the revoke). So the
    // removal is waited for only until the re-registration is seen.
    wait_view(
        &mut rx,
        Duration::from_secs(1),
        "w1 removed by the revoke, or already re-registered",
        |m| !m.contains_key("w1") || reg.reregistrations() >= 1,
    )
    .await;

    // Back within about a TTL (keep-alive runs every TTL/3), under a new lease.
    wait_view(
        &mut rx,
        Duration::from_secs(TTL as u64 + 1),
        "w1 re-registered",
        |m| m.contains_key("w1"),
    )
    .await;
    println!("re-registered {:?} after the revoke", revoked.elapsed());
    wait_until(Duration::from_secs(1), "reregistrations() >= 1", || {
        reg.reregistrations() >= 1
    })
    .await;
    let kvs = raw.get(key.as_str(), None).await.unwrap();
    let new_lease = kvs.kvs()[0].lease();
    assert!(new_lease != 0 && new_lease != lease);

    // The new lease is kept alive too.
    tokio::time::sleep(Duration::from_secs(TTL as u64 * 2)).await;
    assert!(rx.borrow().contains_key("w1"));
    assert_eq!(reg.reregistrations(), 1);

    // update() after a revoke that keep-alive has not noticed yet re-registers on the spot.
    let current = raw.get(key.as_str(), None).await.unwrap().kvs()[0].lease();
    raw.lease_revoke(current).await.unwrap();
    let mut updated = record("c", "w1");
    updated.capacity_tokens_per_s = 7.0;
    reg.update(updated.clone()).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "updated w1", |m| {
        m.get("w1") == Some(&updated)
    })
    .await;
    wait_until(Duration::from_secs(1), "reregistrations() >= 2", || {
        reg.reregistrations() >= 2
    })
    .await;
    reg.deregister().await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w1 gone", |m| m.is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_etcd_fails_fast_naming_the_url() {
    init_tracing();
    // A port nobody listens on (connection refused) ...
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let refused = format!("http://127.0.0.1:{port}");
    // ... and an address that never answers (or is unroutable here).
    let blackhole = "http://10.255.255.1:2379".to_string();
    for url in [refused, blackhole] {
        let started = Instant::now();
        let result = EtcdRegistry::connect(std::slice::from_ref(&url), "c", 3).await;
        let took = started.elapsed();
        let e = match result {
            Ok(_) => panic!("connect to {url} succeeded"),
            Err(e) => e,
        };
        println!("{url}: {e} (after {took:?})");
        assert!(took < Duration::from_secs(5), "{url}: took {took:?}");
        assert!(matches!(e, DiscoveryError::Unreachable { .. }), "{e:?}");
        assert!(
            e.to_string().contains(&url),
            "error does not name {url}: {e}"
        );
    }

    let e = EtcdRegistry::connect(&[], "c", 3).await.err().unwrap();
    assert!(matches!(e, DiscoveryError::InvalidConfig(_)), "{e}");
    let bad = vec!["http://bad host:1".to_string()];
    let e = EtcdRegistry::connect(&bad, "c", 3).await.err().unwrap();
    assert!(matches!(e, DiscoveryError::InvalidConfig(_)), "{e}");
    assert!(e.to_string().contains("bad host"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_are_skipped() {
    init_tracing();
    let etcd = Etcd::start();
    let mut raw = raw_client(&etcd).await;
    // Present before connect (initial get) ...
    raw.put(node_key("c", "bad1"), "{not json", None)
        .await
        .unwrap();
    raw.put(
        node_key("c", "wrong-id"),
        serde_json::to_string(&record("c", "someone-else")).unwrap(),
        None,
    )
    .await
    .unwrap();
    let node = connect(&etcd, "c").await;
    let observer = connect(&etcd, "c").await;
    let mut rx = observer.subscribe();
    assert!(rx.borrow_and_update().is_empty());

    let _w1 = node.register(record("c", "w1")).await.unwrap();
    // ... and arriving through the watch.
    raw.put(node_key("c", "bad2"), "[1, 2", None).await.unwrap();
    raw.put(node_key("c", "w1x"), r#"{"node_id":"w1x"}"#, None)
        .await
        .unwrap();
    let _w2 = node.register(record("c", "w2")).await.unwrap();
    let view = wait_view(&mut rx, Duration::from_secs(1), "w1 and w2", |m| {
        m.contains_key("w1") && m.contains_key("w2")
    })
    .await;
    assert_eq!(view.keys().collect::<Vec<_>>(), ["w1", "w2"]);
    let listed: Vec<String> = observer
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.node_id)
        .collect();
    assert_eq!(listed, ["w1", "w2"]);

    // A good record overwritten with garbage counts as gone; the watcher keeps going.
    raw.put(node_key("c", "w1"), "garbage", None).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w1 dropped", |m| {
        !m.contains_key("w1") && m.contains_key("w2")
    })
    .await;
    let _w3 = node.register(record("c", "w3")).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w3 appears", |m| {
        m.contains_key("w3")
    })
    .await;
}

#[test]
fn testing_etcd_helper_restarts_on_the_same_ports() {
    let mut etcd = Etcd::start();
    let url = etcd.url();
    assert!(etcd.is_running());
    assert!(etcd.data_dir().is_dir());
    etcd.kill();
    assert!(!etcd.is_running());
    etcd.restart();
    assert!(etcd.is_running());
    assert_eq!(etcd.url(), url);
    let dir = etcd.data_dir();
    drop(etcd);
    if std::env::var_os("KVMESH_KEEP_ETCD_DIR").is_none() {
        assert!(!dir.exists(), "the temporary directory was not removed");
    }
}

/// A live node's id is refused to a second registration, naming the holder; a crashed
/// holder's id is taken over once its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_duplicate_node_id_is_refused_and_a_crashed_ones_is_taken_over() {
    init_tracing();
    let etcd = Etcd::start();
    let first = connect(&etcd, "c").await;
    let second = connect(&etcd, "c").await;
    let reg = first.register(record("c", "w1")).await.unwrap();
    let mut other = record("c", "w1");
    other.quic_addr = "127.0.0.1:7999".into();
    let started = Instant::now();
    let e = second.register(other.clone()).await.unwrap_err();
    assert!(matches!(e, DiscoveryError::Duplicate { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("w1") && msg.contains("127.0.0.1:7001") && msg.contains("--node-id"),
        "{msg}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(TTL as u64),
        "refused before the holder could have expired"
    );
    // The first is untouched.
    assert_eq!(first.list().await.unwrap(), vec![record("c", "w1")]);

    // The holder crashes (its keep-alive stops): the id is free within its TTL.
    drop(reg);
    let reg2 = second.register(other.clone()).await.unwrap();
    assert_eq!(first.list().await.unwrap(), vec![other]);
    reg2.deregister().await.unwrap();
}

/// A node whose key an operator deletes puts its record back while it lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_record_is_put_back_by_its_live_node() {
    init_tracing();
    let etcd = Etcd::start();
    let node = connect(&etcd, "c").await;
    let observer = connect(&etcd, "c").await;
    let mut rx = observer.subscribe();
    let _reg = node.register(record("c", "w1")).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(2), "w1 appears", |m| {
        m.contains_key("w1")
    })
    .await;
    let mut raw = raw_client(&etcd).await;
    raw.delete(node_key("c", "w1"), None).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(2), "w1 deleted", |m| {
        !m.contains_key("w1")
    })
    .await;
    let t = Instant::now();
    let view = wait_view(&mut rx, Duration::from_secs(5), "w1 put back", |m| {
        m.contains_key("w1")
    })
    .await;
    assert_eq!(view["w1"], record("c", "w1"));
    println!("record restored after {:?}", t.elapsed());
}

/// Records beside a registration share its lease (one keep-alive for all), are created
/// together when they come at once (several transactions' worth here), are published again
/// with it when the lease is lost, and each leaves on its own `deregister`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_beside_a_registration_share_its_lease_and_follow_it() {
    init_tracing();
    let etcd = Etcd::start();
    let node = connect(&etcd, "b").await;
    let observer = connect(&etcd, "b").await;
    let mut rx = observer.subscribe();
    let reg = node.register(record("b", "w")).await.unwrap();
    const BESIDE: usize = 150;
    let started = (1..=BESIDE).map(|k| node.register_beside(&reg, record("b", &format!("w.{k}"))));
    let mut beside: Vec<_> = futures::future::join_all(started)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    wait_view(&mut rx, Duration::from_secs(2), "all of them", |m| {
        m.len() == BESIDE + 1
    })
    .await;
    let mut raw = raw_client(&etcd).await;
    let lease_of = async |raw: &mut etcd_client::Client, id: &str| {
        let key = node_key("b", id);
        raw.get(key.as_str(), None).await.unwrap().kvs()[0].lease()
    };
    let lease = lease_of(&mut raw, "w").await;
    for id in ["w.1", "w.2", "w.3"] {
        assert_eq!(
            lease_of(&mut raw, id).await,
            lease,
            "{id} has a lease of its own"
        );
    }
    // A duplicate id beside is refused like any other live duplicate.
    let dup = node.register_beside(&reg, record("b", "w.1")).await;
    assert!(dup.is_err(), "a second w.1 was accepted");

    // The lease lost: all are gone, then back under the new lease.
    raw.lease_revoke(lease).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "all gone", |m| {
        m.is_empty()
    })
    .await;
    wait_view(
        &mut rx,
        Duration::from_secs(TTL as u64 + 2),
        "all back",
        |m| m.len() == BESIDE + 1,
    )
    .await;
    let new_lease = lease_of(&mut raw, "w").await;
    assert_ne!(new_lease, lease);
    for id in ["w.1", "w.2", "w.3", "w.150"] {
        assert_eq!(
            lease_of(&mut raw, id).await,
            new_lease,
            "{id} was not moved"
        );
    }
    // An update and a deregister of one touch that one only.
    let mut updated = record("b", "w.2");
    updated.capacity_tokens_per_s = 9.0;
    beside[1].update(updated.clone()).await.unwrap();
    wait_view(&mut rx, Duration::from_secs(1), "w.2 updated", |m| {
        m.get("w.2") == Some(&updated)
    })
    .await;
    beside.remove(0).deregister().await.unwrap();
    wait_view(
        &mut rx,
        Duration::from_secs(1),
        "w.1 gone, the rest kept",
        |m| m.len() == BESIDE && !m.contains_key("w.1"),
    )
    .await;
    reg.deregister().await.unwrap();
    wait_view(
        &mut rx,
        Duration::from_secs(1),
        "the rest gone with the lease",
        |m| m.is_empty(),
    )
    .await;
}

/// A registry that starts beside thousands of records reads them in pages: in one answer,
/// 10,000 records are over what a gRPC client takes in one message, and a router restarted
/// in such a cluster could not join it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_records_are_read_in_pages() {
    init_tracing();
    let etcd = Etcd::start();
    let node = connect(&etcd, "p").await;
    let reg = node.register(record("p", "w")).await.unwrap();
    const BESIDE: usize = 2500;
    let started = (1..=BESIDE).map(|k| node.register_beside(&reg, record("p", &format!("w.{k}"))));
    let _beside: Vec<_> = futures::future::join_all(started)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let late = connect(&etcd, "p").await;
    let view = late.subscribe().borrow().clone();
    assert_eq!(view.len(), BESIDE + 1, "all read at start");
    assert_eq!(view["w.2500"], record("p", "w.2500"));
    assert_eq!(late.list().await.unwrap().len(), BESIDE + 1);
    // Another cluster's records beside the prefix are not read.
    let other = connect(&etcd, "p0").await;
    assert!(other.list().await.unwrap().is_empty());
}
