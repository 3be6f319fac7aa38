//! The etcd registry's own checks.

use super::*;

#[test]
fn parse_skips_bad_values() {
    let prefix = nodes_prefix("c");
    let good = serde_json::to_vec(&crate::record::test_record("c", "a")).unwrap();
    assert!(parse_record(&prefix, b"/kvmesh/c/nodes/a", &good).is_some());
    assert!(parse_record(&prefix, b"/kvmesh/c/nodes/b", &good).is_none());
    assert!(parse_record(&prefix, b"/kvmesh/c/nodes/a", b"{not json").is_none());
    assert!(parse_record(&prefix, b"/kvmesh/c/nodes/", &good).is_none());
    assert!(parse_record(&prefix, b"/kvmesh/c/nodes/x/a", &good).is_none());
    assert!(parse_record(&prefix, b"/other/a", &good).is_none());
}

#[test]
fn parse_skips_a_worker_whose_model_name_cannot_be_served() {
    let prefix = nodes_prefix("c");
    let mut r = crate::record::test_record("c", "a");
    for bad in ["", "  ", "tiny\n", "ti\0ny"] {
        r.model = bad.into();
        let v = serde_json::to_vec(&r).unwrap();
        assert!(
            parse_record(&prefix, b"/kvmesh/c/nodes/a", &v).is_none(),
            "{bad:?}"
        );
    }
    // A router without a model publishes an empty name, and is kept.
    r.roles = vec![crate::Role::Router];
    r.model = String::new();
    let v = serde_json::to_vec(&r).unwrap();
    assert!(parse_record(&prefix, b"/kvmesh/c/nodes/a", &v).is_some());
}

#[test]
fn intervals_and_backoff() {
    assert_eq!(keep_alive_interval(3), Duration::from_secs(1));
    assert_eq!(keep_alive_interval(0), Duration::from_millis(333));
    // The watch's and the keeper's bounds: from 100 ms, never past the maximum.
    let mut b = crate::Backoff::new(BACKOFF_MIN, Duration::from_secs(1));
    let delays: Vec<Duration> = (0..8).map(|_| b.next_delay()).collect();
    assert!(delays[0] <= BACKOFF_MIN);
    assert!(delays.iter().all(|d| *d <= Duration::from_secs(1)));
    b.reset();
    assert!(b.next_delay() <= BACKOFF_MIN);
}

/// A watcher resuming from a compacted revision falls back to a fresh get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_resyncs_after_compaction() {
    let etcd = crate::testing::Etcd::start();
    let mut client = Client::connect([etcd.url()], None).await.unwrap();
    let prefix = nodes_prefix("c");
    let a = serde_json::to_string(&crate::record::test_record("c", "a")).unwrap();
    let b = serde_json::to_string(&crate::record::test_record("c", "b")).unwrap();
    let first = client.put(node_key("c", "a"), a, None).await.unwrap();
    let stale = first.header().unwrap().revision() - 1;
    client.put(node_key("c", "b"), b, None).await.unwrap();
    let head = client.put("/unrelated", "x", None).await.unwrap();
    client
        .compact(head.header().unwrap().revision(), None)
        .await
        .unwrap();

    let (tx, mut rx) = watch::channel(Membership::default());
    let task = tokio::spawn(
        Watcher {
            client: client.clone(),
            endpoints: etcd.url(),
            tx,
            view: View {
                prefix,
                nodes: Nodes::new(),
                revision: stale,
            },
            next_publish: Instant::now(),
            unpublished: false,
        }
        .run(),
    );
    let view = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|m| m.len() == 2))
        .await
        .expect("the watcher did not resync after compaction")
        .unwrap()
        .clone();
    assert_eq!(view.keys().collect::<Vec<_>>(), ["a", "b"]);
    task.abort();
}
