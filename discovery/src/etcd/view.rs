//! What the membership watch decides, apart from etcd's client: each watch message as plain
//! data ([`WatchMsg`]) applied to the view ([`View::apply`]), and when a lost watch is
//! reported ([`Outage`]). The watcher (`super::Watcher`) only reads etcd and publishes; the
//! rules are tested here without etcd or a clock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::record::{record_model_problem, NodeRecord};

/// The membership: each node's record by id.
pub(super) type Nodes = BTreeMap<String, NodeRecord>;

/// Parses one value under the prefix; anything unusable is skipped with a warning.
pub(super) fn parse_record(prefix: &str, key: &[u8], value: &[u8]) -> Option<(String, NodeRecord)> {
    let key = String::from_utf8_lossy(key);
    let id = key.strip_prefix(prefix)?;
    if id.is_empty() || id.contains('/') {
        warn!(%key, "ignoring a key under the nodes prefix that is not <prefix><node_id>");
        return None;
    }
    match serde_json::from_slice::<NodeRecord>(value) {
        Ok(record) if record.node_id != id => {
            warn!(%key, record_node_id = %record.node_id, "skipping a node record whose node_id does not match its key");
            None
        }
        Ok(record) => match record_model_problem(&record) {
            // Its model cannot be served under that name: left out of the membership, so
            // no router makes a pool of it or sends it requests.
            Some(why) => {
                warn!(%key, "skipping a node record: {why}");
                None
            }
            None => Some((id.to_string(), record)),
        },
        Err(e) => {
            warn!(%key, error = %e, "skipping a malformed node record");
            None
        }
    }
}

/// One message of a watch stream, as the view needs it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum WatchMsg {
    /// The watch began; `head` is etcd's revision then.
    Created { head: i64 },
    /// etcd cancelled the watch: `compacted` is the oldest revision it still keeps when the
    /// asked-for one was compacted away (0 otherwise).
    Canceled { compacted: i64, reason: String },
    /// Changes, in revision order.
    Events(Vec<Change>),
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Change {
    pub(super) put: bool,
    pub(super) key: Vec<u8>,
    pub(super) value: Vec<u8>,
    pub(super) mod_revision: i64,
}

/// What applying a message asks of the watcher.
#[derive(Debug, PartialEq)]
pub(super) enum Applied {
    /// Carry on; `changed`: the membership differs and is to be published.
    Continue { changed: bool },
    /// The watch is established (again): the backoff starts over.
    Resumed,
    /// The view must be rebuilt from a fresh read.
    Resync(String),
    /// The watch is gone; retry, keeping the view.
    Lost(String),
}

/// The membership under a prefix, and the revision it reflects.
pub(super) struct View {
    pub(super) prefix: String,
    pub(super) nodes: Nodes,
    /// Every change up to this revision is in `nodes`.
    pub(super) revision: i64,
}

impl View {
    pub(super) fn apply(&mut self, msg: WatchMsg) -> Applied {
        match msg {
            WatchMsg::Canceled { compacted, reason } => {
                if compacted > 0 {
                    Applied::Resync(format!(
                        "revision {} was compacted (oldest kept: {compacted})",
                        self.revision + 1
                    ))
                } else {
                    Applied::Lost(format!("etcd canceled the watch: {reason}"))
                }
            }
            WatchMsg::Created { head } if head < self.revision => Applied::Resync(format!(
                "etcd's revision went back from {} to {head} (etcd restarted with other or no \
                 data)",
                self.revision
            )),
            WatchMsg::Created { .. } => Applied::Resumed,
            WatchMsg::Events(changes) => {
                let mut changed = false;
                for c in changes {
                    self.revision = self.revision.max(c.mod_revision);
                    let key = String::from_utf8_lossy(&c.key).into_owned();
                    let Some(id) = key.strip_prefix(&self.prefix) else {
                        continue;
                    };
                    if !c.put {
                        changed |= self.nodes.remove(id).is_some();
                        continue;
                    }
                    match parse_record(&self.prefix, &c.key, &c.value) {
                        Some((id, record)) => {
                            if self.nodes.get(&id) != Some(&record) {
                                self.nodes.insert(id, record);
                                changed = true;
                            }
                        }
                        // A record that no longer parses counts as absent.
                        None => changed |= self.nodes.remove(id).is_some(),
                    }
                }
                Applied::Continue { changed }
            }
        }
    }
}

/// When a lost watch is worth a warning: the first loss of an outage is, the retries after
/// it are not, and the return says how long it lasted.
#[derive(Default)]
pub(super) struct Outage {
    since: Option<Instant>,
}

impl Outage {
    /// The watch was lost at `now`: whether this starts an outage (warn) or continues one.
    pub(super) fn lost(&mut self, now: Instant) -> bool {
        if self.since.is_some() {
            return false;
        }
        self.since = Some(now);
        true
    }

    /// The watch is back at `now`: how long it was away, if it was.
    pub(super) fn resumed(&mut self, now: Instant) -> Option<Duration> {
        self.since.take().map(|s| now.saturating_duration_since(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::NodeRecord;

    const PREFIX: &str = "/kvmesh/c/nodes/";

    fn record(id: &str, port: u16) -> Vec<u8> {
        let mut r = crate::record::test_record("c", id);
        r.quic_addr = format!("127.0.0.1:{port}");
        serde_json::to_vec(&r).unwrap()
    }

    fn put(id: &str, port: u16, rev: i64) -> Change {
        Change {
            put: true,
            key: format!("{PREFIX}{id}").into_bytes(),
            value: record(id, port),
            mod_revision: rev,
        }
    }

    fn delete(id: &str, rev: i64) -> Change {
        Change {
            put: false,
            key: format!("{PREFIX}{id}").into_bytes(),
            value: Vec::new(),
            mod_revision: rev,
        }
    }

    fn view() -> View {
        View {
            prefix: PREFIX.into(),
            nodes: Nodes::new(),
            revision: 10,
        }
    }

    fn port(v: &View, id: &str) -> Option<String> {
        v.nodes.get(id).map(|r: &NodeRecord| r.quic_addr.clone())
    }

    #[test]
    fn changes_move_the_view_and_its_revision_and_only_real_changes_count() {
        let mut v = view();
        let a = v.apply(WatchMsg::Events(vec![put("a", 1, 11), put("b", 2, 12)]));
        assert_eq!(a, Applied::Continue { changed: true });
        assert_eq!(v.revision, 12);
        assert_eq!(port(&v, "a").as_deref(), Some("127.0.0.1:1"));
        // The same record again: no change to publish.
        let a = v.apply(WatchMsg::Events(vec![put("a", 1, 13)]));
        assert_eq!(a, Applied::Continue { changed: false });
        assert_eq!(v.revision, 13);
        // A new address, a delete, and a delete of what is not there.
        let a = v.apply(WatchMsg::Events(vec![
            put("a", 9, 14),
            delete("b", 15),
            delete("z", 16),
        ]));
        assert_eq!(a, Applied::Continue { changed: true });
        assert_eq!(port(&v, "a").as_deref(), Some("127.0.0.1:9"));
        assert!(!v.nodes.contains_key("b"));
        assert_eq!(v.revision, 16);
    }

    #[test]
    fn a_record_that_stops_parsing_leaves_and_foreign_keys_are_ignored() {
        let mut v = view();
        v.apply(WatchMsg::Events(vec![put("a", 1, 11)]));
        let mut broken = put("a", 1, 12);
        broken.value = b"{not json".to_vec();
        let outside = Change {
            put: true,
            key: b"/other/prefix/x".to_vec(),
            value: record("x", 3),
            mod_revision: 13,
        };
        let a = v.apply(WatchMsg::Events(vec![broken, outside]));
        assert_eq!(a, Applied::Continue { changed: true });
        assert!(v.nodes.is_empty());
        // The revision still moves past what was seen.
        assert_eq!(v.revision, 13);
    }

    #[test]
    fn compaction_and_a_store_that_went_back_resync_other_cancels_retry() {
        let mut v = view();
        match v.apply(WatchMsg::Canceled {
            compacted: 40,
            reason: String::new(),
        }) {
            Applied::Resync(why) => assert!(why.contains("revision 11 was compacted"), "{why}"),
            other => panic!("{other:?}"),
        }
        match v.apply(WatchMsg::Created { head: 3 }) {
            Applied::Resync(why) => assert!(why.contains("went back from 10 to 3"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(v.apply(WatchMsg::Created { head: 10 }), Applied::Resumed);
        match v.apply(WatchMsg::Canceled {
            compacted: 0,
            reason: "permission denied".into(),
        }) {
            Applied::Lost(why) => assert!(why.contains("permission denied"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_outage_is_reported_once_and_timed_when_it_ends() {
        let t0 = Instant::now();
        let mut o = Outage::default();
        assert_eq!(o.resumed(t0), None);
        assert!(o.lost(t0));
        assert!(!o.lost(t0 + Duration::from_secs(1)));
        assert!(!o.lost(t0 + Duration::from_secs(2)));
        assert_eq!(
            o.resumed(t0 + Duration::from_secs(5)),
            Some(Duration::from_secs(5))
        );
        // A later outage is reported again.
        assert!(o.lost(t0 + Duration::from_secs(9)));
    }
}
