//! End-to-end tests of `kvmesh serve`: a real process, the embedded model, HTTP on loopback.

mod common;

use common::{streamed_text, text_of, Server};
use serde_json::{json, Value};

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": content}]});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

fn completion(prompt: &str, extra: Value) -> Value {
    let mut body = json!({"prompt": prompt});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn streaming_and_non_streaming_give_the_same_text() {
    let s = Server::start(&[]);
    let opts = json!({"temperature": 0, "max_tokens": 40, "ignore_eos": true});
    for (path, body) in [
        (
            "/v1/chat/completions",
            chat("What news from Verona?", opts.clone()),
        ),
        (
            "/v1/completions",
            completion("ROMEO:\nBut soft, what light", opts.clone()),
        ),
    ] {
        let (st, full) = s.post(path, body.clone()).await;
        assert_eq!(st, 200, "{full}");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let events = s.stream(path, sb).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        assert_eq!(streamed_text(&events), text_of(&full), "{path}");
        assert!(!text_of(&full).is_empty());
        // The last chunk before [DONE] carries usage and no choices.
        let usage_chunk: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage_chunk["choices"].as_array().unwrap().len(), 0);
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(usage_chunk["usage"][k], full["usage"][k], "{k}");
        }
        assert_eq!(full["usage"]["completion_tokens"], 40);
        assert_eq!(full["choices"][0]["finish_reason"], "length");
    }
}

#[tokio::test]
async fn greedy_is_deterministic_and_seeds_reproduce() {
    let s = Server::start(&[]);
    let greedy = completion(
        "KING HENRY:\n",
        json!({"temperature": 0, "max_tokens": 30, "ignore_eos": true}),
    );
    let (_, a) = s.post("/v1/completions", greedy.clone()).await;
    let (_, b) = s.post("/v1/completions", greedy).await;
    assert_eq!(text_of(&a), text_of(&b));

    let seeded = |seed: u64| {
        completion(
            "KING HENRY:\n",
            json!({"temperature": 1.0, "max_tokens": 40, "ignore_eos": true, "seed": seed}),
        )
    };
    let (_, x1) = s.post("/v1/completions", seeded(7)).await;
    let (_, x2) = s.post("/v1/completions", seeded(7)).await;
    let (_, y) = s.post("/v1/completions", seeded(8)).await;
    assert_eq!(
        text_of(&x1),
        text_of(&x2),
        "the same seed gives the same text"
    );
    assert_ne!(text_of(&x1), text_of(&y), "another seed gives other text");
    assert_ne!(
        text_of(&x1),
        text_of(&a),
        "sampling at temperature 1 differs from greedy"
    );
}

#[tokio::test]
async fn stop_strings_end_the_text_and_never_leak() {
    let s = Server::start(&[]);
    let base = json!({"temperature": 0, "max_tokens": 48, "ignore_eos": true});
    let (_, full) = s
        .post("/v1/completions", completion("GLOUCESTER:\n", base.clone()))
        .await;
    let text = text_of(&full);
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 20, "need a longer sample: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let want = &text[..text.find(&stop).unwrap()];

    let mut body = completion("GLOUCESTER:\n", base.clone());
    body["stop"] = json!([stop.clone(), "never-seen-stop"]);
    let (_, cut) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(text_of(&cut), want);
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");

    body["stream"] = json!(true);
    let events = s.stream("/v1/completions", body).await;
    let streamed = streamed_text(&events);
    assert_eq!(streamed, want);
    assert!(!streamed.contains(&stop));
    // The sequence was cut short: fewer tokens than max_tokens were generated.
    assert!(cut["usage"]["completion_tokens"].as_u64().unwrap() < 48);
}

#[tokio::test]
async fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let s = Server::start(&["--max-model-len", "128"]);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "{\"prompt\": \"x\",".into(), 400, None),
        ("/v1/completions", "[1, 2]".into(), 400, None),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -5}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -0.5}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 0}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 1.5}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "model": "gpt-4o"}).to_string(),
            404,
            Some("model"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 200}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "word ".repeat(300)}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 999999]}).to_string(),
            400,
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}).to_string(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 2}).to_string(),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}).to_string(),
            400,
            Some("top_logprobs"),
        ),
    ];
    for (path, body, status, param) in cases {
        let (st, v) = s.post_raw(path, &body).await;
        assert_eq!(st, status, "{body} -> {v}");
        let err = &v["error"];
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert!(err["type"].is_string(), "{v}");
        if let Some(p) = param {
            assert_eq!(err["param"], p, "{body} -> {v}");
        }
    }
    // The context-length message names both lengths.
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "x y", "max_tokens": 200}),
        )
        .await;
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("128") && msg.contains("200"), "{msg}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // Unknown routes answer in the same shape.
    let r = s
        .http
        .get(format!("{}/v1/nothing", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // Still serving.
    let (st, v) = s
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 3}))
        .await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test]
async fn a_client_that_disconnects_frees_its_blocks() {
    // A sim backend at 20 ms a step, so the request is surely running when checked.
    let s = Server::start(&["--backend", "sim", "--sim-decode-ms", "20"]);
    let body = completion(
        "ROMEO:\n",
        json!({"max_tokens": 400, "ignore_eos": true, "stream": true}),
    );
    let mut resp = s
        .http
        .post(format!("{}/v1/completions", s.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut got = 0;
    while got < 3 {
        if resp.chunk().await.unwrap().is_some() {
            got += 1;
        }
    }
    let busy = s.metric("kvmesh:kv_cache_usage_perc").await;
    assert!(busy > 0.0, "a running sequence holds blocks");
    assert_eq!(s.metric("kvmesh:num_requests_running").await, 1.0);
    drop(resp);
    let running = s
        .wait_metric("kvmesh:num_requests_running", 20, |v| v == 0.0)
        .await;
    assert_eq!(running, 0.0, "the sequence was cancelled");
    assert_eq!(s.metric("kvmesh:kv_cache_usage_perc").await, 0.0);
    let generated = s.metric("kvmesh:generation_tokens_total").await;
    assert!(
        generated < 400.0,
        "generation stopped early ({generated} tokens)"
    );
}

#[tokio::test]
async fn a_non_streaming_client_that_gives_up_is_cancelled() {
    // A slow sim backend (50 ms a step) so the request is surely still running.
    let s = Server::start(&["--backend", "sim", "--sim-decode-ms", "50"]);
    let body = completion("ROMEO:\n", json!({"max_tokens": 450}));
    let gave_up = s
        .http
        .post(format!("{}/v1/completions", s.base))
        .json(&body)
        .timeout(std::time::Duration::from_millis(700))
        .send()
        .await;
    assert!(
        gave_up.is_err(),
        "the request should still be running when the client leaves"
    );
    let running = s
        .wait_metric("kvmesh:num_requests_running", 20, |v| v == 0.0)
        .await;
    assert_eq!(running, 0.0);
    assert_eq!(s.metric("kvmesh:kv_cache_usage_perc").await, 0.0);
    let generated = s.metric("kvmesh:generation_tokens_total").await;
    assert!(
        generated < 100.0,
        "generation stopped early ({generated} tokens)"
    );
}

#[tokio::test]
async fn a_repeated_prompt_hits_the_prefix_cache() {
    let s = Server::start(&[]);
    let prompt = "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(6);
    let body = completion(&prompt, json!({"max_tokens": 4, "temperature": 0}));
    let (_, first) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(s.metric("kvmesh:prefix_cache_hits_total").await, 0.0);
    let (_, second) = s.post("/v1/completions", body).await;
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= prompt_tokens - 16 && cached < prompt_tokens,
        "cached {cached} of {prompt_tokens}"
    );
    assert_eq!(
        s.metric("kvmesh:prefix_cache_hits_total").await,
        cached as f64
    );
    assert_eq!(
        text_of(&first),
        text_of(&second),
        "cached blocks give the same result"
    );
}

#[tokio::test]
async fn preemption_under_block_pressure_keeps_outputs_exact() {
    // 12 blocks of 16 tokens: four 100-token sequences cannot all hold their blocks.
    let s = Server::start(&[
        "--num-kv-blocks",
        "12",
        "--max-model-len",
        "192",
        "--no-enable-prefix-caching",
    ]);
    let prompts = ["ROMEO:\n", "JULIET:\n", "HAMLET:\n", "MACBETH:\n"];
    let body = |p: &str| {
        completion(
            p,
            json!({"temperature": 0, "max_tokens": 90, "ignore_eos": true}),
        )
    };
    let mut alone = Vec::new();
    for p in prompts {
        let (st, v) = s.post("/v1/completions", body(p)).await;
        assert_eq!(st, 200, "{v}");
        alone.push(text_of(&v));
    }
    assert_eq!(s.metric("kvmesh:num_preemptions_total").await, 0.0);
    let together =
        futures::future::join_all(prompts.iter().map(|p| s.post("/v1/completions", body(p)))).await;
    for ((st, v), want) in together.iter().zip(&alone) {
        assert_eq!(*st, 200, "{v}");
        assert_eq!(
            &text_of(v),
            want,
            "a preempted and recomputed sequence continues exactly"
        );
    }
    assert!(
        s.metric("kvmesh:num_preemptions_total").await > 0.0,
        "the cache was too small for all four"
    );
}

#[tokio::test]
async fn a_full_queue_answers_429() {
    // 20 ms a step: the first request is surely still running when the others arrive.
    let s = Server::start(&[
        "--max-num-seqs",
        "1",
        "--max-waiting-seqs",
        "1",
        "--backend",
        "sim",
        "--sim-decode-ms",
        "20",
    ]);
    let body = completion("ROMEO:\n", json!({"max_tokens": 120, "ignore_eos": true}));
    let results =
        futures::future::join_all((0..6).map(|_| s.post("/v1/completions", body.clone()))).await;
    let ok = results.iter().filter(|(st, _)| *st == 200).count();
    let busy: Vec<_> = results.iter().filter(|(st, _)| *st == 429).collect();
    assert!(ok >= 1, "{results:?}");
    assert!(!busy.is_empty(), "{results:?}");
    assert_eq!(ok + busy.len(), 6, "{results:?}");
    assert_eq!(busy[0].1["error"]["code"], "queue_full");
}

#[tokio::test]
async fn api_key_guards_the_v1_routes() {
    let s = Server::start(&["--api-key", "sekrit"]);
    let url = format!("{}/v1/models", s.base);
    assert_eq!(
        s.http.get(&url).send().await.unwrap().status().as_u16(),
        401
    );
    assert_eq!(
        s.http
            .get(&url)
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        401
    );
    let r = s.http.get(&url).bearer_auth("sekrit").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"][0]["id"], "shakespeare");
    assert_eq!(
        s.http
            .get(format!("{}/health", s.base))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
}

#[tokio::test]
async fn token_ids_in_and_out_and_logprobs() {
    let s = Server::start(&["--served-model-name", "bard"]);
    let (_, text_run) = s
        .post("/v1/completions", json!({"model": "bard", "prompt": "ROMEO:\n", "max_tokens": 12, "temperature": 0, "ignore_eos": true, "return_token_ids": true, "logprobs": 3}))
        .await;
    let choice = &text_run["choices"][0];
    let prompt_ids: Vec<u64> = serde_json::from_value(choice["prompt_token_ids"].clone()).unwrap();
    let out_ids: Vec<u64> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    assert_eq!(out_ids.len(), 12);
    assert_eq!(
        prompt_ids.len() as u64,
        text_run["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    // The same prompt given as token ids gives the same completion.
    let (_, id_run) = s
        .post(
            "/v1/completions",
            json!({"prompt": prompt_ids, "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(text_of(&id_run), text_of(&text_run));
    // logprobs: three alternatives each, best first, the chosen token's logprob among them.
    let lp = &choice["logprobs"];
    let tops = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(tops.len(), 12);
    for (i, top) in tops.iter().enumerate() {
        let vals: Vec<f64> = top
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!(!vals.is_empty() && vals.len() <= 3);
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let best = vals.iter().cloned().fold(f64::MIN, f64::max);
        assert!(
            (best - chosen).abs() < 1e-4,
            "greedy picks the most likely token"
        );
    }
    // Chat logprobs in the chat shape.
    let (_, c) = s
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Hail!"}], "max_tokens": 5, "logprobs": true, "top_logprobs": 2, "return_token_ids": true}))
        .await;
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        c["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(c["prompt_token_ids"]
        .as_array()
        .is_some_and(|a| !a.is_empty()));
}

#[tokio::test]
async fn metrics_count_requests_and_latencies() {
    let s = Server::start(&[]);
    let (st, _) = s
        .post(
            "/v1/completions",
            json!({"prompt": "ROMEO:\n", "max_tokens": 5, "ignore_eos": true}),
        )
        .await;
    assert_eq!(st, 200);
    let m = s.metrics().await;
    for name in [
        "kvmesh:time_to_first_token_seconds_count",
        "kvmesh:inter_token_latency_seconds_count",
        "kvmesh:e2e_request_latency_seconds_count",
        "kvmesh:num_requests_running",
        "kvmesh:num_requests_waiting",
        "kvmesh:kv_cache_usage_perc",
    ] {
        assert!(m.contains(name), "{name} missing");
    }
    assert_eq!(
        s.metric("kvmesh:time_to_first_token_seconds_count").await,
        1.0
    );
    assert_eq!(
        s.metric("kvmesh:inter_token_latency_seconds_count").await,
        4.0
    );
    assert_eq!(s.metric("kvmesh:generation_tokens_total").await, 5.0);
    assert!(
        m.contains(
            "kvmesh:request_success_total{model_name=\"shakespeare\",finished_reason=\"length\"} 1"
        ),
        "{m}"
    );
}

#[tokio::test]
async fn the_sim_backend_serves_deterministic_tokens_through_the_real_engine() {
    let s = Server::start(&[
        "--backend",
        "sim",
        "--sim-decode-ms",
        "0",
        "--sim-prefill-us-per-token",
        "0",
        "--sim-decode-us-per-seq",
        "0",
    ]);
    let body = completion(
        "ROMEO:\n",
        json!({"max_tokens": 50, "return_token_ids": true}),
    );
    let (st, a) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["usage"]["completion_tokens"], 50, "sim never emits eos");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    let many =
        futures::future::join_all((0..16).map(|_| s.post("/v1/completions", body.clone()))).await;
    for (st, v) in &many {
        assert_eq!(*st, 200, "{v}");
        assert_eq!(
            v["choices"][0]["token_ids"], a["choices"][0]["token_ids"],
            "same prompt, same tokens"
        );
    }
    // The real block budget and prefix cache run underneath.
    assert!(
        s.metric("kvmesh:prefix_cache_hits_total").await == 0.0,
        "a 4-token prompt has no full block"
    );
    let long = "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(4);
    let lb = completion(&long, json!({"max_tokens": 5}));
    s.post("/v1/completions", lb.clone()).await;
    let (_, again) = s.post("/v1/completions", lb).await;
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // A chat's next turn finds the previous answer in the prefix cache, as with a real
    // model: the sim's text tokenizes back into the ids it was generated as. Cached: every
    // full block of the previous prompt and answer (the answer's last token was sampled,
    // never computed).
    let mut messages =
        vec![json!({"role": "user", "content": "How fares the king today, good sir?"})];
    let mut before: Option<u64> = None;
    for turn in 0..4 {
        let body = json!({"model": "shakespeare", "messages": messages, "max_tokens": 40});
        let (st, v) = s.post("/v1/chat/completions", body).await;
        assert_eq!(st, 200, "{v}");
        let usage = &v["usage"];
        if let Some(seen) = before {
            let cached = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert_eq!(cached, (seen - 1) / 16 * 16, "turn {turn}: {usage}");
        }
        before = Some(usage["total_tokens"].as_u64().unwrap());
        messages
            .push(json!({"role": "assistant", "content": v["choices"][0]["message"]["content"]}));
        messages.push(json!({"role": "user", "content": "And what of the queen, my lord?"}));
    }
}

#[tokio::test]
async fn metrics_split_a_decode_steps_time_between_the_model_and_the_engine() {
    // A sim backend whose decode step takes 20 ms: the forward part of each decode step
    // holds that time, the step and the cycle around it hold the forward.
    let s = Server::start(&[
        "--backend",
        "sim",
        "--sim-decode-ms",
        "20",
        "--sim-decode-us-per-seq",
        "0",
    ]);
    let (status, _) = s
        .post(
            "/v1/completions",
            completion("ROMEO:\n", json!({"max_tokens": 12, "temperature": 0})),
        )
        .await;
    assert_eq!(status, 200);
    let steps = s.metric("kvmesh:engine_decode_steps_total").await;
    let cycle = s.metric("kvmesh:engine_decode_cycle_seconds_total").await;
    let step = s.metric("kvmesh:engine_decode_step_seconds_total").await;
    let forward = s.metric("kvmesh:engine_decode_forward_seconds_total").await;
    assert!(
        steps >= 10.0,
        "12 tokens, the first from the prompt's step: {steps} decode steps"
    );
    assert!(
        cycle >= step && step >= forward && forward > 0.0,
        "cycle {cycle} s >= step {step} s >= forward {forward} s"
    );
    assert!(
        forward / steps >= 0.005,
        "the sim's 20 ms steps are inside the forward part: {} ms a step",
        1e3 * forward / steps
    );
}
