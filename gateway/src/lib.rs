//! kvmesh's OpenAI-compatible HTTP gateway: validates requests, applies the chat template,
//! tokenizes, hands token ids to an engine, and streams text back as vLLM serves it.

pub mod dispatch;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod protocol;
pub mod traces;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use kvmesh_gpu::engine::Request as EngineRequest;
use kvmesh_gpu::tokenizer::TextTokenizer;

pub use dispatch::Dispatch;
use error::ApiError;
use generate::{Chunk, Generation};
use metrics::Metrics;
use protocol::{ChatRequest, CompletionRequest, Prompt, Validated};

/// The model a gateway serves and where its requests go.
pub struct ServedModel {
    pub name: String,
    pub tokenizer: Arc<TextTokenizer>,
    pub engine: Arc<dyn Dispatch>,
    /// Used for `max_model_len` while no worker is there to say (cluster gateways).
    pub default_max_model_len: usize,
}

pub struct AppState {
    pub model: ServedModel,
    pub api_key: Option<String>,
    pub metrics: Arc<Metrics>,
    pub created: u64,
    /// The trace viewer's sources, when tracing is on.
    pub traces: Option<Arc<traces::Traces>>,
}

impl AppState {
    pub fn new(
        model: ServedModel,
        api_key: Option<String>,
        traces: Option<Arc<traces::Traces>>,
    ) -> Arc<AppState> {
        Arc::new(AppState {
            model,
            api_key,
            metrics: Arc::new(Metrics::default()),
            created: unix_now(),
            traces,
        })
    }

    fn max_model_len(&self) -> usize {
        self.model
            .engine
            .max_model_len()
            .unwrap_or(self.model.default_max_model_len)
    }
}

/// A child span of the request's, for one phase of the gateway's work.
fn span(name: &'static str) -> tracing::Span {
    use kvmesh_telemetry::TARGET;
    match name {
        "validate" => tracing::info_span!(target: TARGET, "validate"),
        "chat_template" => tracing::info_span!(target: TARGET, "chat_template"),
        _ => tracing::info_span!(target: TARGET, "tokenize"),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key))
        .route_layer(middleware::from_fn(traces::trace_request));
    Router::new()
        .merge(v1)
        .merge(traces::routes())
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route(
            "/version",
            get(|| async { Json(json!({"version": env!("CARGO_PKG_VERSION")})) }),
        )
        .route("/metrics", get(metrics_page))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

async fn require_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|k| k.trim() == key);
        if !ok {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn count_requests(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "other".into());
    let resp = next.run(req).await;
    st.metrics.http(&endpoint, resp.status().as_u16());
    resp
}

async fn metrics_page(State(st): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(&st.model.name, st.model.engine.as_ref()),
    )
        .into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": st.model.name,
        "object": "model",
        "created": st.created,
        "owned_by": "kvmesh",
        "root": st.model.name,
        "max_model_len": st.max_model_len(),
    }]}))
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
}

async fn chat(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let start = Instant::now();
    let prepared = (|| {
        let (req, v) = span("validate").in_scope(|| {
            let body = protocol::parse_body(&body)?;
            let req: ChatRequest = protocol::fields(&body)?;
            let top = protocol::chat_logprobs(req.logprobs, req.top_logprobs)?;
            let v = protocol::validate_common(
                &protocol::fields(&body)?,
                &st.model.name,
                st.model.tokenizer.sampling_defaults(),
                top,
            )?;
            Ok::<_, ApiError>((req, v))
        })?;
        let text = span("chat_template").in_scope(|| {
            let messages = protocol::template_messages(&req.messages)?;
            Ok::<_, ApiError>(st.model.tokenizer.apply_chat_template(&messages, true)?)
        })?;
        let prompt = span("tokenize").in_scope(|| st.model.tokenizer.encode(&text, false))?;
        Ok::<_, ApiError>(Prepared {
            endpoint: Endpoint::Chat,
            prompt,
            echo: None,
            v,
        })
    })();
    respond(st, prepared, start).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let start = Instant::now();
    let prepared = (|| {
        let (req, v) = span("validate").in_scope(|| {
            let body = protocol::parse_body(&body)?;
            let req: CompletionRequest = protocol::fields(&body)?;
            let top = protocol::completion_logprobs(req.logprobs)?;
            let v = protocol::validate_common(
                &protocol::fields(&body)?,
                &st.model.name,
                st.model.tokenizer.sampling_defaults(),
                top,
            )?;
            Ok::<_, ApiError>((req, v))
        })?;
        let tok = &st.model.tokenizer;
        let one = |n: usize| {
            if n == 1 {
                Ok(())
            } else {
                Err(ApiError::param(
                    "prompt",
                    format!("Send one prompt per request (got {n})."),
                ))
            }
        };
        let empty = match &req.prompt {
            Prompt::Text(t) => t.is_empty(),
            Prompt::Texts(ts) => ts.iter().any(String::is_empty),
            Prompt::Tokens(ids) => ids.is_empty(),
            Prompt::TokenLists(l) => l.iter().any(Vec::is_empty),
        };
        if empty {
            return Err(ApiError::param("prompt", "The prompt is empty."));
        }
        let (prompt, text) = span("tokenize").in_scope(|| {
            Ok::<_, ApiError>(match req.prompt {
                Prompt::Text(t) => (tok.encode(&t, true)?, t),
                Prompt::Texts(ts) => {
                    one(ts.len())?;
                    (tok.encode(&ts[0], true)?, ts[0].clone())
                }
                Prompt::Tokens(ids) => {
                    let t = tok.decode(&ids, false)?;
                    (ids, t)
                }
                Prompt::TokenLists(mut l) => {
                    one(l.len())?;
                    let ids = l.remove(0);
                    let t = tok.decode(&ids, false)?;
                    (ids, t)
                }
            })
        })?;
        let echo = req.echo.unwrap_or(false).then_some(text);
        Ok::<_, ApiError>(Prepared {
            endpoint: Endpoint::Completion,
            prompt,
            echo,
            v,
        })
    })();
    respond(st, prepared, start).await
}

async fn respond(
    st: Arc<AppState>,
    prepared: Result<Prepared, ApiError>,
    start: Instant,
) -> Response {
    match run(st, prepared, start).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(
    st: Arc<AppState>,
    prepared: Result<Prepared, ApiError>,
    start: Instant,
) -> Result<Response, ApiError> {
    let Prepared {
        endpoint,
        prompt,
        echo,
        mut v,
    } = prepared?;
    let limit = st.max_model_len();
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
    let sub = st.model.engine.submit(EngineRequest {
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
        sub.id.0,
        start.elapsed().subsec_nanos() ^ (unix_now() as u32)
    );
    let span = tracing::Span::current();
    span.record("request_id", id.as_str());
    span.record("model", st.model.name.as_str());
    span.record("prompt_tokens", plen);
    span.record("max_tokens", max_tokens);
    span.record("stream", v.stream);
    let mut gen = Generation::new(
        sub,
        &prompt,
        v.stops.clone(),
        st.model.tokenizer.clone(),
        st.metrics.clone(),
        start,
        span,
    );
    if st.model.engine.is_local() {
        gen = gen.with_engine_phases();
    }
    let out = Output {
        endpoint,
        id,
        created: unix_now(),
        model: st.model.name.clone(),
        logprobs: v.params.logprobs.is_some(),
    };
    if v.stream {
        Ok(stream(out, gen, prompt, echo, v.include_usage, v.return_token_ids).into_response())
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

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }
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
    let finish = all.finish.unwrap_or("stop");
    let mut body = match out.endpoint {
        Endpoint::Chat => {
            let mut choice = json!({
                "index": 0,
                "message": {"role": "assistant", "content": all.text},
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
    prompt: Vec<u32>,
    echo: Option<String>,
    include_usage: bool,
    token_ids: bool,
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
        while let Some(next) = gen.next().await {
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
            let mut choice = match out.endpoint {
                Endpoint::Chat => json!({"index": 0, "delta": {"content": c.text}, "logprobs": logprobs, "finish_reason": c.finish}),
                Endpoint::Completion => json!({"index": 0, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish}),
            };
            if token_ids {
                choice["token_ids"] = json!(c.token_ids);
            }
            yield data(out.envelope(object, json!([choice])));
        }
        if include_usage {
            let mut last = out.envelope(object, json!([]));
            last["usage"] = gen.usage();
            yield data(last);
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(s).keep_alive(KeepAlive::default())
}
