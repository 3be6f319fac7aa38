//! Model cards that go wrong, end to end: a real etcd, gateways started without `--model`,
//! and sim workers of the embedded model.
//!
//! - A card kept under `--cache-dir` that parses but fails its check (its chat template
//!   edited, another model's card) is removed and fetched again from the workers: the
//!   request is served, and the good card is kept in its place.
//! - A worker whose card fails its check: every request gets 502 `bad_model_card` while it
//!   is the only one, with the card fetched again at a paced rate (not once a request); a
//!   healthy worker joining serves the model at once.
//! - A kept card file whose read blocks (a FIFO, as a hung mount would): the request is
//!   served within the 10 s a request waits for its card, the log names the file, and
//!   SIGTERM ends the gateway at once though the read never returns.
//! - A card too long for its frame (a tokenizer.json over 64 MiB): the worker stops at
//!   start-up, naming both sizes.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, kvmesh};
use kvmesh_bench::harness::{client, post, wait_for, wait_ready, Proc, Ready};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

/// A temporary folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p =
            std::env::temp_dir().join(format!("kvmesh-model-cards-{}-{what}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const GATEWAY: [&str; 6] = [
    "--roles",
    "gateway,router",
    "--host",
    "127.0.0.1",
    "--port",
    "0",
];

/// A gateway named `id` (each gateway of a test its own: a name is free again only when the
/// lease of a killed one has expired).
fn gateway(etcd: &Etcd, cluster: &str, id: &str, extra: &[&str]) -> Proc {
    let mut args = GATEWAY.to_vec();
    args.extend_from_slice(extra);
    kvmesh().node(etcd, cluster, id, &args)
}

/// A gateway whose log (stderr) goes to `log`.
fn gateway_logged(etcd: &Etcd, cluster: &str, extra: &[&str], log: &Path) -> Proc {
    let mut child = Command::new(bin())
        .args(["node", "--etcd", &etcd.url(), "--cluster", cluster])
        .args(["--node-id", "gw", "--lease-ttl", "2"])
        .args(GATEWAY)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let http = wait_ready(&mut child, Ready::Node, "the gateway");
    Proc { child, http }
}

fn completion() -> Value {
    json!({"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
}

/// Cards fetched from workers with `outcome`, as the gateway counts them.
async fn fetches(http: &reqwest::Client, gw: &Proc, outcome: &str) -> f64 {
    let series = format!("kvmesh:model_card_fetches_total{{outcome=\"{outcome}\"}}");
    gw.try_metric(http, &series).await.unwrap_or(0.0)
}

/// The card file a gateway keeps under `cache`, once there is one.
async fn kept_card(cache: &Path) -> PathBuf {
    let cards = cache.join("cards");
    let find = || {
        std::fs::read_dir(&cards)
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "json"))
    };
    wait_for("the gateway to keep the card", 20, async || {
        find().is_some()
    })
    .await;
    find().unwrap()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Waits (bounded) for `child` to end; its exit status, or `None` when it did not.
fn wait_exit(child: &mut std::process::Child, secs: u64) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_card_that_fails_its_check_is_removed_and_fetched_again() {
    let etcd = Etcd::start();
    let http = client();
    let cache = TempDir::new("kept");
    let cache_s = cache.0.to_str().unwrap();
    let _w = kvmesh().worker(&etcd, "kc", "w", &[]);
    let gw = gateway(&etcd, "kc", "gw", &["--cache-dir", cache_s]);
    let file = kept_card(&cache.0).await;
    let good = read_json(&file);
    drop(gw);

    let mut edited = good.clone();
    edited["chat_template"] = json!("{{ messages[0]['content'] }}");
    let mut foreign = good.clone();
    foreign["fingerprint"] = json!("0123456789abcdef");
    foreign["name"] = json!("another-model");
    for (id, what, bad) in [
        ("gw2", "edited template", edited),
        ("gw3", "another model's", foreign),
    ] {
        std::fs::write(&file, bad.to_string()).unwrap();
        let gw = gateway(&etcd, "kc", id, &["--cache-dir", cache_s]);
        let (st, body) = post(&http, &gw.http, completion()).await;
        assert_eq!(st, 200, "a kept card with an {what} card: {body}");
        // The bad card was removed and the good one fetched (once) and kept in its place.
        wait_for("the good card kept again", 10, async || {
            std::fs::read(&file)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .is_some_and(|v| v == good)
        })
        .await;
        assert_eq!(fetches(&http, &gw, "ok").await, 1.0, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_refused_from_one_worker_is_fetched_from_another_at_a_paced_rate() {
    let etcd = Etcd::start();
    let http = client();
    let gw = gateway(&etcd, "kr", "gw", &[]);
    let _bad = kvmesh().worker(&etcd, "kr", "bad", &["--debug-tamper-card"]);
    // Its card refused once (by the gateway fetching it unasked, or a first request).
    wait_for("the tampered card refused", 20, async || {
        post(&http, &gw.http, completion()).await.0 == 502
    })
    .await;
    let before = fetches(&http, &gw, "refused").await;
    // A burst, then a steady stream for 3.5 s: each refused with the reason...
    let t = Instant::now();
    let burst = (0..20).map(|_| post(&http, &gw.http, completion()));
    let mut answers = futures::future::join_all(burst).await;
    while t.elapsed() < Duration::from_millis(3500) {
        answers.push(post(&http, &gw.http, completion()).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (st, body) in &answers {
        assert_eq!(*st, 502, "{body}");
        assert_eq!(body["error"]["code"], "bad_model_card", "{body}");
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("shakespeare") && msg.contains("fingerprint"),
            "{msg}"
        );
    }
    // ...while the card was fetched again a few times at most (1 s, then 2 s apart), not
    // once a request.
    let refetched = fetches(&http, &gw, "refused").await - before;
    assert!(answers.len() >= 40, "{} requests", answers.len());
    assert!(
        (1.0..=4.0).contains(&refetched),
        "{refetched} fetches for {} requests in 3.5 s",
        answers.len()
    );

    // A healthy worker joins: the card is fetched from it at once, and kept.
    let _good = kvmesh().worker(&etcd, "kr", "good", &[]);
    let waited = wait_for("a request served", 20, async || {
        post(&http, &gw.http, completion()).await.0 == 200
    })
    .await;
    assert!(waited < Duration::from_secs(15), "{waited:?}");
    assert_eq!(fetches(&http, &gw, "ok").await, 1.0);
    for _ in 0..5 {
        let (st, body) = post(&http, &gw.http, completion()).await;
        assert_eq!(st, 200, "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_card_whose_read_blocks_is_passed_over_and_sigterm_still_ends_the_gateway() {
    let etcd = Etcd::start();
    let http = client();
    let _w = kvmesh().worker(&etcd, "kf", "w", &[]);
    // The card's file name (its fingerprint), from a first gateway.
    let first = TempDir::new("fifo-first");
    let gw = gateway(
        &etcd,
        "kf",
        "gw1",
        &["--cache-dir", first.0.to_str().unwrap()],
    );
    let name = kept_card(&first.0).await.file_name().unwrap().to_owned();
    drop(gw);

    // In its place under another cache folder, a FIFO no one writes: opening it blocks.
    let cache = TempDir::new("fifo");
    std::fs::create_dir_all(cache.0.join("cards")).unwrap();
    let fifo = cache.0.join("cards").join(&name);
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let logs = TempDir::new("fifo-log");
    let log = logs.0.join("gateway.log");
    let cache_s = cache.0.to_str().unwrap();
    let mut gw = gateway_logged(&etcd, "kf", &["--cache-dir", cache_s], &log);
    let t = Instant::now();
    let (st, body) = post(&http, &gw.http, completion()).await;
    assert_eq!(st, 200, "{body}");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(10), "served after {took:?}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(&fifo.display().to_string()) && text.contains("did not finish within"),
        "the log does not name the file that blocked:\n{text}"
    );
    // The read still blocks (no one opened the FIFO to write): SIGTERM ends the process.
    gw.signal("TERM");
    let t = Instant::now();
    let status = wait_exit(&mut gw.child, 15);
    assert!(status.is_some(), "the gateway ignored SIGTERM for 15 s");
    assert!(status.unwrap().success(), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(15));
}

/// A copy of the embedded model's folder whose tokenizer.json is padded with whitespace
/// (JSON allows it; the tokenizer is unchanged) to over 64 MiB.
fn model_with_huge_tokenizer(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/shakespeare");
    let out = dir.join("shakespeare-huge");
    std::fs::create_dir_all(&out).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "tokenizer.json" {
            let from = std::fs::canonicalize(e.path()).unwrap();
            std::os::unix::fs::symlink(from, out.join(e.file_name())).unwrap();
        }
    }
    let mut f = std::fs::File::create(out.join("tokenizer.json")).unwrap();
    f.write_all(&std::fs::read(src.join("tokenizer.json")).unwrap())
        .unwrap();
    let spaces = vec![b' '; 1 << 20];
    for _ in 0..64 {
        f.write_all(&spaces).unwrap();
    }
    out
}

#[test]
fn a_card_too_long_for_its_frame_stops_the_worker_at_start_up() {
    let etcd = Etcd::start();
    let tmp = TempDir::new("huge");
    let model = model_with_huge_tokenizer(&tmp.0);
    let tokenizer_len = std::fs::metadata(model.join("tokenizer.json"))
        .unwrap()
        .len();
    assert!(tokenizer_len > 64 << 20);
    let mut child = Command::new(bin())
        .args(["node", "--etcd", &etcd.url(), "--cluster", "kh"])
        .args(["--node-id", "huge", "--roles", "worker", "--backend", "sim"])
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = wait_exit(&mut child, 120);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let text = reader.join().unwrap();
    let status = status.unwrap_or_else(|| panic!("the worker did not stop:\n{text}"));
    assert!(!status.success(), "{text}");
    let max = kvmesh_transport::wire::CardReply::max_card_bytes();
    assert!(
        text.contains("model card of 'shakespeare-huge'")
            && text.contains(&format!("over the {max} bytes"))
            && text.contains(&format!("tokenizer.json alone is {tokenizer_len} bytes"))
            && text.contains("does not start"),
        "unclear error:\n{text}"
    );
    // It never joined: nothing of it is in the registry.
    let table = kvmesh().cluster_status(&etcd, "kh");
    assert!(!table.contains("huge"), "{table}");
}
