//! Structured outputs and tool calls, as users' tools ask for them:
//! - through the official OpenAI Python client (tests/py/structured_client.py): Pydantic
//!   `parse`, JSON mode, regex and choice, required and named tool calls, streamed calls,
//!   tool history, `logit_bias`, and 400s naming the field; on the embedded model and on
//!   checkpoints transformers wrote (Qwen2, Llama, Mistral) with each family's tool format;
//! - across the mesh: a constrained greedy output is the same through `kvmesh serve`, through
//!   a prefill + decode pair, and when its worker is SIGKILLed mid-stream (migration).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::{kvmesh, Server};
use kvmesh_bench::harness::{client, wait_for, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The venv's python with openai and pydantic (scripts/client-tools.sh makes it).
fn client_python() -> String {
    let out = Command::new("bash")
        .arg(repo().join("scripts/client-tools.sh"))
        .output()
        .expect("run scripts/client-tools.sh");
    assert!(
        out.status.success(),
        "scripts/client-tools.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A Qwen2.5-style template (system block with the tools, <tool_call> blocks), in this
/// tokenizer's words.
const QWEN_TOOLS: &str = r#"{% if tools %}<|system|>
You may call these functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Answer a call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{% endif %}{% for m in messages %}<|{{ m.role }}|>
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|end|>
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"#;

/// A Llama 3.1-style template: JSON calls with "parameters", tool results as ipython turns.
const LLAMA_TOOLS: &str = r#"{{ bos_token }}{% if tools %}system: Respond with a JSON function call {"name": function name, "parameters": arguments}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{% for m in messages %}{% if m.role == 'tool' %}ipython{% else %}{{ m.role }}{% endif %}: {{ m.content }}{% for c in m.tool_calls or [] %}<|python_tag|>{"name": {{ c.function.name | tojson }}, "parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|end|>
{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"#;

/// A Mistral-style template: [AVAILABLE_TOOLS] and [TOOL_CALLS] as text in this tokenizer.
const MISTRAL_TOOLS: &str = r#"{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}{% if m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}{% endfor %}]{% endif %}{{ eos_token }}{% endif %}{% endfor %}"#;

/// A copy of a transformers-written fixture checkpoint with `template` as its chat template.
fn with_template(fixture: &str, template: &str) -> tempdir::Dir {
    let dir = tempdir::Dir::new(fixture);
    let src = repo().join("tests/fixtures/models").join(fixture);
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    dir
}

mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(tag: &str) -> Dir {
            let p = std::env::temp_dir().join(format!(
                "kvmesh-structured-{tag}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn run_client(python: &str, base: &str, model: &str) {
    let out = Command::new(python)
        .arg(repo().join("tests/py/structured_client.py"))
        .args([base, model])
        .output()
        .expect("run the python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("all ok"),
        "{model}: the OpenAI client checks failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{model}:\n{stdout}");
}

#[test]
fn the_openai_client_gets_structured_outputs_and_tool_calls() {
    let python = client_python();
    let embedded = Server::start(&[]);
    run_client(&python, &embedded.base, "shakespeare");
    drop(embedded);
    for (fixture, template) in [
        ("hf-qwen2-bf16", QWEN_TOOLS),
        ("hf-llama-llama3-f32", LLAMA_TOOLS),
        ("hf-mistral-bf16", MISTRAL_TOOLS),
    ] {
        let dir = with_template(fixture, template);
        let path = dir.path().to_str().unwrap().to_string();
        let s = Server::start(&["--model", &path, "--served-model-name", fixture]);
        run_client(&python, &s.base, fixture);
    }
}

/// A schema-constrained greedy chat request's body.
fn constrained(max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "shakespeare",
        "messages": [{"role": "user", "content": "Name a Veronese and their age."}],
        "max_tokens": max_tokens, "temperature": 0, "stream": stream,
        "return_token_ids": true,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
            "type": "object",
            "properties": {"who": {"type": "string", "maxLength": 40},
                           "age": {"type": "integer"},
                           "lines": {"type": "array", "items": {"type": "string", "maxLength": 30}}},
            "required": ["who", "age", "lines"], "additionalProperties": false}}}
    })
}

async fn whole(http: &reqwest::Client, base: &str, max_tokens: u32) -> (Vec<u64>, String) {
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&constrained(max_tokens, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    let ids = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();
    (
        ids,
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

/// A streamed request's token ids, and whether it ended cleanly.
async fn streamed(http: &reqwest::Client, base: &str, max_tokens: u32) -> (Vec<u64>, bool) {
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&constrained(max_tokens, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.unwrap();
    let mut ids = Vec::new();
    let mut clean = text.contains("data: [DONE]");
    for l in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(v) = serde_json::from_str::<Value>(l) else {
            continue;
        };
        if v.get("error").is_some() {
            clean = false;
        }
        if let Some(a) = v["choices"][0]["token_ids"].as_array() {
            ids.extend(a.iter().filter_map(Value::as_u64));
        }
    }
    (ids, clean)
}

/// The same constrained greedy tokens from one process, a prefill + decode pair, and a
/// migrated stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_holds_across_disaggregation_and_migration() {
    let http = client();
    let max_tokens = 60;
    let serve = Server::start(&[]);
    let (reference, text) = whole(&http, &serve.base, max_tokens).await;
    assert!(!reference.is_empty());
    if reference.len() < max_tokens as usize {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(v["who"].is_string() && v["age"].is_i64(), "{text}");
    }
    drop(serve);

    // Prefill on one node, decode on another: the decode node's matcher starts from the
    // first token the prefill node drew under the same grammar.
    let etcd = Etcd::start();
    let node = |id: &str, roles: &str, extra: &[&str]| -> Proc {
        let mut a = vec!["--roles", roles];
        a.extend_from_slice(extra);
        kvmesh().node(&etcd, "s1", id, &a)
    };
    let _p = node("p1", "prefill", &[]);
    let _d = node("d1", "decode", &[]);
    let gw = node(
        "gw",
        "gateway,router",
        &[
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--disagg-min-tokens",
            "8",
        ],
    );
    wait_for("the router connected to both roles", 20, async || {
        gw.try_metric(&http, "kvmesh:router_workers_routable").await == Some(1.0)
            && gw
                .try_metric(&http, "kvmesh:router_prefill_workers_connected")
                .await
                == Some(1.0)
    })
    .await;
    let (disagg, _) = whole(&http, &gw.http, max_tokens).await;
    assert_eq!(
        disagg, reference,
        "prefill + decode changed the constrained output"
    );
    assert_eq!(
        _d.metric(&http, "kvmesh:disagg_prefills_total{outcome=\"remote\"}")
            .await,
        1.0,
        "the request was not disaggregated"
    );

    // Migration, on sim workers slowed to 40 ms a step (the sim samples under the same
    // grammar): the stream's worker is killed mid-way.
    let slow = ["--sim-decode-ms", "40"];
    let mut w1 = kvmesh().worker(&etcd, "s2", "w1", &slow);
    let gw2 = kvmesh().gateway(&etcd, "s2", "gw", "least-loaded");
    wait_for("w1 routable", 20, async || {
        gw2.try_metric(&http, "kvmesh:router_workers_routable")
            .await
            == Some(1.0)
    })
    .await;
    let (undisturbed, clean) = streamed(&http, &gw2.http, max_tokens).await;
    assert!(clean && !undisturbed.is_empty());
    let task = {
        let (http, base) = (http.clone(), gw2.http.clone());
        tokio::spawn(async move { streamed(&http, &base, max_tokens).await })
    };
    let _w2 = kvmesh().worker(&etcd, "s2", "w2", &slow);
    wait_for("w2 routable", 20, async || {
        gw2.try_metric(&http, "kvmesh:router_workers_routable")
            .await
            == Some(2.0)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    w1.kill();
    let (migrated, clean) = task.await.unwrap();
    assert!(clean, "the stream was cut");
    assert_eq!(
        migrated, undisturbed,
        "migration changed the constrained output"
    );
    assert!(gw2.metric(&http, "kvmesh:migrations_total").await >= 1.0);
}
