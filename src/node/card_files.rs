//! A gateway's model cards under `--cache-dir` (`DIR/cards/<fingerprint>.json`). Each read,
//! write and removal of a card file runs on a thread of its own and is waited for at most
//! its bound: a file whose read blocks (a hung mount, a FIFO) is given up on with an error
//! naming it, and holds up neither the model's requests, nor the async runtime, nor the
//! process's shutdown. A thread that never comes back is left behind, one per file at most
//! (no second operation on a file starts while one runs), and ends with the process.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvmesh_gpu::card::ModelCard;
use kvmesh_transport::wire::CardReply;
use parking_lot::Mutex;

/// How long a card file's read, write or removal is waited for: a local file takes
/// milliseconds, and a request waiting for its card (at most
/// [`super::catalog::CARD_PATIENCE`]) still has the time to fetch it from a worker.
pub const FILE_PATIENCE: Duration = Duration::from_secs(2);

pub struct CardFiles {
    /// `DIR/cards`.
    dir: PathBuf,
    /// The files an operation is running on.
    busy: Arc<Mutex<BTreeSet<PathBuf>>>,
}

/// Takes its file off the busy set when its operation ends, however it ends.
struct Running {
    busy: Arc<Mutex<BTreeSet<PathBuf>>>,
    path: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.busy.lock().remove(&self.path);
    }
}

impl CardFiles {
    pub fn new(cache_dir: &Path) -> CardFiles {
        CardFiles {
            dir: cache_dir.join("cards"),
            busy: Arc::default(),
        }
    }

    /// The file of `fingerprint`'s card; none for a fingerprint that is not a hex digest
    /// (never a path of its own).
    pub fn path(&self, fingerprint: &str) -> Option<PathBuf> {
        let ok = !fingerprint.is_empty() && fingerprint.chars().all(|c| c.is_ascii_hexdigit());
        ok.then(|| self.dir.join(format!("{fingerprint}.json")))
    }

    /// The card kept for `fingerprint` (`None` when there is none), read within `within`;
    /// an error naming the file when it cannot be read in time or is not a card.
    pub async fn read(
        &self,
        fingerprint: &str,
        within: Duration,
    ) -> Result<Option<ModelCard>, String> {
        let Some(path) = self.path(fingerprint) else {
            return Ok(None);
        };
        let Some(bytes) = bounded(&self.busy, &path, within, "reading", read_card_file).await?
        else {
            return Ok(None);
        };
        // Parsing a card of tens of MB is CPU work: off the async threads too.
        let parsed = tokio::task::spawn_blocking(move || ModelCard::from_bytes(&bytes)).await;
        match parsed {
            Ok(Ok(card)) => Ok(Some(card)),
            Ok(Err(e)) => Err(format!("{}: {e}", path.display())),
            Err(e) => Err(format!("{}: reading the card failed: {e}", path.display())),
        }
    }

    /// Keeps a card's bytes (checked, as a worker sent them) for `fingerprint`: written
    /// whole beside the file, then renamed into place.
    pub async fn store(&self, fingerprint: &str, bytes: Vec<u8>) -> Result<(), String> {
        let Some(path) = self.path(fingerprint) else {
            return Ok(());
        };
        bounded(&self.busy, &path, FILE_PATIENCE, "writing", move |p| {
            let tmp = p.with_extension("json.tmp");
            if let Some(dir) = p.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, p)
        })
        .await
    }

    /// Removes the card kept for `fingerprint` (one that failed its check).
    pub async fn remove(&self, fingerprint: &str) -> Result<(), String> {
        let Some(path) = self.path(fingerprint) else {
            return Ok(());
        };
        bounded(
            &self.busy,
            &path,
            FILE_PATIENCE,
            "removing",
            |p| match std::fs::remove_file(p) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                r => r,
            },
        )
        .await
    }
}

/// A card file's bytes, `None` when there is no file. One longer than any card a worker
/// may send is refused unread.
fn read_card_file(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let file = match std::fs::File::open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        r => r?,
    };
    let max = CardReply::max_card_bytes() as u64;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::other(format!(
            "longer than the {max} bytes a model card may have"
        )));
    }
    Ok(Some(bytes))
}

/// Runs `op` on `path` on a thread of its own and waits for it at most `within`. While an
/// earlier operation on the file still runs (it blocked), none is started.
async fn bounded<T: Send + 'static>(
    busy: &Arc<Mutex<BTreeSet<PathBuf>>>,
    path: &Path,
    within: Duration,
    what: &str,
    op: impl FnOnce(&Path) -> std::io::Result<T> + Send + 'static,
) -> Result<T, String> {
    let shown = path.display();
    if !busy.lock().insert(path.to_path_buf()) {
        return Err(format!(
            "{what} {shown}: an earlier operation on it has not finished (a hung mount, or \
             not a regular file?)"
        ));
    }
    let running = Running {
        busy: busy.clone(),
        path: path.to_path_buf(),
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("card-file".into())
        .spawn(move || {
            let r = op(&running.path);
            drop(running);
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return Err(format!("{what} {shown}: no thread to do it on: {e}"));
    }
    match tokio::time::timeout(within, rx).await {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(e))) => Err(format!("{what} {shown}: {e}")),
        Ok(Err(_)) => Err(format!(
            "{what} {shown}: its thread ended without an answer"
        )),
        Err(_) => Err(format!(
            "{what} {shown} did not finish within {:.1} s (a hung mount, or not a regular \
             file?); given up on",
            within.as_secs_f64()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(what: &str) -> PathBuf {
        let p =
            std::env::temp_dir().join(format!("kvmesh-card-files-{}-{what}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(p.join("cards")).unwrap();
        p
    }

    /// A FIFO no one writes: opening it for reading blocks, as a read on a hung mount does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_card_file_whose_read_blocks_is_given_up_on_in_time_naming_it() {
        let dir = temp_dir("fifo");
        let files = CardFiles::new(&dir);
        let fp = "00ff00ff00ff00ff";
        let path = files.path(fp).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success());
        let t = std::time::Instant::now();
        let e = files
            .read(fp, Duration::from_millis(300))
            .await
            .unwrap_err();
        let waited = t.elapsed();
        assert!(waited < Duration::from_secs(2), "waited {waited:?}");
        assert!(
            e.contains(&path.display().to_string()) && e.contains("within"),
            "{e}"
        );
        // The first read still blocks: a second is not started (no thread per request).
        let e = files.read(fp, Duration::from_secs(5)).await.unwrap_err();
        assert!(e.contains("has not finished"), "{e}");
        // A writer opening and closing the FIFO ends the left-behind read: the file is
        // free again.
        // (On a thread: opening a FIFO to write waits for its reader.)
        let fifo = path.clone();
        std::thread::spawn(move || drop(std::fs::OpenOptions::new().write(true).open(fifo)));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while files.busy.lock().contains(&path) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!files.busy.lock().contains(&path));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_card_file_is_stored_read_back_and_removed() {
        let dir = temp_dir("round-trip");
        let files = CardFiles::new(&dir);
        let m = kvmesh_gpu::model::LoadedModel::from_embedded(&kvmesh_gpu::embedded::DEFAULT_MODEL)
            .unwrap();
        let numerics = kvmesh_gpu::model::Numerics::Model;
        let card = ModelCard::of(&m, numerics, "shakespeare", 512, 16, None).unwrap();
        let fp = card.fingerprint.clone();
        assert_eq!(files.read(&fp, FILE_PATIENCE).await.unwrap(), None);
        files.store(&fp, card.to_bytes()).await.unwrap();
        let back = files.read(&fp, FILE_PATIENCE).await.unwrap();
        assert_eq!(back.as_ref(), Some(&card));
        files.remove(&fp).await.unwrap();
        assert_eq!(files.read(&fp, FILE_PATIENCE).await.unwrap(), None);
        // Not a card: an error naming the file.
        std::fs::write(files.path(&fp).unwrap(), b"{\"format\": 1").unwrap();
        let e = files.read(&fp, FILE_PATIENCE).await.unwrap_err();
        assert!(
            e.contains(&fp) && e.contains("unreadable model card"),
            "{e}"
        );
        // A name that is not a fingerprint is never a path.
        assert_eq!(files.path("../../etc/passwd"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
