//! A request's phases in an engine, as spans under the span of whoever serves it: `queue`
//! until the engine schedules it, `prefill` with a `prefill.chunk` per step, then `decode`
//! with one event per token (not a span per token). Nothing is recorded for an unsampled
//! request.

use std::time::Duration;

use opentelemetry::KeyValue;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::TARGET;

pub struct Phases {
    on: bool,
    prompt_len: usize,
    parent: tracing::Span,
    queue: Option<tracing::Span>,
    prefill: Option<tracing::Span>,
    chunk: Option<tracing::Span>,
    decode: Option<tracing::Span>,
    tokens: usize,
}

impl Phases {
    /// `local_prefill`: the prompt is computed by this engine (so there is a queue and a
    /// prefill to show); a decode worker taking the KV from elsewhere shows its transfer
    /// instead.
    pub fn new(parent: &tracing::Span, local_prefill: bool, prompt_len: usize) -> Phases {
        let on = crate::is_sampled(parent);
        Phases {
            on,
            prompt_len,
            parent: parent.clone(),
            queue: (on && local_prefill)
                .then(|| tracing::info_span!(target: TARGET, parent: parent, "queue")),
            prefill: None,
            chunk: None,
            decode: None,
            tokens: 0,
        }
    }

    /// Tokens seen so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    fn chunk_span(&self) -> Option<tracing::Span> {
        self.prefill.as_ref().map(|p| {
            tracing::info_span!(
                target: TARGET,
                parent: p,
                "prefill.chunk",
                tokens = Empty,
                upto = Empty,
                step_ms = Empty,
            )
        })
    }

    /// The engine admitted the request after `queued`, with `cached_tokens` of its prompt
    /// found in the prefix cache.
    pub fn scheduled(&mut self, queued: Duration, cached_tokens: usize) {
        if !self.on {
            return;
        }
        self.parent.record("queued_ms", queued.as_secs_f64() * 1e3);
        self.parent.record("cached_tokens", cached_tokens as u64);
        if self.queue.take().is_some() {
            self.prefill = Some(tracing::info_span!(
                target: TARGET,
                parent: &self.parent,
                "prefill",
                cached_tokens,
            ));
            self.chunk = self.chunk_span();
        }
    }

    /// A step computed `tokens` prompt tokens, up to position `upto`, in `step`.
    pub fn prefilled(&mut self, tokens: usize, upto: usize, step: Duration) {
        if !self.on {
            return;
        }
        if let Some(c) = self.chunk.take() {
            c.record("tokens", tokens as u64);
            c.record("upto", upto as u64);
            c.record("step_ms", step.as_secs_f64() * 1e3);
        }
        if upto < self.prompt_len {
            self.chunk = self.chunk_span();
        }
    }

    /// A token was generated.
    pub fn token(&mut self, token: u32) {
        self.tokens += 1;
        if !self.on {
            return;
        }
        if self.decode.is_none() {
            self.queue = None;
            self.chunk = None;
            self.prefill = None;
            self.decode = Some(tracing::info_span!(
                target: TARGET,
                parent: &self.parent,
                "decode",
                tokens = Empty,
            ));
        }
        if let Some(d) = &self.decode {
            // Straight to the OpenTelemetry span: a token is on the hot path, and a tracing
            // event would go through every layer's filters and visitors.
            d.add_event(
                "token",
                vec![
                    KeyValue::new("i", self.tokens as i64),
                    KeyValue::new("id", token as i64),
                ],
            );
        }
    }
}

impl Drop for Phases {
    fn drop(&mut self) {
        if let Some(d) = &self.decode {
            d.record("tokens", self.tokens as u64);
        }
    }
}
