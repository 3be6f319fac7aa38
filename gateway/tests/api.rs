//! The OpenAI API through the gateway's router, with no server and no process: requests go
//! through `tower::ServiceExt::oneshot` to the real router in front of a real engine (the CPU
//! backend, the embedded model) in this process. Validation, error shapes, streaming framing
//! and tool calls, each in milliseconds.

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use kvmesh_gateway::{router, AppState, OneModel, ServedModel};
use kvmesh_gpu::engine::{self, EngineConfig, EngineHandle};
use kvmesh_gpu::guided::LazyGuides;
use kvmesh_gpu::model::{build_backend, BackendKind, KvBudget, LoadedModel};
use serde_json::{json, Value};
use tower::ServiceExt;

const NAME: &str = "shakespeare";

/// One engine for every test of this binary (each test has its own runtime; the engine has
/// its own thread).
fn engine() -> (EngineHandle, Arc<kvmesh_gpu::tokenizer::TextTokenizer>) {
    static ENGINE: OnceLock<(EngineHandle, Arc<kvmesh_gpu::tokenizer::TextTokenizer>)> =
        OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let model = LoadedModel::from_embedded(&kvmesh_gpu::embedded::DEFAULT_MODEL).unwrap();
            let backend = build_backend(
                BackendKind::Cpu(Default::default()),
                &model,
                16,
                KvBudget::Blocks(256),
            )
            .unwrap();
            let cfg = EngineConfig {
                max_model_len: 512,
                ..EngineConfig::default()
            };
            let vocab = model.config.vocab_size;
            let eos = model.tokenizer.eos_ids().to_vec();
            let handle = engine::spawn(backend, cfg, eos, vocab)
                .with_guides(Arc::new(LazyGuides::new(model.tokenizer.clone(), vocab)));
            (handle, model.tokenizer.clone())
        })
        .clone()
}

fn app() -> Router {
    let (handle, tokenizer) = engine();
    let served = ServedModel::new(NAME.into(), tokenizer, Arc::new(handle), 512);
    router(AppState::new(
        Arc::new(OneModel(Arc::new(served))),
        None,
        None,
    ))
}

/// Status, content type and body text of one request.
async fn post_raw(app: &Router, path: &str, body: &str) -> (StatusCode, String, String) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status();
    let ctype = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 24).await.unwrap();
    (status, ctype, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn post(app: &Router, path: &str, body: &Value) -> (StatusCode, Value) {
    let (status, _, text) = post_raw(app, path, &body.to_string()).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

/// The OpenAI error body: every field there, `type` and `param` as given.
fn assert_error(v: &Value, kind: &str, param: Option<&str>, says: &str) {
    let e = &v["error"];
    assert_eq!(e["type"], kind, "{v}");
    assert_eq!(e["param"], param.map_or(Value::Null, Value::from), "{v}");
    assert!(e["code"].is_string() || e["code"].is_null(), "{v}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "`{message}` lacks `{says}`");
}

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

fn completion(extra: Value) -> Value {
    let mut body = json!({"model": NAME, "prompt": "To be, or not to be", "max_tokens": 4});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": NAME, "messages": [{"role": "user", "content": "Speak."}],
                          "max_tokens": 4});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn every_sampling_rule_is_a_400_naming_its_parameter() {
    let app = app();
    let cases = [
        (json!({"max_tokens": 0}), "max_tokens", "at least 1, got 0"),
        (
            json!({"max_completion_tokens": -3}),
            "max_completion_tokens",
            "got -3",
        ),
        (json!({"temperature": -0.5}), "temperature", "0 or more"),
        (json!({"top_p": 0.0}), "top_p", "(0, 1]"),
        (json!({"top_p": 1.5}), "top_p", "got 1.5"),
        (json!({"top_k": -2}), "top_k", "-1 (off)"),
        (json!({"n": 2}), "n", "Only n = 1"),
        (
            json!({"presence_penalty": 0.5}),
            "presence_penalty",
            "not supported",
        ),
        (
            json!({"frequency_penalty": -1.0}),
            "frequency_penalty",
            "not supported",
        ),
        (json!({"stop": ""}), "stop", "must not be empty"),
        (json!({"stop": ["a", ""]}), "stop", "must not be empty"),
        (json!({"seed": -1}), "seed", "0 or more"),
        (
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
            "stream: true",
        ),
    ];
    for (extra, param, says) in cases {
        for (path, body) in [
            (COMPLETIONS, completion(extra.clone())),
            (CHAT, chat(extra.clone())),
        ] {
            let (status, v) = post(&app, path, &body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {extra}: {v}");
            assert_error(&v, "invalid_request_error", Some(param), says);
        }
    }
    // Each endpoint's own logprobs rules.
    let (status, v) = post(&app, COMPLETIONS, &completion(json!({"logprobs": 21}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_error(&v, "invalid_request_error", Some("logprobs"), "21");
    for (extra, says) in [
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "between 0 and 20",
        ),
        (json!({"top_logprobs": 2}), "needs `logprobs: true`"),
    ] {
        let (status, v) = post(&app, CHAT, &chat(extra)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_error(&v, "invalid_request_error", Some("top_logprobs"), says);
    }
}

#[tokio::test]
async fn malformed_bodies_and_unknown_models_get_the_openai_error_shape() {
    let app = app();
    for (path, body) in [
        (COMPLETIONS, "{not json"),
        (COMPLETIONS, "[1, 2]"),
        (CHAT, "\"a string\""),
        (COMPLETIONS, r#"{"model": "shakespeare"}"#),
        (CHAT, r#"{"model": "shakespeare", "messages": "hi"}"#),
        (COMPLETIONS, r#"{"prompt": "a", "max_tokens": "four"}"#),
    ] {
        let (status, ctype, text) = post_raw(&app, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {text}");
        assert!(ctype.starts_with("application/json"), "{ctype}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}: {v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    let (status, v) = post(&app, COMPLETIONS, &completion(json!({"model": "gpt-4"}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("`shakespeare`"));
    let (status, v) = post(&app, "/v1/embeddings", &json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
}

/// The `data:` payloads of an SSE body, checking its framing on the way: every event one
/// `data: ` line followed by a blank line, the last one `[DONE]`.
fn sse_events(text: &str) -> Vec<Value> {
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let mut out = Vec::new();
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let payload = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data event: {event:?}"));
        assert!(!payload.contains('\n'), "one line per event: {event:?}");
        if payload != "[DONE]" {
            out.push(serde_json::from_str(payload).unwrap());
        }
    }
    out
}

#[tokio::test]
async fn a_streamed_completion_is_framed_as_sse_and_says_what_the_plain_one_says() {
    let app = app();
    let greedy = json!({"temperature": 0, "max_tokens": 12, "ignore_eos": true});
    let (status, whole) = post(&app, COMPLETIONS, &completion(greedy.clone())).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 12);
    let text = whole["choices"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty());

    let mut streamed = completion(greedy);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, ctype, body) = post_raw(&app, COMPLETIONS, &streamed.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    let events = sse_events(&body);
    let (usage, chunks) = events.split_last().unwrap();
    // The usage chunk comes last, with no choices; every other chunk has one.
    assert_eq!(usage["choices"], json!([]), "{usage}");
    assert_eq!(usage["usage"]["completion_tokens"], 12, "{usage}");
    let joined: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(joined, text, "streamed and whole greedy text differ");
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
}

#[tokio::test]
async fn a_streamed_chat_opens_with_the_role_and_closes_with_the_reason() {
    let app = app();
    let body = chat(json!({"stream": true, "temperature": 0, "max_tokens": 6,
                           "ignore_eos": true}));
    let (status, _, text) = post_raw(&app, CHAT, &body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events = sse_events(&text);
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk"));
    assert_eq!(
        events[0]["choices"][0]["delta"]["role"], "assistant",
        "{}",
        events[0]
    );
    let last = events.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    let content: String = events
        .iter()
        .map(|e| e["choices"][0]["delta"]["content"].as_str().unwrap_or(""))
        .collect();
    assert!(!content.is_empty());
}

#[tokio::test]
async fn a_named_tool_choice_comes_back_as_a_parsed_call() {
    let app = app();
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}}]);
    let body = chat(json!({"tools": tools, "max_tokens": 96, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}));
    let (status, v) = post(&app, CHAT, &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()));
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .expect("arguments are a JSON string");
    assert!(
        args["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 12),
        "{args}"
    );
    assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
    // A tool the request does not define is refused, naming the field.
    let body = chat(json!({"tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}}));
    let (status, v) = post(&app, CHAT, &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "tool_choice", "{v}");
}

#[tokio::test]
async fn a_stop_string_ends_the_text_before_it_and_says_stop() {
    let app = app();
    let greedy = json!({"temperature": 0, "max_tokens": 24, "ignore_eos": true});
    let (_, whole) = post(&app, COMPLETIONS, &completion(greedy.clone())).await;
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string from the middle of what the model says anyway.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut body = completion(greedy);
    body["stop"] = json!([stop]);
    let (status, v) = post(&app, COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let cut = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        cut,
        &text[..text.find(&stop).unwrap()],
        "stop {stop:?} in {text:?}"
    );
}

#[tokio::test]
async fn logprobs_come_with_as_many_alternatives_as_asked() {
    let app = app();
    let body = completion(json!({"temperature": 0, "max_tokens": 3, "logprobs": 4,
                                 "ignore_eos": true}));
    let (status, v) = post(&app, COMPLETIONS, &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3, "{lp}");
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(top.len() <= 4 && !top.is_empty(), "{top:?}");
        // Greedy: the chosen token's logprob is the best of its alternatives.
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((chosen - best).abs() < 1e-4, "{chosen} vs {best}");
    }
}

#[tokio::test]
async fn models_health_and_metrics_answer_in_their_formats() {
    let app = app();
    let get = |path: &'static str| {
        let app = app.clone();
        async move {
            let r = app
                .oneshot(Request::get(path).body(Body::empty()).unwrap())
                .await
                .unwrap();
            let ctype = r.headers()["content-type"].to_str().unwrap().to_string();
            let status = r.status();
            let bytes = axum::body::to_bytes(r.into_body(), 1 << 24).await.unwrap();
            (status, ctype, String::from_utf8(bytes.to_vec()).unwrap())
        }
    };
    let (status, _, text) = get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], NAME, "{v}");
    assert_eq!(v["data"][0]["max_model_len"], 512, "{v}");
    let (status, _, text) = get("/health").await;
    assert_eq!(
        (status, text.as_str()),
        (StatusCode::OK, r#"{"status":"ok"}"#)
    );
    let (status, ctype, text) = get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(ctype.starts_with("text/plain"), "{ctype}");
    assert!(text.contains("# TYPE"), "{text}");
}
