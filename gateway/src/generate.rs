//! One request's way through the engine: token events in, text deltas out, with the timings
//! the metrics record. Both endpoints, streaming or not, read from a `Generation`.

use std::sync::Arc;
use std::time::Instant;

use kvmesh_gpu::engine::{Progress, SeqEvent};
use kvmesh_gpu::guided::GRAMMAR_FAILED;
use kvmesh_gpu::tokenizer::{TextStream, TextTokenizer};
use kvmesh_telemetry::phases::Phases;

use crate::dispatch::{Event, Reply};
use crate::error::ApiError;
use crate::metrics::ModelMetrics;
use crate::validation::Invalid;

#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What one or more tokens added.
#[derive(Default, Debug)]
pub struct Chunk {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<&'static str>,
}

impl Chunk {
    /// Adds a later chunk's content to this one (used to skip chunks with no text yet).
    pub fn absorb(&mut self, later: Chunk) {
        self.text.push_str(&later.text);
        self.token_ids.extend(later.token_ids);
        self.logprobs.extend(later.logprobs);
        self.finish = later.finish;
    }
}

/// An engine's word on a sequence's progress, as spans of its phases.
pub fn record_progress(phases: &mut Phases, p: Progress) {
    match p {
        Progress::Scheduled {
            queued,
            cached_tokens,
        } => phases.scheduled(queued, cached_tokens),
        Progress::Prefilled { tokens, upto, step } => phases.prefilled(tokens, upto, step),
    }
}

pub struct Generation {
    sub: Reply,
    /// The request's span: TTFT, token counts and the outcome are recorded on it; it ends
    /// when the generation is dropped (after the last chunk was streamed).
    span: tracing::Span,
    /// From the first token to the last: detokenizing and streaming.
    stream_span: Option<tracing::Span>,
    /// An engine in this process: its queue, prefill and decode as spans.
    phases: Option<Phases>,
    text: TextStream,
    tok: Arc<TextTokenizer>,
    metrics: ModelMetrics,
    start: Instant,
    last: Option<Instant>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    done: bool,
    /// The request field whose grammar the output follows, if any.
    guide_field: Option<&'static str>,
}

/// A span's end is its last exit: entering it once more as the generation goes (after the
/// last chunk was streamed) makes the request's span cover the whole response.
impl Drop for Generation {
    fn drop(&mut self) {
        let _ = self.span.enter();
    }
}

impl Generation {
    pub fn new(
        sub: Reply,
        prompt: &[u32],
        stops: Vec<String>,
        tok: Arc<TextTokenizer>,
        metrics: ModelMetrics,
        start: Instant,
        span: tracing::Span,
    ) -> Generation {
        Generation {
            phases: None,
            sub,
            span,
            stream_span: None,
            text: TextStream::new(prompt, stops),
            tok,
            metrics,
            start,
            last: None,
            prompt_tokens: prompt.len(),
            completion_tokens: 0,
            cached_tokens: 0,
            done: false,
            guide_field: None,
        }
    }

    /// The next token's worth of output; `None` once finished.
    /// Names the field whose grammar the output follows (see [`Shape::guide_field`]).
    ///
    /// [`Shape::guide_field`]: crate::structured::Shape::guide_field
    pub fn with_guide_field(mut self, field: Option<&'static str>) -> Generation {
        self.guide_field = field;
        self
    }

    pub async fn next(&mut self) -> Option<Result<Chunk, ApiError>> {
        if self.done {
            return None;
        }
        let event = self.sub.next_event().await;
        let now = Instant::now();
        // An engine reports a step's progress before the step's tokens.
        if let (Some(ph), Some(progress)) = (&mut self.phases, self.sub.progress()) {
            while let Ok(p) = progress.try_recv() {
                record_progress(ph, p);
            }
        }
        match event {
            None => {
                self.done = true;
                Some(Err(self.failed(ApiError::internal(
                    "the engine stopped before the request finished",
                ))))
            }
            Some(Event::Unavailable { message, why }) => {
                self.done = true;
                Some(Err(self.failed(ApiError::no_worker(why, message))))
            }
            Some(Event::Engine(SeqEvent::Failed(m))) => {
                self.done = true;
                let e = match (self.guide_field, m.strip_prefix(GRAMMAR_FAILED)) {
                    // The grammar compiled but could not be followed to the end (it outgrew
                    // the matcher's limits): the request's fault, not the server's.
                    (Some(field), Some(why)) => ApiError::from(Invalid::CannotFollow {
                        field: field.to_string(),
                        why: why.to_string(),
                    }),
                    _ => ApiError::internal(format!("generation failed: {m}")),
                };
                Some(Err(self.failed(e)))
            }
            Some(Event::Engine(SeqEvent::Token {
                sampled,
                finish,
                cached_tokens,
            })) => {
                match self.last {
                    None => {
                        let ttft = (now - self.start).as_secs_f64();
                        self.metrics.ttft.observe(ttft);
                        self.span.record("ttft_ms", ttft * 1e3);
                        self.stream_span = Some(tracing::info_span!(
                            target: kvmesh_telemetry::TARGET,
                            parent: &self.span,
                            "detokenize_stream",
                            tokens = tracing::field::Empty,
                        ));
                    }
                    Some(t) => self.metrics.itl.observe((now - t).as_secs_f64()),
                }
                self.last = Some(now);
                self.cached_tokens = cached_tokens;
                self.completion_tokens += 1;
                if let Some(ph) = &mut self.phases {
                    ph.token(sampled.token);
                }
                let mut chunk = Chunk {
                    token_ids: vec![sampled.token],
                    logprobs: vec![TokenLogprob {
                        token: sampled.token,
                        logprob: sampled.logprob,
                        top: sampled.top,
                    }],
                    ..Default::default()
                };
                let delta = match self.text.push(&self.tok, sampled.token) {
                    Ok(d) => d,
                    Err(e) => return Some(Err(ApiError::internal(e.to_string()))),
                };
                chunk.text = delta.text;
                if delta.stopped {
                    // Dropping the submission later aborts the engine's sequence.
                    chunk.finish = Some("stop");
                } else if let Some(reason) = finish {
                    self.sub.finished();
                    match self.text.finish(&self.tok) {
                        Ok(rest) => {
                            chunk.text.push_str(&rest.text);
                            chunk.finish = Some(if rest.stopped {
                                "stop"
                            } else {
                                reason.as_str()
                            });
                        }
                        Err(e) => return Some(Err(ApiError::internal(e.to_string()))),
                    }
                }
                if let Some(reason) = chunk.finish {
                    self.done = true;
                    self.metrics.e2e.observe((now - self.start).as_secs_f64());
                    self.metrics.finished(reason);
                    self.span.record("finish_reason", reason);
                    self.span
                        .record("completion_tokens", self.completion_tokens);
                    self.span.record("cached_tokens", self.cached_tokens);
                    if let Some(s) = self.stream_span.take() {
                        s.record("tokens", self.completion_tokens);
                    }
                }
                Some(Ok(chunk))
            }
        }
    }

    /// For an engine in this process: traces its phases (queue, prefill, decode) under the
    /// request's span.
    pub fn with_engine_phases(mut self) -> Generation {
        self.phases = Some(Phases::new(&self.span, true, self.prompt_tokens));
        self
    }

    /// Records a failure on the request's span.
    fn failed(&mut self, e: ApiError) -> ApiError {
        self.stream_span = None;
        self.span.record("otel.status_code", "ERROR");
        self.span
            .record("otel.status_description", e.message.as_str());
        self.span
            .record("completion_tokens", self.completion_tokens);
        e
    }

    pub fn usage(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tok
    }
}
