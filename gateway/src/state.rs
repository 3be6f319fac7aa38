//! What a gateway serves: the model, where its requests go, and the limits every request is
//! checked against.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvmesh_gpu::tokenizer::TextTokenizer;

use crate::dispatch::Dispatch;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::traces::Traces;

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
    pub traces: Option<Arc<Traces>>,
    /// The most bytes of text one token stands for (see [`max_bytes_per_token`]); `None`
    /// when this tokenizer can make one token of any length of text.
    pub bytes_per_token: Option<usize>,
    /// Requests being parsed, templated and tokenized at once, at most: that work runs off
    /// the async threads, so one client's huge prompts cannot stall the others.
    pub(crate) prepare_permits: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    pub fn new(
        model: ServedModel,
        api_key: Option<String>,
        traces: Option<Arc<Traces>>,
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
            metrics: Arc::new(Metrics::new(&model.name)),
            model,
            api_key,
            created: unix_now(),
            traces,
            bytes_per_token,
            prepare_permits: Arc::new(tokio::sync::Semaphore::new(cores.clamp(2, 16))),
        })
    }

    /// Refuses a prompt text that cannot fit the context whatever its tokens, before
    /// tokenizing it: each token stands for at most `bytes_per_token` bytes of text.
    pub(crate) fn check_prompt_bytes(&self, bytes: usize, param: &str) -> Result<(), ApiError> {
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
    pub(crate) fn vocab_size(&self) -> usize {
        let tok = self.model.tokenizer.vocab_size();
        self.model
            .engine
            .vocab_size()
            .map_or(tok, |engine| engine.min(tok))
    }

    pub(crate) fn max_model_len(&self) -> usize {
        self.model
            .engine
            .max_model_len()
            .unwrap_or(self.model.default_max_model_len)
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

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
