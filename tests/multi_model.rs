//! One mesh, several models, end to end: a real etcd, a gateway started without `--model`,
//! and workers of different models (the embedded one, and a Qwen2 checkpoint written by
//! transformers' `save_pretrained` given a vocabulary and chat template of its own), one of
//! them disaggregated into prefill and decode nodes.
//!
//! - Each model's greedy output through the gateway is token for token what `kvmesh serve`
//!   of that model gives, for completions and for chat (so each model's own chat template
//!   and tokenizer are used: the gateway has them only from the model cards its workers
//!   gave it).
//! - `/v1/models` lists every model with its context; a model whose last worker is killed
//!   answers 503 with Retry-After, then leaves the list and answers 404, while the other
//!   keeps serving with no failed request; a third model joining appears.
//! - Bad input: an unknown model (404 naming the served ones), no model with several served
//!   (400), a card that does not match its fingerprint (refused, named), a gateway whose
//!   `--model` is another model than its workers' of that name (start-up names both), two
//!   fingerprints under one name (the later refused, `cluster status` says so).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{bin, kvmesh, Server};
use kvmesh_bench::harness::{client, post, status, wait_for, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

/// A temporary folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "kvmesh-multi-model-{}-{what}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The Qwen2 checkpoint transformers wrote, with another vocabulary (every ordinary token's
/// id mirrored: what an id means differs from the embedded model's for all but the special
/// tokens) and another chat template, in `dir/qwen2-other`.
fn other_model(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/hf-qwen2-bf16");
    let out = dir.join("qwen2-other");
    std::fs::create_dir_all(&out).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    let mut tok: Value =
        serde_json::from_slice(&std::fs::read(src.join("tokenizer.json")).unwrap()).unwrap();
    let special: Vec<u64> = tok["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_u64().unwrap())
        .collect();
    let first = special.iter().max().unwrap() + 1;
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let last = vocab.values().map(|v| v.as_u64().unwrap()).max().unwrap();
    for id in vocab.values_mut() {
        let i = id.as_u64().unwrap();
        if i >= first {
            *id = json!(first + last - i);
        }
    }
    std::fs::write(out.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(
        out.join("chat_template.jinja"),
        "{{ bos_token }}{% for m in messages %}<<{{ m['role'] | upper }}>> {{ m['content'] }}\n\
         {% endfor %}{% if add_generation_prompt %}<<ASSISTANT>> {% endif %}",
    )
    .unwrap();
    out
}

fn gateway(etcd: &Etcd, cluster: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "--roles",
        "gateway,router",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ];
    args.extend(["--disagg-min-tokens", "8"]);
    args.extend_from_slice(extra);
    kvmesh().node(etcd, cluster, "gw", &args)
}

/// Runs a gateway node to its end (one that is refused at start-up), with its output.
fn gateway_run(etcd: &Etcd, cluster: &str, id: &str, extra: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args([
            "node",
            "--etcd",
            &etcd.url(),
            "--cluster",
            cluster,
            "--node-id",
            id,
        ])
        .args([
            "--roles",
            "gateway,router",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .output()
        .unwrap()
}

fn completion(model: &str, prompt: &str) -> Value {
    json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

fn chat(model: &str, content: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": content}],
           "max_tokens": 12, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
}

async fn send(http: &reqwest::Client, base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = http
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .expect("reachable");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// What must agree between two servers' answers: the tokens, the text and the prompt's
/// length (a chat template or tokenizer of another model changes the last).
fn essence(v: &Value) -> Value {
    let c = &v["choices"][0];
    json!({
        "token_ids": c["token_ids"],
        "text": c["text"].as_str().or(c["message"]["content"].as_str()),
        "prompt_tokens": v["usage"]["prompt_tokens"],
    })
}

async fn models(http: &reqwest::Client, gw: &Proc) -> Vec<(String, u64)> {
    let v: Value = http
        .get(format!("{}/v1/models", gw.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["owned_by"], "kvmesh", "{m}");
            (
                m["id"].as_str().unwrap().to_string(),
                m["max_model_len"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn names(ms: &[(String, u64)]) -> Vec<&str> {
    ms.iter().map(|(n, _)| n.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gateway_serves_two_models_follows_their_workers_and_a_third_joining() {
    let etcd = Etcd::start();
    let http = client();
    let tmp = TempDir::new("mesh");
    let other = other_model(&tmp.0);
    let other_s = other.to_str().unwrap();
    let cache = tmp.0.join("cache");
    let gw = gateway(&etcd, "mm", &["--cache-dir", cache.to_str().unwrap()]);
    let mut wa = kvmesh().node(
        &etcd,
        "mm",
        "wa",
        &["--roles", "worker", "--backend", "cpu"],
    );
    let cpu_other = ["--backend", "cpu", "--model", other_s];
    let _pb = kvmesh().node(
        &etcd,
        "mm",
        "pb",
        &[&["--roles", "prefill"][..], &cpu_other].concat(),
    );
    let _db = kvmesh().node(
        &etcd,
        "mm",
        "db",
        &[&["--roles", "decode"][..], &cpu_other].concat(),
    );
    wait_for("both models listed", 20, async || {
        models(&http, &gw).await.len() == 2
            && gw
                .metric(
                    &http,
                    "kvmesh:router_prefill_workers_connected{model_name=\"qwen2-other\"}",
                )
                .await
                == 1.0
    })
    .await;
    let listed = models(&http, &gw).await;
    assert_eq!(names(&listed), ["qwen2-other", "shakespeare"]);
    assert!(listed.iter().all(|(_, len)| *len > 0), "{listed:?}");

    // Each model as one `kvmesh serve` gives it.
    let serve_a = Server::start(&["--backend", "cpu"]);
    let serve_b = Server::start(&cpu_other);
    let long = "ROMEO: But soft, what light through yonder window breaks? It is the east.";
    for (model, serve) in [("shakespeare", &serve_a), ("qwen2-other", &serve_b)] {
        for (path, body) in [
            ("/v1/completions", completion(model, long)),
            ("/v1/completions", completion(model, "To be, or not")),
            ("/v1/chat/completions", chat(model, "Who goes there?")),
        ] {
            let (st, mesh) = send(&http, &gw.http, path, &body).await;
            assert_eq!(st, 200, "{model} {path}: {mesh}");
            let (st, alone) = send(&http, &serve.base, path, &body).await;
            assert_eq!(st, 200, "{alone}");
            assert_eq!(
                essence(&mesh),
                essence(&alone),
                "{model} {path}: the mesh's answer differs from kvmesh serve's"
            );
            assert_eq!(mesh["model"], model);
        }
    }
    // The two models really differ in what they read: the same chat, other prompt lengths.
    let (_, a) = send(
        &http,
        &gw.http,
        "/v1/chat/completions",
        &chat("shakespeare", "Hi"),
    )
    .await;
    let (_, b) = send(
        &http,
        &gw.http,
        "/v1/chat/completions",
        &chat("qwen2-other", "Hi"),
    )
    .await;
    assert_ne!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    // The long prompt of the disaggregated model was prefilled on its prefill node.
    let remote = gw
        .metric(
            &http,
            "kvmesh:disagg_decisions_total{model_name=\"qwen2-other\",reason=\"remote\"}",
        )
        .await;
    assert!(remote >= 1.0, "no remote prefill for qwen2-other");
    // The cards were kept on disk, each with its model's family; the disaggregated
    // model's with its KV layout.
    let cards: Vec<Value> = std::fs::read_dir(cache.join("cards"))
        .unwrap()
        .map(|e| serde_json::from_slice(&std::fs::read(e.unwrap().path()).unwrap()).unwrap())
        .collect();
    assert_eq!(cards.len(), 2);
    let card = |name: &str| cards.iter().find(|c| c["name"] == name).unwrap().clone();
    assert_eq!(card("qwen2-other")["architecture"], "Qwen2ForCausalLM");
    assert!(
        card("qwen2-other")["kv_layout"].is_string(),
        "{}",
        card("qwen2-other")["kv_layout"]
    );
    assert_eq!(card("shakespeare")["architecture"], "LlamaForCausalLM");
    assert!(card("shakespeare")["kv_layout"].is_null());

    // Bad input.
    let (st, e) = send(&http, &gw.http, "/v1/completions", &completion("nope", "x")).await;
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["error"]["code"], "model_not_found");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("`qwen2-other`") && msg.contains("`shakespeare`"),
        "{msg}"
    );
    let (st, e) = send(&http, &gw.http, "/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "model");

    // The last worker of one model is killed while the other model serves requests.
    let (h, base) = (http.clone(), gw.http.clone());
    let others = tokio::spawn(async move {
        let mut served = 0;
        for i in 0..30 {
            let (st, v) = send(
                &h,
                &base,
                "/v1/completions",
                &completion("qwen2-other", &format!("{i}")),
            )
            .await;
            assert_eq!(st, 200, "a request for the other model failed: {v}");
            served += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        served
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    wa.kill();
    let mut saw_503 = false;
    wait_for("the killed model's 503, then its 404", 45, async || {
        let r = http
            .post(format!("{}/v1/completions", gw.http))
            .json(&completion("shakespeare", "x"))
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            503 => {
                assert!(
                    r.headers().contains_key("retry-after"),
                    "503 without Retry-After"
                );
                saw_503 = true;
                false
            }
            404 => true,
            200 => false,
            other => panic!("unexpected status {other}: {}", r.text().await.unwrap()),
        }
    })
    .await;
    assert!(
        saw_503,
        "the model went from served to unknown without a 503 in between"
    );
    assert_eq!(names(&models(&http, &gw).await), ["qwen2-other"]);
    assert_eq!(others.await.unwrap(), 30);

    // A third model joins (the embedded model under another name) and is served.
    let _wc = kvmesh().node(
        &etcd,
        "mm",
        "wc",
        &[
            "--roles",
            "worker",
            "--backend",
            "cpu",
            "--served-model-name",
            "bard",
        ],
    );
    wait_for("the third model listed", 20, async || {
        names(&models(&http, &gw).await).contains(&"bard")
    })
    .await;
    let (st, v) = send(
        &http,
        &gw.http,
        "/v1/completions",
        &completion("bard", long),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (_, alone) = send(
        &http,
        &serve_a.base,
        "/v1/completions",
        &completion("shakespeare", long),
    )
    .await;
    assert_eq!(essence(&v), essence(&alone));

    // /status and cluster status group the nodes by model.
    let table = kvmesh().cluster_status(&etcd, "mm");
    assert!(table.contains("-- model qwen2-other"), "{table}");
    assert!(table.contains("-- model bard"), "{table}");
    let pools = status(&http, &gw).await["router"]["pools"].clone();
    let pool_models: Vec<&str> = pools
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["model"].as_str().unwrap())
        .collect();
    assert_eq!(pool_models, ["bard", "qwen2-other"], "{pools}");
}

/// A card changed on its way (its chat template) is refused with the model named, and the
/// request gets a clear error rather than a prompt templated by the wrong template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_that_does_not_match_its_fingerprint_is_refused() {
    let etcd = Etcd::start();
    let http = client();
    let gw = gateway(&etcd, "mc", &[]);
    let _w = kvmesh().node(
        &etcd,
        "mc",
        "w",
        &[
            "--roles",
            "worker",
            "--backend",
            "sim",
            "--debug-tamper-card",
        ],
    );
    wait_for("the model listed", 20, async || {
        !models(&http, &gw).await.is_empty()
    })
    .await;
    let (st, e) = post(&http, &gw.http, completion("shakespeare", "x")).await;
    assert_eq!(st, 502, "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("shakespeare") && msg.contains("fingerprint"),
        "unclear error: {msg}"
    );
}

/// A gateway given `--model` serves that name only with that model: workers serving the
/// name with another model stop its start-up, both fingerprints named. And two workers of
/// one name but different models: the later is refused, and `cluster status` says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_means_one_model() {
    let etcd = Etcd::start();
    let http = client();
    let tmp = TempDir::new("names");
    let other = other_model(&tmp.0);
    let other_s = other.to_str().unwrap();
    let _first = kvmesh().node(
        &etcd,
        "mn",
        "first",
        &["--roles", "worker", "--backend", "sim"],
    );
    // The gateway's --model is another model under the workers' name.
    let out = gateway_run(
        &etcd,
        "mn",
        "gw-x",
        &["--model", other_s, "--served-model-name", "shakespeare"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("first") && err.matches("fingerprint").count() >= 2,
        "start-up does not name both models: {err}"
    );

    let gw = gateway(&etcd, "mn", &[]);
    let _later = kvmesh().node(
        &etcd,
        "mn",
        "later",
        &[
            "--roles",
            "worker",
            "--backend",
            "sim",
            "--model",
            other_s,
            "--served-model-name",
            "shakespeare",
        ],
    );
    wait_for("the later worker refused", 20, async || {
        status(&http, &gw).await["router"]["refused"]
            .as_array()
            .is_some_and(|r| r.iter().any(|w| w["node_id"] == "later"))
    })
    .await;
    // Requests go to the first model's worker, answered with its tokenizer.
    let (st, v) = post(&http, &gw.http, completion("shakespeare", "To be")).await;
    assert_eq!(st, 200, "{v}");
    let table = kvmesh().cluster_status(&etcd, "mn");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("! later") && l.contains("fingerprint")),
        "{table}"
    );
    assert!(table.contains("2 fingerprints under one name"), "{table}");
}

/// The sim backend makes its tokens up, so a sim worker of a model publishes a fingerprint
/// of its own: beside a worker computing the model, under the model's name, it is refused
/// (saying why) and every answer is the model's. A gateway given `--model` stands for the
/// model's math, and with `--backend sim` for sim workers; the wrong one is stopped at
/// start-up naming the sim backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_workers_and_workers_computing_the_model_never_share_a_name() {
    let etcd = Etcd::start();
    let http = client();
    let _real = kvmesh().node(
        &etcd,
        "sc",
        "real",
        &["--roles", "worker", "--backend", "cpu"],
    );
    let gw = gateway(&etcd, "sc", &[]);
    kvmesh_bench::harness::wait_workers(&http, &gw, 1).await;
    let _fake = kvmesh().node(
        &etcd,
        "sc",
        "fake",
        &["--roles", "worker", "--backend", "sim"],
    );
    wait_for("the sim worker refused", 20, async || {
        status(&http, &gw).await["router"]["refused"]
            .as_array()
            .is_some_and(|r| r.iter().any(|w| w["node_id"] == "fake"))
    })
    .await;
    let refused = status(&http, &gw).await["router"]["refused"].to_string();
    assert!(refused.contains("sim backend's tokens"), "{refused}");
    // Every answer is the model's own, as `kvmesh serve` computes it.
    let alone = Server::start(&["--backend", "cpu"]);
    for prompt in ["To be, or not", "ROMEO:", "Who goes there?", "My lord"] {
        let body = completion("shakespeare", prompt);
        let (st, mesh) = send(&http, &gw.http, "/v1/completions", &body).await;
        assert_eq!(st, 200, "{mesh}");
        let (_, want) = send(&http, &alone.base, "/v1/completions", &body).await;
        assert_eq!(
            essence(&mesh),
            essence(&want),
            "{prompt}: not the model's answer"
        );
    }

    // A gateway pinned to a model on disk: with --backend sim it stands for sim workers of
    // it, without it for the model's math and refuses to start beside them.
    let tmp = TempDir::new("sim-pin");
    let other = other_model(&tmp.0);
    let other_s = other.to_str().unwrap();
    let model = ["--model", other_s, "--served-model-name", "q"];
    let _sim_q = kvmesh().node(
        &etcd,
        "sc",
        "sim-q",
        &[&["--roles", "worker", "--backend", "sim"][..], &model].concat(),
    );
    wait_for("the sim worker of q registered", 20, async || {
        kvmesh().cluster_status(&etcd, "sc").contains("sim-q")
    })
    .await;
    let out = gateway_run(&etcd, "sc", "gw-math", &model);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("sim-q") && err.contains("--backend sim"),
        "a gateway pinned to the model's math started beside a sim worker: {err}"
    );
    let sim_gw = kvmesh().node(
        &etcd,
        "sc",
        "gw-sim",
        &[
            &[
                "--roles",
                "gateway,router",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ][..],
            &model,
            &["--backend", "sim"],
        ]
        .concat(),
    );
    wait_for("gw-sim routes to the sim worker of q", 20, async || {
        send(
            &http,
            &sim_gw.http,
            "/v1/completions",
            &completion("q", "Hi"),
        )
        .await
        .0 == 200
    })
    .await;
}
