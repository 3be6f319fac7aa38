//! `/v1/chat/completions` and `/v1/completions`: a request parsed and checked, templated and
//! tokenized (off the async threads when large), handed to the dispatcher, and answered as
//! one response or as server-sent events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use kvmesh_gpu::engine::Request as EngineRequest;
use kvmesh_gpu::tokenizer::TextTokenizer;

use crate::error::ApiError;
use crate::generate::{Chunk, Generation};
use crate::protocol::{self, ChatRequest, CompletionRequest, Prompt, Validated};
use crate::state::{unix_now, AppState, ServedModel, StreamCut, WorkPool};
use crate::structured::{self, Shape};
use crate::tools::{ToolDelta, ToolFormat, ToolStream};
use crate::validation::Invalid;

/// A child span of the request's, for one phase of the gateway's work.
fn span(name: &'static str) -> tracing::Span {
    use kvmesh_telemetry::TARGET;
    match name {
        "validate" => tracing::info_span!(target: TARGET, "validate"),
        "chat_template" => tracing::info_span!(target: TARGET, "chat_template"),
        _ => tracing::info_span!(target: TARGET, "tokenize"),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Endpoint {
    Chat,
    Completion,
}

struct Prepared {
    endpoint: Endpoint,
    prompt: Vec<u32>,
    /// For completions with `echo`.
    echo: Option<String>,
    v: Validated,
    shape: Shape,
}

pub(crate) async fn chat(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(st, body, prepare_chat).await
}

pub(crate) async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(st, body, prepare_completion).await
}

/// The model the body names, then the request prepared for it and run.
async fn handle(st: Arc<AppState>, body: Bytes, work: Work) -> Response {
    let start = Instant::now();
    let resolved = match st.catalog.only() {
        Some(m) => Ok(m),
        None => st.catalog.resolve(named_model(&body).as_deref()).await,
    };
    let model = match resolved {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let prepared = prepare(&st, &model, body, work).await;
    respond(st, model, prepared, start).await
}

/// The `model` a body names, read without keeping the rest. A body that is not JSON, or
/// whose `model` is not a string, names none here: its checks say what is wrong with it.
fn named_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<Value>,
    }
    let named: Named = serde_json::from_slice(body).ok()?;
    named.model?.as_str().map(String::from)
}

/// A request's CPU work for one endpoint.
type Work = fn(&ServedModel, &[u8]) -> Result<Prepared, ApiError>;

/// Bodies up to this size are parsed and tokenized where they arrive: that takes tens of
/// microseconds, less than the two thread hand-offs of the blocking pool would add to the
/// time to first token. Larger ones go to the pool.
const INLINE_PREPARE_BYTES: usize = 4096;

/// Whether a body may carry a grammar (a schema, regex, choice, Lark text or tools): compiling
/// one the first time takes milliseconds, so such a body is prepared off the async threads
/// whatever its size.
fn shapes_output(body: &[u8]) -> bool {
    const KEYS: [&[u8]; 4] = [
        b"response_format",
        b"structured_outputs",
        b"guided_",
        b"\"tools\"",
    ];
    KEYS.iter().any(|k| body.windows(k.len()).any(|w| w == *k))
}

/// A request's CPU work (parsing, the chat template, tokenizing): inline for a small body
/// without a grammar, else off the async threads (see [`off_runtime`]).
async fn prepare(
    st: &Arc<AppState>,
    model: &Arc<ServedModel>,
    body: Bytes,
    work: Work,
) -> Result<Prepared, ApiError> {
    let shaped = shapes_output(&body);
    if body.len() <= INLINE_PREPARE_BYTES && !shaped {
        return work(model, &body);
    }
    let model = model.clone();
    let pool = if shaped {
        &st.compile_pool
    } else {
        &st.prepare_pool
    };
    off_runtime(pool, move || work(&model, &body)).await
}

/// Runs a request's CPU work on the blocking pool, a bounded number at a time (waiting
/// turns in order, in a bounded queue), under the request's span.
async fn off_runtime(
    pool: &WorkPool,
    work: impl FnOnce() -> Result<Prepared, ApiError> + Send + 'static,
) -> Result<Prepared, ApiError> {
    let Some(waiting) = pool.enter() else {
        return Err(ApiError {
            status: axum::http::StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "Too many requests are waiting for the {} pool ({} queued); retry later.",
                pool.name,
                pool.queued()
            ),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        });
    };
    let permit = pool
        .permits
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("the gateway is shutting down"))?;
    let span = tracing::Span::current();
    // The permit and the place go with the work: a client that hangs up does not free
    // them early.
    tokio::task::spawn_blocking(move || {
        let _held = (permit, waiting);
        span.in_scope(work)
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}

/// The body parsed once, unsupported fields refused, read as the endpoint's request `R`,
/// as the fields every endpoint shares, and as the output's shape; `top` says how many top
/// logprobs `R` asks for.
fn validate<R: serde::de::DeserializeOwned>(
    st: &ServedModel,
    body: &[u8],
    top: impl FnOnce(&R) -> Result<Option<usize>, ApiError>,
    chat: bool,
) -> Result<(R, Validated, Shape), ApiError> {
    span("validate").in_scope(|| {
        let body = protocol::parse_body(body)?;
        protocol::refuse_unsupported(&body)?;
        let req: R = protocol::fields(&body)?;
        let top = top(&req)?;
        let v = protocol::validate_common(
            &protocol::fields(&body)?,
            &st.name,
            st.tokenizer.sampling_defaults(),
            top,
        )?;
        let shape = structured::read(&body, chat, st)?;
        Ok((req, v, shape))
    })
}

fn prepare_chat(st: &ServedModel, body: &[u8]) -> Result<Prepared, ApiError> {
    let (req, v, shape) = validate(
        st,
        body,
        |r: &ChatRequest| protocol::chat_logprobs(r.logprobs, r.top_logprobs),
        true,
    )?;
    let text = span("chat_template").in_scope(|| {
        let messages = protocol::template_messages(&req.messages)?;
        let tools = shape.tools.as_ref().map(|t| t.request.objects.as_slice());
        Ok::<_, ApiError>(
            st.tokenizer
                .apply_chat_template_with_tools(&messages, tools, true)?,
        )
    })?;
    st.check_prompt_bytes(text.len(), "messages")?;
    let prompt = span("tokenize").in_scope(|| st.tokenizer.encode(&text, false))?;
    Ok(Prepared {
        endpoint: Endpoint::Chat,
        prompt,
        echo: None,
        v,
        shape,
    })
}

fn prepare_completion(st: &ServedModel, body: &[u8]) -> Result<Prepared, ApiError> {
    let (req, v, shape) = validate(
        st,
        body,
        |r: &CompletionRequest| protocol::completion_logprobs(r.logprobs),
        false,
    )?;
    let tok = &st.tokenizer;
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::from(Invalid::OnePrompt(n)))
        }
    };
    let empty = match &req.prompt {
        Prompt::Text(t) => t.is_empty(),
        Prompt::Texts(ts) => ts.iter().any(String::is_empty),
        Prompt::Tokens(ids) => ids.is_empty(),
        Prompt::TokenLists(l) => l.iter().any(Vec::is_empty),
    };
    if empty {
        return Err(Invalid::EmptyPrompt.into());
    }
    let echo = req.echo.unwrap_or(false);
    let (prompt, text) = span("tokenize").in_scope(|| {
        let text = |t: String| {
            st.check_prompt_bytes(t.len(), "prompt")?;
            let ids = tok.encode(&t, true)?;
            Ok::<_, ApiError>((ids, echo.then_some(t)))
        };
        let ids = |ids: Vec<u32>| {
            // Checked before decoding anything: a long list, or ids the model lacks.
            let limit = st.max_model_len();
            if ids.len() >= limit {
                return Err(ApiError::context_length(
                    limit,
                    ids.len(),
                    v.max_tokens.unwrap_or(1),
                    "prompt",
                ));
            }
            let vocab = st.vocab_size();
            if let Some(i) = ids.iter().position(|&t| t as usize >= vocab) {
                return Err(ApiError::token_out_of_vocab(ids[i], i, vocab));
            }
            let t = if echo {
                Some(tok.decode(&ids, false)?)
            } else {
                None
            };
            Ok((ids, t))
        };
        match req.prompt {
            Prompt::Text(t) => text(t),
            Prompt::Texts(mut ts) => {
                one(ts.len())?;
                text(ts.remove(0))
            }
            Prompt::Tokens(l) => ids(l),
            Prompt::TokenLists(mut l) => {
                one(l.len())?;
                ids(l.remove(0))
            }
        }
    })?;
    Ok(Prepared {
        endpoint: Endpoint::Completion,
        prompt,
        echo: text,
        v,
        shape,
    })
}

async fn respond(
    st: Arc<AppState>,
    model: Arc<ServedModel>,
    prepared: Result<Prepared, ApiError>,
    start: Instant,
) -> Response {
    match run(st, &model, prepared, start).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(
    st: Arc<AppState>,
    model: &ServedModel,
    prepared: Result<Prepared, ApiError>,
    start: Instant,
) -> Result<Response, ApiError> {
    let Prepared {
        endpoint,
        prompt,
        echo,
        mut v,
        shape,
    } = prepared?;
    let limit = model.max_model_len();
    let plen = prompt.len();
    let param = if endpoint == Endpoint::Chat {
        "messages"
    } else {
        "prompt"
    };
    let max_tokens = match v.max_tokens {
        Some(m) if plen + m > limit => return Err(ApiError::context_length(limit, plen, m, param)),
        Some(m) => m,
        None if plen >= limit => return Err(ApiError::context_length(limit, plen, 1, param)),
        None if endpoint == Endpoint::Completion => 16.min(limit - plen),
        None => limit - plen,
    };
    v.params.max_tokens = max_tokens;
    v.params.logit_bias = shape.logit_bias;
    v.params.guide = shape.guide;
    let guide_field = shape.guide_field;
    let sub = model.engine.submit(EngineRequest {
        prompt: prompt.clone(),
        params: v.params.clone(),
    })?;
    let id = format!(
        "{}-{:x}{:08x}",
        if endpoint == Endpoint::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        sub.id(),
        start.elapsed().subsec_nanos() ^ (unix_now() as u32)
    );
    let span = tracing::Span::current();
    span.record("request_id", id.as_str());
    span.record("model", model.name.as_str());
    span.record("prompt_tokens", plen);
    span.record("max_tokens", max_tokens);
    span.record("stream", v.stream);
    let mut gen = Generation::new(
        sub,
        &prompt,
        v.stops.clone(),
        model.tokenizer.clone(),
        st.metrics.model(&model.name),
        start,
        span,
    )
    .with_guide_field(guide_field);
    if model.engine.is_local() {
        gen = gen.with_engine_phases();
    }
    let out = Output {
        endpoint,
        id,
        created: unix_now(),
        model: model.name.clone(),
        logprobs: v.params.logprobs.is_some(),
        tools: shape
            .tools
            .as_ref()
            .and_then(|t| t.format.map(|f| (f, t.forced))),
    };
    if v.stream {
        // A routed request may find every worker full or none there: wait for its first
        // event, so that is an HTTP status (429, 503) and not a 200 stream holding only an
        // error. A local engine refuses at submission, before this point.
        let first = if model.engine.is_local() {
            None
        } else {
            match gen.next().await {
                Some(Err(e)) => return Err(e),
                other => Some(other),
            }
        };
        Ok(stream(
            out,
            gen,
            first,
            prompt,
            echo,
            (v.include_usage, v.return_token_ids),
            st.streams.clone(),
        )
        .into_response())
    } else {
        collect(out, gen, prompt, echo, v.return_token_ids).await
    }
}

/// The parts of a response shared by every chunk.
struct Output {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    /// Calls are read out of the output in this format (forced by a grammar or not).
    tools: Option<(ToolFormat, bool)>,
}

impl Output {
    fn logprobs_json(&self, tok: &TextTokenizer, chunk: &Chunk, text_offset: &mut usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let text = |t: u32| tok.token_text(t);
        match self.endpoint {
            Endpoint::Chat => json!({"content": chunk.logprobs.iter().map(|l| {
                let s = text(l.token);
                json!({
                    "token": s, "logprob": l.logprob, "bytes": s.as_bytes(),
                    "top_logprobs": l.top.iter().map(|&(t, lp)| {
                        let s = text(t);
                        json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
                    }).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>()}),
            Endpoint::Completion => {
                let tokens: Vec<String> = chunk.logprobs.iter().map(|l| text(l.token)).collect();
                let mut offsets = Vec::new();
                for t in &tokens {
                    offsets.push(*text_offset);
                    *text_offset += t.len();
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": chunk.logprobs.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": chunk.logprobs.iter().map(|l| {
                        l.top.iter().map(|&(t, lp)| (text(t), json!(lp))).collect::<serde_json::Map<_, _>>()
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    /// The id of the response's `k`th tool call.
    fn call_id(&self, k: usize) -> String {
        format!("call_{}_{k}", self.id.rsplit('-').next().unwrap_or("0"))
    }

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }

    /// One streamed chunk with one choice, as text: what [`Output::envelope`] makes of it.
    fn chunk_event(&self, object: &str, choice: ChunkChoice<'_>) -> String {
        serde_json::to_string(&ChunkEnvelope {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices: [choice],
        })
        .expect("a chunk serialises")
    }
}

/// A streamed chunk's envelope, its fields in the order the API's objects have them.
#[derive(serde::Serialize)]
struct ChunkEnvelope<'a> {
    id: &'a str,
    object: &'a str,
    created: u64,
    model: &'a str,
    choices: [ChunkChoice<'a>; 1],
}

/// A streamed chunk's choice: `delta` (chat) or `text` (completions).
#[derive(serde::Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<ContentDelta<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    logprobs: &'a Value,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

#[derive(serde::Serialize)]
struct ContentDelta<'a> {
    content: &'a str,
}

async fn collect(
    out: Output,
    mut gen: Generation,
    prompt: Vec<u32>,
    echo: Option<String>,
    token_ids: bool,
) -> Result<Response, ApiError> {
    let mut all = Chunk::default();
    while let Some(c) = gen.next().await {
        all.absorb(c?);
    }
    let mut offset = 0;
    let logprobs = out.logprobs_json(gen.tokenizer(), &all, &mut offset);
    let mut finish = all.finish.unwrap_or("stop");
    let mut body = match out.endpoint {
        Endpoint::Chat => {
            let mut message = json!({"role": "assistant", "content": all.text});
            if let Some((format, _)) = out.tools {
                if let Some((content, calls)) = format.parse(&all.text) {
                    message["content"] = if content.is_empty() {
                        Value::Null
                    } else {
                        Value::String(content)
                    };
                    message["tool_calls"] = calls
                        .iter()
                        .enumerate()
                        .map(|(k, c)| c.to_json(&out.call_id(k)))
                        .collect();
                    if finish == "stop" {
                        finish = "tool_calls";
                    }
                }
            }
            let mut choice = json!({
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            });
            if token_ids {
                choice["token_ids"] = json!(all.token_ids);
            }
            out.envelope("chat.completion", json!([choice]))
        }
        Endpoint::Completion => {
            let text = match echo {
                Some(p) => p + &all.text,
                None => all.text,
            };
            let mut choice =
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish});
            if token_ids {
                choice["prompt_token_ids"] = json!(prompt);
                choice["token_ids"] = json!(all.token_ids);
            }
            out.envelope("text_completion", json!([choice]))
        }
    };
    body["usage"] = gen.usage();
    if token_ids && out.endpoint == Endpoint::Chat {
        body["prompt_token_ids"] = json!(prompt);
    }
    Ok((StatusCode::OK, Json(body)).into_response())
}

fn stream(
    out: Output,
    mut gen: Generation,
    mut peeked: Option<Option<Result<Chunk, ApiError>>>,
    prompt: Vec<u32>,
    echo: Option<String>,
    (include_usage, token_ids): (bool, bool),
    cut: StreamCut,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let s = async_stream::stream! {
        let data = |v: Value| Ok::<_, Infallible>(Event::default().data(v.to_string()));
        let (object, first) = match out.endpoint {
            Endpoint::Chat => ("chat.completion.chunk", json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})),
            Endpoint::Completion => ("text_completion", json!({"index": 0, "text": echo.clone().unwrap_or_default(), "logprobs": null, "finish_reason": null})),
        };
        let mut head = out.envelope(object, json!([first]));
        if token_ids {
            head["prompt_token_ids"] = json!(prompt);
        }
        if out.endpoint == Endpoint::Chat || echo.is_some() || token_ids {
            yield data(head);
        }
        let mut pending: Option<Chunk> = None;
        let mut offset = 0;
        let mut calls = out.tools.map(|(f, forced)| ToolStream::new(f, forced));
        loop {
            let next = match peeked.take() {
                Some(p) => p,
                None => tokio::select! {
                    n = gen.next() => n,
                    () = cut.wait() => Some(Err(ApiError::stream_cut())),
                },
            };
            let Some(next) = next else {
                break;
            };
            let c = match next {
                Ok(c) => c,
                Err(e) => {
                    // Headers are gone: report the failure in-band, as an error event.
                    yield data(e.body());
                    break;
                }
            };
            let c = match pending.take() {
                Some(mut p) => { p.absorb(c); p }
                None => c,
            };
            if c.text.is_empty() && c.finish.is_none() {
                pending = Some(c);
                continue;
            }
            let logprobs = out.logprobs_json(gen.tokenizer(), &c, &mut offset);
            if let Some(ts) = &mut calls {
                for v in tool_deltas(&out, ts, &c, logprobs) {
                    yield data(out.envelope(object, json!([v])));
                }
                continue;
            }
            // The one event every token makes: written from typed fields, in the same
            // order as the envelope's, without building a JSON map first.
            let ids = token_ids.then_some(c.token_ids.as_slice());
            let event = match out.endpoint {
                Endpoint::Chat => out.chunk_event(object, ChunkChoice {
                    index: 0,
                    delta: Some(ContentDelta { content: &c.text }),
                    text: None,
                    logprobs: &logprobs,
                    finish_reason: c.finish,
                    token_ids: ids,
                }),
                Endpoint::Completion => out.chunk_event(object, ChunkChoice {
                    index: 0,
                    delta: None,
                    text: Some(&c.text),
                    logprobs: &logprobs,
                    finish_reason: c.finish,
                    token_ids: ids,
                }),
            };
            yield Ok(Event::default().data(event));
        }
        if include_usage {
            let mut last = out.envelope(object, json!([]));
            last["usage"] = gen.usage();
            yield data(last);
        }
        // The request's place in the engine is free before the client sees the end.
        drop(gen);
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(s).keep_alive(KeepAlive::default())
}

/// A chunk of a chat stream whose calls are read out: its content, then what it adds to
/// the calls (a call's id and name once, then pieces of its arguments), the last carrying
/// the finish reason.
fn tool_deltas(out: &Output, ts: &mut ToolStream, c: &Chunk, logprobs: Value) -> Vec<Value> {
    let (content, calls) = ts.push(&c.text, c.finish.is_some());
    let mut deltas = Vec::new();
    if !content.is_empty() {
        deltas.push(json!({"content": content}));
    }
    for d in calls {
        deltas.push(match d {
            ToolDelta::Name { index, name } => json!({"tool_calls": [{"index": index,
                "id": out.call_id(index), "type": "function",
                "function": {"name": name, "arguments": ""}}]}),
            ToolDelta::Args { index, text } => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
            }
        });
    }
    let finish = c.finish.map(|f| {
        if f == "stop" && ts.made_calls() {
            "tool_calls"
        } else {
            f
        }
    });
    if deltas.is_empty() && finish.is_none() {
        return Vec::new();
    }
    if deltas.is_empty() {
        deltas.push(json!({}));
    }
    let n = deltas.len();
    deltas
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let last = i + 1 == n;
            json!({"index": 0, "delta": d,
                "logprobs": if last { logprobs.clone() } else { Value::Null },
                "finish_reason": if last { finish } else { None }})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The typed chunk is, byte for byte, what the envelope of a JSON choice would be.
    #[test]
    fn typed_chunks_are_the_envelope_s_bytes() {
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            let out = Output {
                endpoint,
                id: "chatcmpl-1a".into(),
                created: 1_700_000_000,
                model: "m \"q\"".into(),
                logprobs: false,
                tools: None,
            };
            for (finish, ids) in [(None, None), (Some("stop"), Some(&[1u32, 2][..]))] {
                let text = "a \"b\"\n\u{e9}";
                let logprobs = json!({"content": [1]});
                let mut choice = match endpoint {
                    Endpoint::Chat => {
                        json!({"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish})
                    }
                    Endpoint::Completion => {
                        json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
                    }
                };
                if let Some(ids) = ids {
                    choice["token_ids"] = json!(ids);
                }
                let want = out.envelope("obj", json!([choice])).to_string();
                let chat = endpoint == Endpoint::Chat;
                let got = out.chunk_event(
                    "obj",
                    ChunkChoice {
                        index: 0,
                        delta: chat.then_some(ContentDelta { content: text }),
                        text: (!chat).then_some(text),
                        logprobs: &logprobs,
                        finish_reason: finish,
                        token_ids: ids,
                    },
                );
                assert_eq!(got, want);
            }
        }
    }
}
