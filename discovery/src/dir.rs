//! A registry in a directory, for several processes on one machine without etcd (two nodes
//! sharing one GPU, say): each node's record is a file `<dir>/<cluster>/<node_id>.json`
//! carrying an expiry that its keep-alive pushes forward every TTL/3, and every member reads
//! the directory every [`POLL`]. A record past its expiry is ignored (its node stopped
//! without deregistering, or froze) and removed by the next node that registers the id.
//!
//! Files are written whole and renamed into place, so a reader never sees half a record.
//! The directory must be local to the machine: the expiry is compared with this machine's
//! clock.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::DiscoveryError;
use crate::record::{validate_cluster, validate_record, Membership, NodeRecord};
use crate::registry::{Registered, Registration, Registry};

/// How often members read the directory.
pub const POLL: Duration = Duration::from_millis(100);

/// What a record's file holds.
#[derive(serde::Serialize, serde::Deserialize)]
struct Entry {
    /// Which registration wrote it (a node id registered again gets a new one).
    token: u64,
    /// Unix milliseconds after which the record no longer counts.
    expires_ms: u64,
    record: NodeRecord,
}

/// A [`Registry`] in a directory of this machine.
pub struct DirRegistry {
    dir: PathBuf,
    cluster: String,
    ttl: Duration,
    tx: watch::Sender<Membership>,
    poller: JoinHandle<()>,
}

impl DirRegistry {
    /// The registry for `cluster` under `dir` (created if missing), records kept alive for
    /// `ttl_secs`.
    pub fn open(dir: &Path, cluster: &str, ttl_secs: i64) -> Result<Arc<Self>, DiscoveryError> {
        validate_cluster(cluster)?;
        if ttl_secs < 1 {
            return Err(DiscoveryError::InvalidConfig(format!(
                "the lease TTL must be at least 1 s (got {ttl_secs})"
            )));
        }
        let dir = dir.join(cluster);
        std::fs::create_dir_all(&dir).map_err(|e| {
            DiscoveryError::InvalidConfig(format!(
                "cannot create the registry directory {}: {e}",
                dir.display()
            ))
        })?;
        let (tx, _) = watch::channel(Membership::default());
        tx.send_replace(Arc::new(read_members(&dir, cluster)));
        let poller = {
            let (dir, cluster, tx) = (dir.clone(), cluster.to_string(), tx.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(POLL);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let now = read_members(&dir, &cluster);
                    tx.send_if_modified(|m| {
                        let changed = **m != now;
                        if changed {
                            *m = Arc::new(now.clone());
                        }
                        changed
                    });
                }
            })
        };
        Ok(Arc::new(DirRegistry {
            dir,
            cluster: cluster.to_string(),
            ttl: Duration::from_secs(ttl_secs as u64),
            tx,
            poller,
        }))
    }

    /// The directory the cluster's records are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for DirRegistry {
    fn drop(&mut self) {
        self.poller.abort();
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn file_of(dir: &Path, node_id: &str) -> PathBuf {
    dir.join(format!("{node_id}.json"))
}

/// The entry in `path`, if there is a readable one.
fn read_entry(path: &Path) -> Option<Entry> {
    let bytes = std::fs::read(path).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(e) => Some(e),
        Err(err) => {
            tracing::warn!(path = %path.display(), "ignoring an unreadable node record: {err}");
            None
        }
    }
}

/// The live records of `cluster` in `dir`.
fn read_members(dir: &Path, cluster: &str) -> BTreeMap<String, NodeRecord> {
    let now = now_ms();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| read_entry(&p))
        .filter(|e| e.expires_ms > now && e.record.cluster == cluster)
        .map(|e| (e.record.node_id.clone(), e.record))
        .collect()
}

/// Writes `entry` as `node_id`'s record: whole, then renamed into place.
fn write_entry(dir: &Path, entry: &Entry) -> Result<(), DiscoveryError> {
    let id = &entry.record.node_id;
    let tmp = dir.join(format!(".{id}.{:x}.tmp", entry.token));
    let io = |op: &'static str, e: std::io::Error| DiscoveryError::Directory {
        op,
        dir: dir.display().to_string(),
        reason: e.to_string(),
    };
    std::fs::write(&tmp, serde_json::to_vec(entry)?).map_err(|e| io("write", e))?;
    std::fs::rename(&tmp, file_of(dir, id)).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io("rename", e)
    })
}

#[async_trait::async_trait]
impl Registry for DirRegistry {
    async fn register(&self, record: NodeRecord) -> Result<Registration, DiscoveryError> {
        validate_record(&record, &self.cluster)?;
        let path = file_of(&self.dir, &record.node_id);
        if let Some(e) = read_entry(&path).filter(|e| e.expires_ms > now_ms()) {
            return Err(DiscoveryError::Duplicate {
                node_id: record.node_id.clone(),
                holder: e.record.quic_addr,
            });
        }
        let token = (now_ms() << 20) ^ u64::from(std::process::id());
        let shared = Arc::new(Shared {
            dir: self.dir.clone(),
            ttl: self.ttl,
            token,
            record: std::sync::Mutex::new(record.clone()),
        });
        shared.publish()?;
        let keep = {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(shared.ttl / 3);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    if let Err(e) = shared.publish() {
                        tracing::warn!("keeping the node record alive: {e}");
                    }
                }
            })
        };
        // Readers see the new record at their next poll; this process's own view now.
        let now = read_members(&self.dir, &self.cluster);
        self.tx.send_replace(Arc::new(now));
        Ok(Registration::new(DirRegistration {
            shared,
            keep,
            node_id: record.node_id,
        }))
    }

    async fn list(&self) -> Result<Vec<NodeRecord>, DiscoveryError> {
        Ok(read_members(&self.dir, &self.cluster)
            .into_values()
            .collect())
    }

    fn subscribe(&self) -> watch::Receiver<Membership> {
        self.tx.subscribe()
    }
}

/// What a registration and its keep-alive share.
struct Shared {
    dir: PathBuf,
    ttl: Duration,
    token: u64,
    record: std::sync::Mutex<NodeRecord>,
}

impl Shared {
    /// The record, valid for another TTL; unless another registration of the node id has
    /// taken the file over.
    fn publish(&self) -> Result<(), DiscoveryError> {
        let record = self
            .record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let path = file_of(&self.dir, &record.node_id);
        if let Some(e) = read_entry(&path) {
            if e.token != self.token && e.expires_ms > now_ms() {
                return Err(DiscoveryError::Superseded(record.node_id));
            }
        }
        write_entry(
            &self.dir,
            &Entry {
                token: self.token,
                expires_ms: now_ms() + self.ttl.as_millis() as u64,
                record,
            },
        )
    }
}

struct DirRegistration {
    shared: Arc<Shared>,
    keep: JoinHandle<()>,
    node_id: String,
}

impl Drop for DirRegistration {
    /// Stops the keep-alive: the record lapses after the TTL, as a crashed node's does.
    fn drop(&mut self) {
        self.keep.abort();
    }
}

#[async_trait::async_trait]
impl Registered for DirRegistration {
    async fn deregister(self: Box<Self>) -> Result<(), DiscoveryError> {
        self.keep.abort();
        let path = file_of(&self.shared.dir, &self.node_id);
        if read_entry(&path).is_some_and(|e| e.token == self.shared.token) {
            let _ = std::fs::remove_file(&path);
        }
        Ok(())
    }

    async fn update(&self, record: NodeRecord) -> Result<(), DiscoveryError> {
        if record.node_id != self.node_id {
            return Err(DiscoveryError::InvalidRecord(format!(
                "update changes node_id from {} to {}",
                self.node_id, record.node_id
            )));
        }
        *self.shared.record.lock().unwrap_or_else(|e| e.into_inner()) = record;
        self.shared.publish()
    }

    fn reregistrations(&self) -> u64 {
        0
    }

    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::test_record;

    /// A fresh directory under the system's temporary one.
    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvmesh-dir-registry-{name}-{}-{}",
            std::process::id(),
            now_ms()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    async fn wait_for(rx: &mut watch::Receiver<Membership>, want: &[&str]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let ids: Vec<String> = rx.borrow_and_update().keys().cloned().collect();
            if ids == want {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "members {ids:?}, want {want:?}"
            );
            let _ = tokio::time::timeout(Duration::from_secs(1), rx.changed()).await;
        }
    }

    #[tokio::test]
    async fn two_registries_on_one_directory_see_each_other_and_deregistrations() {
        let d = tmp("see");
        let (r1, r2) = (
            DirRegistry::open(&d, "c", 3).unwrap(),
            DirRegistry::open(&d, "c", 3).unwrap(),
        );
        let other = DirRegistry::open(&d, "other", 3).unwrap();
        let mut rx = r2.subscribe();
        let a = r1.register(test_record("c", "a")).await.unwrap();
        let _b = r2.register(test_record("c", "b")).await.unwrap();
        wait_for(&mut rx, &["a", "b"]).await;
        assert!(other.list().await.unwrap().is_empty(), "clusters apart");
        let mut rec = test_record("c", "a");
        rec.capacity_tokens_per_s = 42.0;
        a.update(rec).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while rx.borrow()["a"].capacity_tokens_per_s != 42.0 {
            assert!(tokio::time::Instant::now() < deadline, "the update arrived");
            let _ = tokio::time::timeout(Duration::from_secs(1), rx.changed()).await;
        }
        a.deregister().await.unwrap();
        wait_for(&mut rx, &["b"]).await;
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn a_live_id_is_refused_and_a_lapsed_one_is_taken_over() {
        let d = tmp("dup");
        let r = DirRegistry::open(&d, "c", 1).unwrap();
        let a = r.register(test_record("c", "a")).await.unwrap();
        let e = r.register(test_record("c", "a")).await.unwrap_err();
        assert!(matches!(e, DiscoveryError::Duplicate { .. }), "{e}");
        // Dropped, not deregistered (a crash): the record lapses after the TTL.
        drop(a);
        let mut rx = r.subscribe();
        wait_for(&mut rx, &[]).await;
        let _a2 = r.register(test_record("c", "a")).await.unwrap();
        wait_for(&mut rx, &["a"]).await;
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn a_keep_alive_holds_the_record_past_its_ttl() {
        let d = tmp("keep");
        let r = DirRegistry::open(&d, "c", 1).unwrap();
        let _a = r.register(test_record("c", "a")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(r.list().await.unwrap().len(), 1, "kept alive for 2.5 TTLs");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn an_unreadable_file_is_skipped_and_bad_settings_are_refused() {
        let d = tmp("bad");
        let r = DirRegistry::open(&d, "c", 3).unwrap();
        std::fs::write(r.dir().join("junk.json"), b"{not json").unwrap();
        let _a = r.register(test_record("c", "a")).await.unwrap();
        assert_eq!(r.list().await.unwrap().len(), 1);
        assert!(matches!(
            DirRegistry::open(&d, "c", 0).err(),
            Some(DiscoveryError::InvalidConfig(_))
        ));
        assert!(DirRegistry::open(&d, "a/b", 3).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
