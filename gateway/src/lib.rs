//! kvmesh's OpenAI-compatible HTTP gateway: validates requests, applies the chat template,
//! tokenizes, hands token ids to an engine, and streams text back as vLLM serves it.

pub mod dispatch;
pub mod error;
pub mod generate;
pub mod http;
pub mod metrics;
pub mod protocol;
pub mod traces;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
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
    /// The most bytes of text one token stands for (see [`max_bytes_per_token`]); `None`
    /// when this tokenizer can make one token of any length of text.
    pub bytes_per_token: Option<usize>,
    /// Requests being parsed, templated and tokenized at once, at most: that work runs off
    /// the async threads, so one client's huge prompts cannot stall the others.
    prepare_permits: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    pub fn new(
        model: ServedModel,
        api_key: Option<String>,
        traces: Option<Arc<traces::Traces>>,
    ) -> Arc<AppState> {
        let bytes_per_token = max_bytes_per_token(&model.tokenizer);
        match bytes_per_token {
            Some(b) => tracing::debug!(
                "no token stands for more than {b} bytes: longer prompts than max model length \
                 x {b} bytes are refused before tokenizing"
            ),
            None => tracing::info!(
                "this tokenizer can make one token of arbitrarily long text: prompts are \
                 measured only by tokenizing them"
            ),
        }
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Arc::new(AppState {
            model,
            api_key,
            metrics: Arc::new(Metrics::default()),
            created: unix_now(),
            traces,
            bytes_per_token,
            prepare_permits: Arc::new(tokio::sync::Semaphore::new(cores.clamp(2, 16))),
        })
    }

    /// Refuses a prompt text that cannot fit the context whatever its tokens, before
    /// tokenizing it: each token stands for at most `bytes_per_token` bytes of text.
    fn check_prompt_bytes(&self, bytes: usize, param: &str) -> Result<(), ApiError> {
        let Some(per) = self.bytes_per_token else {
            return Ok(());
        };
        let limit = self.max_model_len();
        if bytes > limit.saturating_mul(per) {
            return Err(ApiError::prompt_too_many_bytes(limit, bytes, per, param));
        }
        Ok(())
    }

    /// Token ids a prompt may hold: below both the tokenizer's and the engine's vocabulary.
    fn vocab_size(&self) -> usize {
        let tok = self.model.tokenizer.vocab_size();
        self.model
            .engine
            .vocab_size()
            .map_or(tok, |engine| engine.min(tok))
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

/// The most bytes of text one token of `tok` can stand for, so that a prompt of more than
/// `n` times that many bytes surely has more than `n` tokens; `None` when no such bound
/// holds for this tokenizer.
///
/// The bound is the longest token's text over the vocabulary, plus one byte (decoders of
/// SentencePiece vocabularies drop the leading space of a token on its own). It holds for
/// tokenizers that keep every byte of the input in some token (byte-level BPE, SentencePiece
/// with byte fallback: what Llama, Qwen, Mistral and GPT-2 style models use). Texts that
/// tokenizers of other kinds shrink or drop (runs of whitespace, characters a normalizer
/// deletes, unknown characters fused into one token) are tried at start-up: if any comes
/// out denser than the bound, there is none.
pub fn max_bytes_per_token(tok: &TextTokenizer) -> Option<usize> {
    let vocab = tok.vocab_size().min(u32::MAX as usize) as u32;
    let longest = (0..vocab).map(|id| tok.token_text(id).len()).max()?;
    let per = longest.max(1) + 1;
    const PROBES: [&str; 16] = [
        " ",
        "\n",
        "\t",
        "\r\n",
        "\u{a0}",
        "\u{3000}",
        "\u{200b}",
        "\u{feff}",
        "\u{301}",
        "e\u{301}",
        "\u{fb01}",
        "\u{e000}",
        "\u{10fffd}",
        "\u{1f600}",
        "\u{7}",
        "\0",
    ];
    for p in PROBES {
        // Long enough that one token standing for all of it would show.
        let text = p.repeat((4 * per + 1024).div_ceil(p.len()));
        match tok.encode(&text, false) {
            Ok(ids) if ids.len().saturating_mul(per) >= text.len() => {}
            _ => return None,
        }
    }
    Some(per)
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
        .layer(DefaultBodyLimit::max(http::MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

async fn require_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        if !authorized(req.headers(), key) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Whether `headers` carry `Authorization: Bearer <key>`; the scheme's case does not matter
/// (RFC 7235), and the key is compared in constant time.
pub fn authorized(headers: &axum::http::HeaderMap, key: &str) -> bool {
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let v = v.trim_start();
    let Some((scheme, token)) = v.split_once([' ', '\t']) else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
    }
    let (a, b) = (token.trim().as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Why an API key cannot be used, if it cannot: one that could never be sent would lock
/// every route.
pub fn check_api_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err(
            "the API key is empty, which would refuse every request; leave --api-key \
                    (and KVMESH_API_KEY) unset to serve without one"
                .into(),
        );
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(
            "the API key must be printable ASCII without spaces (it is sent in an \
                    `Authorization: Bearer <key>` header)"
                .into(),
        );
    }
    Ok(())
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
    let prepared = prepare(&st, body, prepare_chat).await;
    respond(st, prepared, start).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let start = Instant::now();
    let prepared = prepare(&st, body, prepare_completion).await;
    respond(st, prepared, start).await
}

/// Bodies up to this size are parsed and tokenized where they arrive: that takes tens of
/// microseconds, less than the two thread hand-offs of the blocking pool would add to the
/// time to first token. Larger ones go to the pool.
const INLINE_PREPARE_BYTES: usize = 4096;

/// A request's CPU work (parsing, the chat template, tokenizing): inline for a small body,
/// else off the async threads (see [`off_runtime`]).
async fn prepare(
    st: &Arc<AppState>,
    body: Bytes,
    work: fn(&AppState, &[u8]) -> Result<Prepared, ApiError>,
) -> Result<Prepared, ApiError> {
    if body.len() <= INLINE_PREPARE_BYTES {
        return work(st, &body);
    }
    off_runtime(st, move |st| work(st, &body)).await
}

/// Runs a request's CPU work on the blocking pool, a bounded number at a time (waiting
/// turns in order), under the request's span.
async fn off_runtime(
    st: &Arc<AppState>,
    work: impl FnOnce(&AppState) -> Result<Prepared, ApiError> + Send + 'static,
) -> Result<Prepared, ApiError> {
    let permit = st
        .prepare_permits
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("the gateway is shutting down"))?;
    let span = tracing::Span::current();
    let st = st.clone();
    // The permit goes with the work: a client that hangs up does not free it early.
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        span.in_scope(|| work(&st))
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}

/// The body parsed once, unsupported fields refused, read as the endpoint's request `R`
/// and as the fields every endpoint shares; `top` says how many top logprobs `R` asks for.
fn validate<R: serde::de::DeserializeOwned>(
    st: &AppState,
    body: &[u8],
    top: impl FnOnce(&R) -> Result<Option<usize>, ApiError>,
) -> Result<(R, Validated), ApiError> {
    span("validate").in_scope(|| {
        let body = protocol::parse_body(body)?;
        protocol::refuse_unsupported(&body)?;
        let req: R = protocol::fields(&body)?;
        let top = top(&req)?;
        let v = protocol::validate_common(
            &protocol::fields(&body)?,
            &st.model.name,
            st.model.tokenizer.sampling_defaults(),
            top,
        )?;
        Ok((req, v))
    })
}

fn prepare_chat(st: &AppState, body: &[u8]) -> Result<Prepared, ApiError> {
    let (req, v) = validate(st, body, |r: &ChatRequest| {
        protocol::chat_logprobs(r.logprobs, r.top_logprobs)
    })?;
    let text = span("chat_template").in_scope(|| {
        let messages = protocol::template_messages(&req.messages)?;
        Ok::<_, ApiError>(st.model.tokenizer.apply_chat_template(&messages, true)?)
    })?;
    st.check_prompt_bytes(text.len(), "messages")?;
    let prompt = span("tokenize").in_scope(|| st.model.tokenizer.encode(&text, false))?;
    Ok(Prepared {
        endpoint: Endpoint::Chat,
        prompt,
        echo: None,
        v,
    })
}

fn prepare_completion(st: &AppState, body: &[u8]) -> Result<Prepared, ApiError> {
    let (req, v) = validate(st, body, |r: &CompletionRequest| {
        protocol::completion_logprobs(r.logprobs)
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
    })
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
        // A routed request may find every worker full or none there: wait for its first
        // event, so that is an HTTP status (429, 503) and not a 200 stream holding only an
        // error. A local engine refuses at submission, before this point.
        let first = if st.model.engine.is_local() {
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
            v.include_usage,
            v.return_token_ids,
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
    mut peeked: Option<Option<Result<Chunk, ApiError>>>,
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
        loop {
            let next = match peeked.take() {
                Some(p) => p,
                None => gen.next().await,
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
        // The request's place in the engine is free before the client sees the end.
        drop(gen);
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(s).keep_alive(KeepAlive::default())
}
