//! One benchmark request: a streamed completion or chat completion, timed chunk by chunk.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use futures::StreamExt;
use serde_json::{json, Value};

use super::dataset::Sample;
use super::metrics::Outcome;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `/v1/completions`: the prompt as text.
    Completions,
    /// `/v1/chat/completions`: the prompt as one user message.
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

/// Where requests go and what they are sent as.
#[derive(Clone, Debug)]
pub struct Target {
    pub base_url: String,
    pub model: String,
    pub endpoint: Endpoint,
    pub api_key: Option<String>,
}

impl Target {
    pub fn url(&self) -> String {
        format!("{}{}", self.base_url, self.endpoint.path())
    }

    /// Greedy, exactly `max_tokens` long (eos ignored), streamed with usage at the end: every
    /// request does the same work on every run.
    pub fn body(&self, prompt: &str, max_tokens: usize) -> Value {
        match self.endpoint {
            Endpoint::Completions => {
                let mut body = self.common(max_tokens);
                body["prompt"] = json!(prompt);
                body
            }
            Endpoint::Chat => {
                self.chat_body(&[json!({"role": "user", "content": prompt})], max_tokens)
            }
        }
    }

    /// A chat request with the whole conversation so far, asked like [`Target::body`].
    pub fn chat_body(&self, messages: &[Value], max_tokens: usize) -> Value {
        let mut body = self.common(max_tokens);
        body["messages"] = json!(messages);
        body
    }

    fn common(&self, max_tokens: usize) -> Value {
        json!({
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }
}

/// The HTTP client every request shares.
pub fn http_client(timeout: Duration) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .context("building the HTTP client")
}

/// An error with its causes ("connection refused" sits a few sources down a reqwest error).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        src = s.source();
    }
    msg
}

/// The message of an OpenAI-style error body, else the body itself (shortened).
pub fn error_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let msg = parsed
        .as_ref()
        .and_then(|v| v.get("error"))
        .and_then(|e| e.get("message").and_then(Value::as_str).or(e.as_str()))
        .map(str::to_owned)
        .unwrap_or_else(|| body.trim().to_string());
    if msg.chars().count() > 500 {
        msg.chars().take(500).collect::<String>() + "…"
    } else {
        msg
    }
}

/// The served models' ids and the first one's context length, from `GET /v1/models`.
pub struct ServerInfo {
    pub models: Vec<String>,
    pub max_model_len: Option<usize>,
}

/// Asks the server what it serves. An unreachable server is an error here, before anything
/// else; a server that will not list its models (some proxies) gives an empty list.
pub async fn server_info(
    http: &reqwest::Client,
    base_url: &str,
    api_key: Option<&str>,
) -> Result<ServerInfo> {
    let url = format!("{base_url}/v1/models");
    let mut req = http.get(&url).timeout(Duration::from_secs(30));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => bail!(
            "cannot reach the server at {base_url} ({}); is it running?",
            error_chain(&e)
        ),
    };
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    if !status.is_success() {
        eprintln!("GET {url} answered {status}: {}", error_message(&body));
        return Ok(ServerInfo {
            models: vec![],
            max_model_len: None,
        });
    }
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let data = v["data"].as_array().cloned().unwrap_or_default();
    Ok(ServerInfo {
        models: data
            .iter()
            .filter_map(|m| m["id"].as_str().map(String::from))
            .collect(),
        max_model_len: data
            .first()
            .and_then(|m| m["max_model_len"].as_u64())
            .map(|n| n as usize),
    })
}

/// Sends one request and times its stream. Never fails: whatever goes wrong is the outcome.
pub async fn send(
    http: &reqwest::Client,
    target: &Target,
    sample: &Sample,
    max_tokens: usize,
) -> Outcome {
    send_body(http, target, &target.body(&sample.prompt, max_tokens)).await
}

/// Sends a request body built by [`Target::body`] or [`Target::chat_body`] and times its
/// stream; the outcome keeps the streamed text.
pub async fn send_body(http: &reqwest::Client, target: &Target, body: &Value) -> Outcome {
    let start = Instant::now();
    let secs = || start.elapsed().as_secs_f64();
    let mut req = http.post(target.url()).json(body);
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => return Outcome::failed(error_chain(&e), secs()),
    };
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Outcome::failed(
            format!("HTTP {}: {}", status.as_u16(), error_message(&body)),
            secs(),
        );
    }
    let mut timeline = Timeline::default();
    let mut sse = SseParser::default();
    let mut body = resp.bytes_stream();
    while let Some(bytes) = body.next().await {
        match bytes {
            Ok(b) => {
                // Every event in one network read arrived at the same moment.
                let at = secs();
                for data in sse.push(&b) {
                    timeline.event(at, &data);
                }
            }
            Err(e) => {
                timeline.fail(format!("the stream broke: {}", error_chain(&e)));
                break;
            }
        }
    }
    if let Some(data) = sse.finish() {
        timeline.event(secs(), &data);
    }
    timeline.finish(secs())
}

/// Splits a server-sent-event byte stream into the `data` of each event.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Feeds bytes as they arrive; returns the events they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.buf.drain(..=nl).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8_lossy(&line);
            if line.is_empty() {
                events.extend(self.data.take());
            } else if let Some(d) = line.strip_prefix("data:") {
                let d = d.strip_prefix(' ').unwrap_or(d);
                match &mut self.data {
                    // Several data lines in one event join with newlines.
                    Some(acc) => {
                        acc.push('\n');
                        acc.push_str(d);
                    }
                    None => self.data = Some(d.to_string()),
                }
            }
            // Comments (`:` keep-alives) and other fields carry nothing to time.
        }
        events
    }

    /// An event the stream ended in without its closing blank line.
    pub fn finish(&mut self) -> Option<String> {
        if !self.buf.is_empty() {
            self.push(b"\n");
        }
        self.data.take()
    }
}

/// A request's stream, event by event, turned into its timings. `at` is seconds since the
/// request was sent. Kept apart from the network so its arithmetic can be tested alone.
#[derive(Default, Debug)]
pub struct Timeline {
    ttft: Option<f64>,
    last: f64,
    itl: Vec<f64>,
    content_chunks: usize,
    completion_tokens: Option<usize>,
    prompt_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    text: String,
    error: Option<String>,
    done: bool,
}

impl Timeline {
    pub fn event(&mut self, at: f64, data: &str) {
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let v: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => return self.fail(format!("a chunk is not JSON ({e}): {data}")),
        };
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return self.fail(format!(
                "error event: {}",
                error_message(&json!({"error": err}).to_string())
            ));
        }
        let choice = &v["choices"][0];
        let text = choice["text"]
            .as_str()
            .or_else(|| choice["delta"]["content"].as_str())
            .unwrap_or("");
        if !text.is_empty() {
            match self.ttft {
                None => self.ttft = Some(at),
                Some(_) => self.itl.push(at - self.last),
            }
            self.last = at;
            self.content_chunks += 1;
            self.text.push_str(text);
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let n = |v: &Value| v.as_u64().map(|n| n as usize);
            self.completion_tokens = n(&u["completion_tokens"]).or(self.completion_tokens);
            self.prompt_tokens = n(&u["prompt_tokens"]).or(self.prompt_tokens);
            // Servers that do not track their prefix cache leave this out (or null): unknown,
            // which is not the same as nothing cached.
            self.cached_tokens =
                n(&u["prompt_tokens_details"]["cached_tokens"]).or(self.cached_tokens);
        }
    }

    /// Keeps the first thing that went wrong.
    pub fn fail(&mut self, error: String) {
        self.error.get_or_insert(error);
    }

    pub fn finish(self, end: f64) -> Outcome {
        let error = self.error.or_else(|| {
            if self.content_chunks == 0 {
                Some("the response carried no generated text".into())
            } else if !self.done {
                Some("the stream ended before [DONE]".into())
            } else {
                None
            }
        });
        Outcome {
            ok: error.is_none(),
            ttft: self.ttft.unwrap_or(0.0),
            itl: self.itl,
            e2el: end,
            output_tokens: self.completion_tokens.unwrap_or(self.content_chunks),
            server_prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            text: self.text,
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion_chunk(text: &str) -> String {
        json!({"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": null}]})
            .to_string()
    }

    fn chat_chunk(content: &str) -> String {
        json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]})
            .to_string()
    }

    fn usage(prompt: usize, completion: usize) -> String {
        json!({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})
            .to_string()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn ttft_is_the_first_chunk_with_text_and_itl_the_gaps_after_it() {
        let mut t = Timeline::default();
        // The chat role chunk carries no text: it must not count as the first token.
        t.event(
            0.05,
            &json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]}).to_string(),
        );
        t.event(0.20, &chat_chunk("My"));
        t.event(0.25, &chat_chunk(" lord"));
        t.event(0.25, &chat_chunk(","));
        t.event(0.40, &chat_chunk(" yes"));
        t.event(0.41, &usage(12, 6));
        t.event(0.41, "[DONE]");
        let o = t.finish(0.42);
        assert!(o.ok, "{o:?}");
        assert!(close(o.ttft, 0.20));
        assert_eq!(o.itl.len(), 3);
        for (a, b) in o.itl.iter().zip([0.05, 0.0, 0.15]) {
            assert!(close(*a, b), "{:?}", o.itl);
        }
        assert!(close(o.e2el, 0.42));
        // Usage wins over the chunk count (one chunk may carry several tokens).
        assert_eq!(o.output_tokens, 6);
        assert_eq!(o.server_prompt_tokens, Some(12));
    }

    #[test]
    fn the_streamed_text_and_the_cached_tokens_are_kept() {
        let mut t = Timeline::default();
        t.event(0.1, &chat_chunk("Good"));
        t.event(0.2, &chat_chunk(" morrow,  "));
        t.event(0.2, &chat_chunk("cousin"));
        t.event(
            0.3,
            &json!({"choices": [], "usage": {"prompt_tokens": 80, "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 64}}})
            .to_string(),
        );
        t.event(0.3, "[DONE]");
        let o = t.finish(0.3);
        assert_eq!(o.text, "Good morrow,  cousin");
        assert_eq!(
            (o.server_prompt_tokens, o.cached_tokens),
            (Some(80), Some(64))
        );

        // No details, or null ones: unknown, never 0.
        for usage in [
            json!({"prompt_tokens": 5, "completion_tokens": 1}),
            json!({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": null}),
        ] {
            let mut t = Timeline::default();
            t.event(0.1, &completion_chunk("x"));
            t.event(0.1, &json!({"choices": [], "usage": usage}).to_string());
            t.event(0.1, "[DONE]");
            let o = t.finish(0.1);
            assert_eq!((o.server_prompt_tokens, o.cached_tokens), (Some(5), None));
        }
    }

    #[test]
    fn without_usage_the_content_chunks_are_counted() {
        let mut t = Timeline::default();
        for (i, w) in ["a", "b", "", "c"].iter().enumerate() {
            t.event(0.1 * (i + 1) as f64, &completion_chunk(w));
        }
        t.event(0.5, "[DONE]");
        let o = t.finish(0.5);
        assert!(o.ok);
        assert_eq!(o.output_tokens, 3);
        assert!(close(o.ttft, 0.1));
        assert_eq!(o.itl.len(), 2);
        assert!(
            close(o.itl[1], 0.2),
            "the empty chunk is no token: {:?}",
            o.itl
        );
        assert_eq!(o.server_prompt_tokens, None);
    }

    #[test]
    fn errors_empty_and_cut_streams_fail() {
        let mut t = Timeline::default();
        t.event(0.1, &completion_chunk("x"));
        t.event(
            0.2,
            &json!({"error": {"message": "engine died", "type": "server_error"}}).to_string(),
        );
        t.event(0.3, "[DONE]");
        let o = t.finish(0.3);
        assert!(!o.ok);
        assert_eq!(o.error.as_deref(), Some("error event: engine died"));

        let mut t = Timeline::default();
        t.event(0.1, &usage(3, 0));
        t.event(0.1, "[DONE]");
        assert_eq!(
            t.finish(0.1).error.as_deref(),
            Some("the response carried no generated text")
        );

        let mut t = Timeline::default();
        t.event(0.1, &completion_chunk("x"));
        assert_eq!(
            t.finish(0.2).error.as_deref(),
            Some("the stream ended before [DONE]")
        );

        let mut t = Timeline::default();
        t.event(0.1, "{not json");
        t.event(0.2, &completion_chunk("x"));
        t.event(0.2, "[DONE]");
        assert!(t
            .finish(0.2)
            .error
            .unwrap()
            .starts_with("a chunk is not JSON"));
    }

    #[test]
    fn sse_events_split_across_reads_and_lines() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            p.push(b":1}\r\n\r\n: keep-alive\n\ndata: [DO"),
            vec!["{\"a\":1}"]
        );
        assert_eq!(
            p.push(b"NE]\n\ndata:x\ndata: y\n\n"),
            vec!["[DONE]", "x\ny"]
        );
        assert!(p.push(b"data: tail").is_empty());
        assert_eq!(p.finish().as_deref(), Some("tail"));
        assert_eq!(p.finish(), None);
    }

    #[test]
    fn request_bodies_ask_for_exact_greedy_streamed_output() {
        let mut t = Target {
            base_url: "http://h:1".into(),
            model: "m".into(),
            endpoint: Endpoint::Completions,
            api_key: None,
        };
        let b = t.body("hi", 7);
        assert_eq!(t.url(), "http://h:1/v1/completions");
        assert_eq!(b["prompt"], "hi");
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["temperature"], 0);
        assert_eq!(b["stream_options"]["include_usage"], true);
        t.endpoint = Endpoint::Chat;
        let b = t.body("hi", 7);
        assert_eq!(b["messages"][0]["content"], "hi");
        assert!(b.get("prompt").is_none());
        let history = [
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "user", "content": "more"}),
        ];
        let c = t.chat_body(&history, 9);
        assert_eq!(c["messages"], json!(history));
        for k in [
            "model",
            "temperature",
            "ignore_eos",
            "stream",
            "stream_options",
        ] {
            assert_eq!(c[k], b[k], "{k}");
        }
        assert_eq!(c["max_tokens"], 9);
    }

    #[test]
    fn error_messages_come_out_of_openai_error_bodies() {
        let body = json!({"error": {"message": "The model `x` does not exist.", "code": 404}});
        assert_eq!(
            error_message(&body.to_string()),
            "The model `x` does not exist."
        );
        assert_eq!(error_message(" plain text \n"), "plain text");
    }
}
