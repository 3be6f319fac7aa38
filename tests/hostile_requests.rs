//! Requests built to break a server, sent to a real `kvmesh serve` on loopback: grammars
//! nested deep enough to exhaust a compiling thread's stack and grammars that compile but
//! outgrow the matcher while generating are each refused with a 400 naming the field and the
//! limit, and the server answers the next request; tool calls are forced on a template that
//! shows no tool format. (Floods of such requests are soak-bench's `--only floods`.)

mod common;

use common::Server;
use serde_json::{json, Value};

/// A schema whose `$ref`s form a chain `n` hops long.
fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert(format!("d{n}"), json!({"type": "integer"}));
    json!({"$ref": "#/$defs/d0", "$defs": defs})
}

/// A Lark grammar whose rules nest `n` deep.
fn nested_rules(n: usize) -> String {
    let mut s = String::from("start: r0\n");
    for i in 0..n {
        s.push_str(&format!("r{i}: \"a\" r{}\n", i + 1));
    }
    s.push_str(&format!("r{n}: \"z\"\n"));
    s
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn answers_plainly(s: &Server) {
    let (status, v) = s.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, 200, "{v}");
}

fn refused(status: u16, v: &Value, param: &str, says: &str) {
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], param, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(says), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_grammars_are_refused_and_the_server_lives() {
    let s = Server::start(&[]);
    let schema = |s: Value| {
        json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "deep", "schema": s}}})
    };
    let (status, v) = s
        .post("/v1/chat/completions", chat(schema(ref_chain(300))))
        .await;
    refused(status, &v, "response_format", "256 levels");
    answers_plainly(&s).await;

    let lark = json!({"structured_outputs": {"grammar": nested_rules(700)}});
    let (status, v) = s.post("/v1/chat/completions", chat(lark)).await;
    refused(status, &v, "structured_outputs.grammar", "256 levels");
    answers_plainly(&s).await;

    let tool = json!({"tools": [{"type": "function", "function": {
        "name": "deep", "parameters": ref_chain(300)}}], "tool_choice": "required"});
    let (status, v) = s.post("/v1/chat/completions", chat(tool)).await;
    refused(status, &v, "tools[0].function.parameters", "256 levels");
    answers_plainly(&s).await;

    // Within the limit, deep grammars are followed.
    let (status, v) = s
        .post("/v1/chat/completions", chat(schema(ref_chain(100))))
        .await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(text.trim().parse::<i64>().is_ok(), "{text:?}");
    }
    let lark = json!({"structured_outputs": {"grammar": nested_rules(100)}, "max_tokens": 200});
    let (status, v) = s.post("/v1/chat/completions", chat(lark)).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.chars().all(|c| c == 'a' || c == 'z'), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammars_that_outgrow_the_matcher_are_the_request_s_fault() {
    let s = Server::start(&[]);
    // 5,000 choices and 1,000 optional properties compile, then exceed the matcher's
    // per-step limit (items in one Earley row) at the first token generated.
    let choices: Vec<String> = (0..5_000).map(|i| i.to_string()).collect();
    let props: serde_json::Map<String, Value> = (0..1_000)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    let cases = [
        (
            json!({"structured_outputs": {"choice": choices}}),
            "structured_outputs.choice",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "wide",
                "schema": {"type": "object", "properties": props}}}}),
            "response_format",
        ),
    ];
    for (extra, field) in cases {
        let mut body = chat(extra);
        body["max_tokens"] = json!(64);
        let (status, v) = s.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        // Streamed, the same failure ends the stream with an error event naming the field.
        body["stream"] = json!(true);
        let events = s.stream("/v1/chat/completions", body).await;
        let last = events
            .iter()
            .rev()
            .find(|e| *e != "[DONE]")
            .expect("an event");
        let last: Value = serde_json::from_str(last).unwrap();
        assert!(last["error"].is_object(), "{events:?}");
        answers_plainly(&s).await;
    }
}

fn weather_tools() -> Value {
    json!([
        // As Pydantic writes a nested model: a definition of its own, pointed at from
        // the parameters' root.
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "$defs": {"City": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 12}},
                "required": ["name"], "additionalProperties": false}},
            "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "integer", "maximum": 99,
                "minimum": -99}},
            "required": ["zone"], "additionalProperties": false}}},
    ])
}

/// A checkpoint whose chat template shows no tool format.
fn no_tool_template() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/models/tiny-llama"
    )
    .to_string()
}

/// A model whose chat template shows no tool format: `required` and a named function still
/// produce calls (forced as a JSON array), `auto` is refused naming the flag that fixes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_calls_work_whatever_the_template() {
    let s = Server::start(&["--model", &no_tool_template()]);
    let ask = |choice: Value| {
        let mut b = chat(json!({"tools": weather_tools(), "tool_choice": choice}));
        b["max_tokens"] = json!(120);
        b
    };
    for (choice, names) in [
        (json!("required"), vec!["get_weather", "get_time"]),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            vec!["get_time"],
        ),
    ] {
        let (status, v) = s.post("/v1/chat/completions", ask(choice.clone())).await;
        assert_eq!(status, 200, "{v}");
        let m = &v["choices"][0]["message"];
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        let calls = m["tool_calls"].as_array().expect("tool calls");
        assert_eq!(calls.len(), 1, "{v}");
        let f = &calls[0]["function"];
        assert!(names.contains(&f["name"].as_str().unwrap()), "{v}");
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
        assert!(args.is_object(), "{v}");
        if f["name"] == "get_time" {
            assert!(args["zone"].is_i64(), "{v}");
        } else {
            assert!(args["city"]["name"].is_string(), "{v}");
        }
        // Streamed, the same call arrives as tool-call deltas.
        let mut body = ask(choice);
        body["stream"] = json!(true);
        let events = s.stream("/v1/chat/completions", body).await;
        let mut name = String::new();
        let mut streamed_args = String::new();
        for e in events.iter().filter(|e| *e != "[DONE]") {
            let e: Value = serde_json::from_str(e).unwrap();
            for d in e["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                name.push_str(d["function"]["name"].as_str().unwrap_or(""));
                streamed_args.push_str(d["function"]["arguments"].as_str().unwrap_or(""));
            }
        }
        assert_eq!(name, f["name"].as_str().unwrap(), "{events:?}");
        assert_eq!(
            streamed_args,
            f["arguments"].as_str().unwrap(),
            "{events:?}"
        );
    }
    let (status, v) = s.post("/v1/chat/completions", ask(json!("auto"))).await;
    refused(status, &v, "tools", "--tool-call-parser");
}

/// `--tool-call-parser` names the format for a template that shows none: `auto` is served,
/// and a forced call comes in that format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_tool_call_parser_serves_auto_and_forces_in_its_format() {
    let s = Server::start(&[
        "--model",
        &no_tool_template(),
        "--tool-call-parser",
        "hermes",
    ]);
    let mut body = chat(json!({"tools": weather_tools(), "tool_choice": "auto"}));
    body["max_tokens"] = json!(40);
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{v}");
    let mut body = chat(json!({"tools": weather_tools(), "tool_choice": "required"}));
    body["max_tokens"] = json!(120);
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("get_"))
    );
    // An unknown parser is refused at start-up, naming the ones there are.
    let out = std::process::Command::new(common::bin())
        .args(["serve", "--tool-call-parser", "pythonic", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("hermes, llama3_json or mistral"), "{err}");
}
