//! Disaggregated prefill and decode, end to end: a real etcd, real `kvmesh node` processes
//! with prefill, decode and gateway roles, and the KV moving between them over QUIC, TCP or
//! in process.
//!
//! - Greedy output through a prefill and a decode worker is token for token what one
//!   aggregated `kvmesh serve` gives, for every model family (Qwen3.5's hybrid models too,
//!   whose recurrent state moves with the KV) and FP8 checkpoints, with prompts longer than
//!   one prefill chunk.
//! - A prefill worker killed or frozen mid-transfer: the decode worker gives up on it and
//!   prefills itself; a decode worker killed or frozen mid-transfer: the prefill worker stops
//!   and frees its blocks, and the router retries the request elsewhere. No request hangs,
//!   no block leaks (KV usage back to 0 on every survivor).
//! - Workers whose KV layouts differ are refused at join, with both sides named.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, kvmesh, Server};
use kvmesh_bench::harness::{client, post, wait_for, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

fn fixture_model(name: &str) -> String {
    format!(
        "{}/tests/fixtures/models/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Prompt token ids, all inside every test model's vocabulary and away from special ids.
fn prompt_ids(n: usize, salt: u64) -> Vec<u64> {
    (0..n as u64)
        .map(|i| 5 + (i * 37 + salt * 11) % 90)
        .collect()
}

fn greedy(prompt: &[u64], max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

fn token_ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v["choices"][0]["token_ids"].clone())
        .unwrap_or_else(|_| panic!("no token ids in {v}"))
}

/// A prefill, a decode and a gateway node for one model, in their own cluster.
struct Trio {
    gateway: Proc,
    decode: Proc,
    _prefill: Option<Proc>,
}

impl Trio {
    /// `engine` flags go to every node; `decode` flags only to the decode node. With
    /// `in_process` one node takes both roles.
    fn start(
        etcd: &Etcd,
        cluster: &str,
        engine: &[&str],
        decode: &[&str],
        in_process: bool,
    ) -> Trio {
        let with = |roles: &str, extra: &[&str]| -> Vec<String> {
            let mut v: Vec<String> = ["--roles", roles].iter().map(|s| s.to_string()).collect();
            v.extend(engine.iter().map(|s| s.to_string()));
            v.extend(extra.iter().map(|s| s.to_string()));
            v
        };
        let start = |id: &str, args: Vec<String>| {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            kvmesh().node(etcd, cluster, id, &a)
        };
        let (prefill, decode) = if in_process {
            let mut extra = decode.to_vec();
            extra.push("--enable-fault-injection");
            (None, start("pd", with("prefill,decode", &extra)))
        } else {
            (
                Some(start("p1", with("prefill", &[]))),
                start("d1", with("decode", decode)),
            )
        };
        let gateway = start(
            "gw",
            with(
                "gateway,router",
                &[
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--disagg-min-tokens",
                    "8",
                ],
            ),
        );
        Trio {
            gateway,
            decode,
            _prefill: prefill,
        }
    }

    /// Waits until the gateway's router has the decode and the prefill role connected.
    async fn ready(&self, http: &reqwest::Client) {
        ready(http, &self.gateway, 1, 1).await;
    }
}

/// Waits until a gateway's router is connected to `decode` decode nodes and `prefill`
/// prefill nodes.
async fn ready(http: &reqwest::Client, gw: &Proc, decode: usize, prefill: usize) {
    wait_for("the router connected to every role", 20, async || {
        gw.try_metric(http, "kvmesh:router_workers_routable").await == Some(decode as f64)
            && gw
                .try_metric(http, "kvmesh:router_prefill_workers_connected")
                .await
                == Some(prefill as f64)
    })
    .await;
}

/// Greedy continuations through prefill + decode equal `kvmesh serve`'s, for each family and
/// for prompts several prefill chunks long, over each transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_greedy_output_equals_aggregated_for_every_family() {
    let etcd = Etcd::start();
    let http = client();
    // (model folder or None for the embedded model, prompt length, transport)
    let cases: Vec<(Option<String>, usize, &str)> = vec![
        (None, 70, "quic"),
        (Some(fixture_model("hf-llama-llama3-f32")), 70, "quic"),
        (Some(fixture_model("hf-qwen2-bf16")), 70, "quic"),
        (Some(fixture_model("hf-qwen3-bias-f32")), 70, "quic"),
        (Some(fixture_model("hf-mistral-window-f32")), 70, "quic"),
        (Some(fixture_model("hf-llama-dynamic-f32")), 20, "quic"),
        (None, 70, "tcp"),
        (None, 70, "ucx-tcp"),
        (None, 40, "auto"),
        (None, 40, "auto-decode-only"),
        (Some(fixture_model("hf-qwen2-bf16")), 70, "ucx-sm"),
        (
            Some(fixture_model("hf-qwen2-yarn-window-f32")),
            70,
            "in-process",
        ),
        // FP8 checkpoints (block-scaled and compressed-tensors): the same on both workers.
        (Some(fixture_model("hf-qwen3-fp8-block")), 70, "quic"),
        (Some(fixture_model("hf-qwen2-fp8-ct")), 70, "tcp"),
        // Qwen3.5: the recurrent state moves with the KV, over every path.
        (Some(fixture_model("hf-qwen35-f32")), 70, "quic"),
        (Some(fixture_model("hf-qwen35-interval-bf16")), 70, "tcp"),
        (Some(fixture_model("hf-qwen35-gqa-bias-f32")), 70, "ucx-sm"),
        (Some(fixture_model("hf-qwen35-cg-bf16")), 70, "in-process"),
        // Qwen3.5 in FP8 (block-scaled Gated DeltaNet projections, the wrapper's layout).
        (Some(fixture_model("hf-qwen35-fp8-block-cg")), 70, "quic"),
    ];
    for (i, (model, len, transport)) in cases.iter().enumerate() {
        let mut engine = SMALL_CPU_ENGINE.to_vec();
        if let Some(m) = model {
            engine.extend(["--model", m.as_str()]);
        }
        let decode_flags: Vec<&str> = match *transport {
            "tcp" => vec!["--kv-transport", "tcp", "--kv-streams", "2"],
            "ucx-tcp" | "ucx-sm" | "auto" => vec!["--kv-streams", "2", "--kv-checksum"],
            // UCX here, none on the prefill node: KV comes over TCP.
            "auto-decode-only" => vec!["--kv-transport", "auto", "--ucx-tls", "tcp"],
            _ => vec!["--kv-streams", "3"],
        };
        // UCX on both ends (the gateway has no KV and starts none).
        let mut node_flags = engine.clone();
        if let Some(tls) = transport.strip_prefix("ucx-") {
            node_flags.extend(["--kv-transport", "ucx", "--ucx-tls", tls]);
        }
        if *transport == "auto" {
            node_flags.extend(["--kv-transport", "auto", "--ucx-tls", "tcp"]);
        }
        let cluster = format!("same-{i}");
        let trio = Trio::start(
            &etcd,
            &cluster,
            &node_flags,
            &decode_flags,
            *transport == "in-process",
        );
        let serve_args: Vec<&str> = engine.to_vec();
        let agg = Server::start(&serve_args);
        trio.ready(&http).await;
        let name = model.as_deref().unwrap_or("shakespeare");
        for salt in 0..2 {
            let p = prompt_ids(*len, salt);
            let (st, want) = post(&http, &agg.base, greedy(&p, 8)).await;
            assert_eq!(st, 200, "{want}");
            let (st, got) = post(&http, &trio.gateway.http, greedy(&p, 8)).await;
            assert_eq!(st, 200, "{name} over {transport}: {got}");
            assert_eq!(
                token_ids(&got),
                token_ids(&want),
                "{name} over {transport}: disaggregated tokens differ from aggregated"
            );
        }
        let remote = trio
            .decode
            .metric(&http, "kvmesh:disagg_prefills_total{outcome=\"remote\"}")
            .await;
        assert_eq!(
            remote, 2.0,
            "{name} over {transport}: both prompts prefilled remotely"
        );
        let bytes = trio
            .decode
            .metric(&http, "kvmesh:kv_transfer_bytes_total{direction=\"in\"}")
            .await;
        assert!(bytes > 0.0, "{name}: KV bytes arrived");
        if *transport != "in-process" {
            // The decode worker computed no prompt token: it decoded from what arrived (a
            // hybrid model's state included), not from a prefill of its own.
            let computed = trio
                .decode
                .metric(&http, "kvmesh:prompt_tokens_total")
                .await;
            assert_eq!(
                computed, 0.0,
                "{name} over {transport}: prefilled on the decode side"
            );
        }
        let via = match *transport {
            t if t.starts_with("ucx") || t == "auto" => "ucx",
            "auto-decode-only" => "tcp",
            t => t,
        };
        let moved = trio
            .decode
            .metric(
                &http,
                &format!("kvmesh:kv_transfers_total{{transport=\"{via}\"}}"),
            )
            .await;
        assert_eq!(moved, 2.0, "{name}: both transfers over {via}");
        println!("{name} over {transport}: same tokens as aggregated, {bytes} KV bytes moved");
        if *transport == "in-process" {
            // Each role is a supervised actor: a crashed prefill role is restarted and the
            // node prefills for itself again.
            let r = http
                .post(format!("{}/debug/crash/prefill", trio.decode.http))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
            wait_for("the prefill role restarted", 10, async || {
                trio.decode
                    .metric(&http, "kvmesh:role_restarts_total{role=\"prefill\"}")
                    .await
                    == 1.0
            })
            .await;
            let p = prompt_ids(*len, 7);
            let (_, want) = post(&http, &agg.base, greedy(&p, 8)).await;
            let (st, got) = post(&http, &trio.gateway.http, greedy(&p, 8)).await;
            assert_eq!(st, 200, "{got}");
            assert_eq!(token_ids(&got), token_ids(&want), "after the restart");
            let remote = trio
                .decode
                .metric(&http, "kvmesh:disagg_prefills_total{outcome=\"remote\"}")
                .await;
            assert_eq!(remote, 3.0, "prefilled by the restarted role");
        }
    }
}

/// A CPU engine with chunks of 16 prompt tokens and 96 KV blocks: the in-process and
/// registry-directory tests' engines and their `kvmesh serve` reference.
const SMALL_CPU_ENGINE: [&str; 6] = [
    "--backend",
    "cpu",
    "--max-num-batched-tokens",
    "16",
    "--num-kv-blocks",
    "96",
];

/// `--no-etcd`: one node with the gateway, router, prefill and decode roles is a whole
/// disaggregated cluster (no etcd), its prompts prefilled by its own prefill engine and handed
/// over in process; greedy output equals `kvmesh serve`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_etcd_is_a_whole_disaggregated_cluster() {
    let http = client();
    let engine = SMALL_CPU_ENGINE;
    let mut args = vec![
        "--roles",
        "gateway,router,prefill,decode",
        "--host",
        "127.0.0.1",
    ];
    args.extend(["--port", "0", "--disagg-min-tokens", "8"]);
    args.extend(engine);
    let solo = kvmesh().node_alone("solo", &args);
    let agg = Server::start(&engine);
    ready(&http, &solo, 1, 1).await;
    two_prompts_as_serve(&http, &agg, &solo.http).await;
    // The router sent both to the prefill role, and the node's /metrics (its gateway's) shows
    // its own engines and KV side too: both prompts prefilled remotely, handed over in
    // process.
    for (series, want) in [
        ("kvmesh:disagg_decisions_total{reason=\"remote\"}", 2.0),
        ("kvmesh:disagg_prefills_total{outcome=\"remote\"}", 2.0),
        ("kvmesh:kv_transfers_total{transport=\"in-process\"}", 2.0),
        // CPU engines' KV is host memory: nothing to hand over on a device.
        (
            "kvmesh:kv_transfers_total{transport=\"in-process-device\"}",
            0.0,
        ),
    ] {
        assert_eq!(solo.metric(&http, series).await, want, "{series}");
    }
}

/// `--registry-dir`: a prefill node and a gateway + router + decode node, two processes of
/// one machine without etcd, find each other through files in one directory; greedy output
/// equals `kvmesh serve`'s with the KV over QUIC between them, and a node that goes away
/// leaves the router's view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_of_one_machine_find_each_other_through_a_registry_directory() {
    let http = client();
    let dir = std::env::temp_dir().join(format!("kvmesh-registry-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let engine = SMALL_CPU_ENGINE;
    let mut pargs = vec!["--roles", "prefill"];
    pargs.extend(engine);
    let prefill = kvmesh().node_in_dir(&dir, "p", &pargs);
    let mut gargs = vec!["--roles", "gateway,router,decode", "--host", "127.0.0.1"];
    gargs.extend(["--port", "0", "--disagg-min-tokens", "8"]);
    gargs.extend(engine);
    let gw = kvmesh().node_in_dir(&dir, "g", &gargs);
    let agg = Server::start(&engine);
    ready(&http, &gw, 1, 1).await;
    let files: Vec<_> = std::fs::read_dir(dir.join("default"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    assert_eq!(files.len(), 2, "one record per node: {files:?}");
    two_prompts_as_serve(&http, &agg, &gw.http).await;
    for (series, want) in [
        ("kvmesh:disagg_prefills_total{outcome=\"remote\"}", 2.0),
        ("kvmesh:kv_transfers_total{transport=\"quic\"}", 2.0),
    ] {
        assert_eq!(gw.metric(&http, series).await, want, "{series}");
    }
    // A prefill node that goes away (killed: its record lapses) leaves the router's view.
    drop(prefill);
    wait_for("the prefill node's record gone", 20, async || {
        gw.try_metric(&http, "kvmesh:router_prefill_workers_connected")
            .await
            == Some(0.0)
    })
    .await;
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two 70-token greedy prompts through the gateway at `base` answer as `agg` does.
async fn two_prompts_as_serve(http: &reqwest::Client, agg: &Server, base: &str) {
    for salt in 0..2 {
        let p = prompt_ids(70, salt);
        let (st, want) = post(http, &agg.base, greedy(&p, 8)).await;
        assert_eq!(st, 200, "{want}");
        let (st, got) = post(http, base, greedy(&p, 8)).await;
        assert_eq!(st, 200, "{got}");
        assert_eq!(token_ids(&got), token_ids(&want), "prompt {salt}");
    }
}

/// Sim workers whose prefill takes long enough (4 ms a token, chunks of 64) that a 400-token
/// prompt is mid-transfer for over a second.
const SLOW_PREFILL: [&str; 8] = [
    "--backend",
    "sim",
    "--sim-prefill-us-per-token",
    "4000",
    "--max-num-batched-tokens",
    "64",
    "--num-kv-blocks",
    "256",
];

fn sim_node(etcd: &Etcd, cluster: &str, id: &str, roles: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["--roles", roles];
    args.extend(SLOW_PREFILL);
    args.extend(extra);
    kvmesh().node(etcd, cluster, id, &args)
}

fn sim_gateway(etcd: &Etcd, cluster: &str) -> Proc {
    let mut args = vec![
        "--roles",
        "gateway,router",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--policy",
        "round-robin",
        "--disagg-min-tokens",
        "32",
    ];
    args.extend(SLOW_PREFILL);
    kvmesh().node(etcd, cluster, "gw", &args)
}

/// What an undisturbed sim worker answers (tokens depend only on the sequence).
async fn sim_reference(prompt: &[u64], max_tokens: usize) -> Vec<u64> {
    let s = Server::start(&["--backend", "sim", "--num-kv-blocks", "256"]);
    let (st, v) = s.post("/v1/completions", greedy(prompt, max_tokens)).await;
    assert_eq!(st, 200, "{v}");
    token_ids(&v)
}

const KV_USAGE: &str = "kvmesh:kv_cache_usage_perc{";

async fn kv_back_to_zero(http: &reqwest::Client, node: &Proc, who: &str) {
    wait_for(&format!("{who}'s KV usage back to 0"), 15, async || {
        node.metric(http, KV_USAGE).await == 0.0
    })
    .await;
}

/// Waits until a transfer is under way: the prefill node computing, the decode node holding
/// blocks for it.
async fn mid_transfer(http: &reqwest::Client, prefill: &Proc, decode: &Proc) {
    wait_for("a transfer under way", 20, async || {
        prefill.metric(http, "kvmesh:num_requests_running{").await >= 1.0
            && decode
                .metric(http, "kvmesh:num_requests_awaiting_kv{")
                .await
                >= 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// A prefill worker SIGKILLed, then another SIGSTOPped, in the middle of a transfer: the
/// decode worker notices, prefills the prompt itself, and the client gets the same tokens
/// an undisturbed run gives. Blocks come back on every survivor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_lost_mid_transfer_costs_no_request_and_no_block() {
    let etcd = Etcd::start();
    for (cluster, flags) in [
        ("pf", vec![]),
        ("pf-ucx", vec!["--kv-transport", "ucx", "--ucx-tls", "tcp"]),
    ] {
        prefill_worker_lost(&etcd, cluster, &flags).await;
    }
}

/// With UCX (one-sided puts) the decode worker also holds the blocks until the stopped
/// sender's streams end (or a bound passes) before prefilling into them.
async fn prefill_worker_lost(etcd: &Etcd, cluster: &str, flags: &[&str]) {
    let http = client();
    let decode_flags = [&["--kv-transfer-timeout", "1"], flags].concat();
    let decode = sim_node(etcd, cluster, "d1", "decode", &decode_flags);
    let mut p1 = sim_node(etcd, cluster, "p1", "prefill", flags);
    let gw = sim_gateway(etcd, cluster);
    ready(&http, &gw, 1, 1).await;

    // A short prompt is not worth a transfer.
    let short = prompt_ids(12, 3);
    let (st, v) = post(&http, &gw.http, greedy(&short, 4)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        gw.metric(
            &http,
            "kvmesh:disagg_decisions_total{reason=\"short_prompt\"}"
        )
        .await,
        1.0
    );

    for (round, how) in ["KILL", "STOP"].into_iter().enumerate() {
        let p = prompt_ids(400, round as u64 + 10);
        let want = sim_reference(&p, 6).await;
        ready(&http, &gw, 1, 1).await;
        let req = {
            let (http, base, body) = (http.clone(), gw.http.clone(), greedy(&p, 6));
            tokio::spawn(async move { post(&http, &base, body).await })
        };
        mid_transfer(&http, &p1, &decode).await;
        let lost_at = Instant::now();
        let frozen = if how == "KILL" {
            p1.kill();
            None
        } else {
            p1.signal("STOP");
            Some(&p1)
        };
        let (st, v) = tokio::time::timeout(Duration::from_secs(30), req)
            .await
            .expect("the request completed")
            .unwrap();
        assert_eq!(
            st, 200,
            "{cluster}: after SIG{how} of the prefill worker: {v}"
        );
        assert_eq!(token_ids(&v), want, "after SIG{how}: the same tokens");
        // Noticed by the link's silence (0.7 s) or the transfer timeout (1 s here), then
        // prefilled here (1.6 s of sim time) in blocks of its own: never after a UCX
        // quarantine of the lent blocks (up to 11 s here), which goes on alone.
        let took = lost_at.elapsed();
        println!("{cluster}: answered {took:?} after SIG{how} of the prefill worker");
        assert!(
            took < Duration::from_secs(8),
            "{cluster}: SIG{how}: {took:?}"
        );
        assert_eq!(
            decode
                .metric(&http, "kvmesh:disagg_prefills_total{outcome=\"fallback\"}")
                .await,
            round as f64 + 1.0,
            "the decode worker prefilled it itself"
        );
        kv_back_to_zero(&http, &decode, "the decode worker").await;
        match frozen {
            Some(p) => {
                // Thawed, it finds its peer gone and frees the blocks it computed into.
                p.signal("CONT");
                kv_back_to_zero(&http, p, "the thawed prefill worker").await;
            }
            None => p1 = sim_node(etcd, cluster, "p2", "prefill", flags),
        }
    }
}

/// A decode worker SIGKILLed, then another SIGSTOPped, while its prompt's KV streams in: the
/// prefill worker stops and frees its blocks, and the router sends the request (which has
/// produced nothing yet) to the other decode worker, where it completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_lost_mid_transfer_frees_the_prefill_worker() {
    let etcd = Etcd::start();
    let http = client();
    let prefill = sim_node(&etcd, "df", "p1", "prefill", &[]);
    let mut d1 = sim_node(&etcd, "df", "d1", "decode", &[]);
    let mut d2 = sim_node(&etcd, "df", "d2", "decode", &[]);
    let gw = sim_gateway(&etcd, "df");
    ready(&http, &gw, 2, 1).await;

    for (round, how) in ["KILL", "STOP"].into_iter().enumerate() {
        let p = prompt_ids(400, round as u64 + 20);
        let want = sim_reference(&p, 6).await;
        let req = {
            let (http, base, body) = (http.clone(), gw.http.clone(), greedy(&p, 6));
            tokio::spawn(async move { post(&http, &base, body).await })
        };
        // Whichever decode worker took it is the one to lose.
        let mut victim = None;
        wait_for(
            "a decode worker holding blocks for the transfer",
            20,
            async || {
                for (i, d) in [&d1, &d2].into_iter().enumerate() {
                    if d.metric(&http, "kvmesh:num_requests_awaiting_kv{").await >= 1.0 {
                        victim = Some(i);
                        return true;
                    }
                }
                false
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (lost, survivor) = if victim == Some(0) {
            (&mut d1, &d2)
        } else {
            (&mut d2, &d1)
        };
        if how == "KILL" {
            lost.kill();
        } else {
            lost.signal("STOP");
        }
        let (st, v) = tokio::time::timeout(Duration::from_secs(40), req)
            .await
            .expect("the request completed")
            .unwrap();
        assert_eq!(st, 200, "after SIG{how} of the decode worker: {v}");
        assert_eq!(token_ids(&v), want, "after SIG{how}: the same tokens");
        kv_back_to_zero(&http, &prefill, "the prefill worker").await;
        kv_back_to_zero(&http, survivor, "the other decode worker").await;
        if how == "STOP" {
            lost.signal("CONT");
            kv_back_to_zero(&http, lost, "the thawed decode worker").await;
        } else {
            // Replace the killed one for the next round.
            let id = if victim == Some(0) { "d3" } else { "d4" };
            *lost = sim_node(&etcd, "df", id, "decode", &[]);
            ready(&http, &gw, 2, 1).await;
        }
    }
}

/// A decode worker whose KV layout differs from a prefill worker's (another block size) is
/// refused at join, naming both nodes and both layouts.
#[test]
fn a_kv_layout_mismatch_is_refused_at_join() {
    let etcd = Etcd::start();
    let _p = kvmesh().node(
        &etcd,
        "mm",
        "p1",
        &[
            "--roles",
            "prefill",
            "--backend",
            "sim",
            "--block-size",
            "16",
        ],
    );
    let mut child = Command::new(bin())
        .args([
            "node",
            "--etcd",
            &etcd.url(),
            "--cluster",
            "mm",
            "--node-id",
            "d1",
        ])
        .args([
            "--roles",
            "decode",
            "--backend",
            "sim",
            "--block-size",
            "32",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the node did not refuse"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    for want in [
        "refusing to join",
        "d1",
        "p1",
        "block size 16",
        "block size 32",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}

/// A prefill worker frozen mid-transfer (SIGSTOP: its sockets stay open, nothing closes)
/// is noticed by its link's silence, as a router notices a worker's: with the default
/// transfer timeout, the decode worker prefills the request itself within about a second of
/// the freeze, over QUIC and over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_prefill_worker_is_noticed_within_a_second() {
    let etcd = Etcd::start();
    for (cluster, flags) in [
        ("frozen-quic", vec![]),
        ("frozen-tcp", vec!["--kv-transport", "tcp"]),
    ] {
        let http = client();
        let decode = sim_node(&etcd, cluster, "d1", "decode", &flags);
        let p1 = sim_node(&etcd, cluster, "p1", "prefill", &flags);
        let gw = sim_gateway(&etcd, cluster);
        ready(&http, &gw, 1, 1).await;
        let p = prompt_ids(400, 77);
        let want = sim_reference(&p, 6).await;
        let req = {
            let (http, base, body) = (http.clone(), gw.http.clone(), greedy(&p, 6));
            tokio::spawn(async move { post(&http, &base, body).await })
        };
        mid_transfer(&http, &p1, &decode).await;
        p1.signal("STOP");
        let frozen = Instant::now();
        let (st, v) = tokio::time::timeout(Duration::from_secs(30), req)
            .await
            .expect("the request completed")
            .unwrap();
        let took = frozen.elapsed();
        assert_eq!(st, 200, "{cluster}: {v}");
        assert_eq!(token_ids(&v), want, "{cluster}: the same tokens");
        // The prompt's own local prefill (400 tokens at 4 ms each in chunks of 64) comes on
        // top of noticing the silence (0.7 s); the transfer timeout alone would be 5 s.
        println!("{cluster}: answered {took:?} after the prefill worker froze");
        assert!(
            took < Duration::from_secs_f64(0.7 + 1.6 + 1.5),
            "{cluster}: {took:?} after the freeze"
        );
        p1.signal("CONT");
        kv_back_to_zero(&http, &decode, "the decode worker").await;
    }
}
