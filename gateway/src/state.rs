//! What a gateway serves: its models, where their requests go, and the limits every request is
//! checked against.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvmesh_gpu::guided::LazyGuides;
use kvmesh_gpu::tokenizer::TextTokenizer;
use kvmesh_telemetry::metrics::Exposition;

use crate::dispatch::Dispatch;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::tools::ToolFormat;
use crate::traces::Traces;

/// A model a gateway serves and where its requests go.
pub struct ServedModel {
    pub name: String,
    pub tokenizer: Arc<TextTokenizer>,
    pub engine: Arc<dyn Dispatch>,
    /// Used for `max_model_len` while no worker is there to say (cluster gateways).
    pub default_max_model_len: usize,
    /// The most bytes of text one token stands for (see [`max_bytes_per_token`]); `None`
    /// when this tokenizer can make one token of any length of text.
    pub bytes_per_token: Option<usize>,
    /// Compiles requests' grammars over this model's vocabulary (built on first use): the
    /// engine's own when it runs in this process.
    pub guides: Arc<LazyGuides>,
    /// How the model writes tool calls, as the operator named it (`--tool-call-parser`);
    /// `None`: as its chat template shows.
    pub tool_parser: Option<ToolFormat>,
}

impl ServedModel {
    pub fn new(
        name: String,
        tokenizer: Arc<TextTokenizer>,
        engine: Arc<dyn Dispatch>,
        default_max_model_len: usize,
    ) -> ServedModel {
        let bytes_per_token = max_bytes_per_token(&tokenizer);
        match bytes_per_token {
            Some(b) => tracing::debug!(
                "{name}: no token stands for more than {b} bytes: longer prompts than max model \
                 length x {b} bytes are refused before tokenizing"
            ),
            None => tracing::info!(
                "{name}: this tokenizer can make one token of arbitrarily long text: prompts \
                 are measured only by tokenizing them"
            ),
        }
        let n_logits = engine
            .vocab_size()
            .unwrap_or_else(|| tokenizer.vocab_size());
        let guides = engine
            .guides()
            .unwrap_or_else(|| Arc::new(LazyGuides::new(tokenizer.clone(), n_logits)));
        ServedModel {
            guides,
            tool_parser: None,
            name,
            tokenizer,
            engine,
            default_max_model_len,
            bytes_per_token,
        }
    }

    /// Reads tool calls in `format` whatever the chat template shows.
    pub fn with_tool_parser(mut self, format: Option<ToolFormat>) -> ServedModel {
        self.tool_parser = format;
        self
    }

    /// The format tool calls are read (and forced) in: `--tool-call-parser`'s, else the one
    /// the chat template shows.
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.tool_parser.or_else(|| {
            self.tokenizer
                .chat_template_text()
                .and_then(ToolFormat::of_template)
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
        let tok = self.tokenizer.vocab_size();
        self.engine
            .vocab_size()
            .map_or(tok, |engine| engine.min(tok))
    }

    pub fn max_model_len(&self) -> usize {
        self.engine
            .max_model_len()
            .unwrap_or(self.default_max_model_len)
    }
}

/// A model as `/v1/models` lists it.
pub struct ListedModel {
    pub name: String,
    pub max_model_len: usize,
}

/// A future a [`Catalog`] answers with.
pub type Resolving<'a> =
    Pin<Box<dyn Future<Output = Result<Arc<ServedModel>, ApiError>> + Send + 'a>>;

/// The models a gateway serves: one fixed model (`kvmesh serve`), or whatever the mesh's
/// workers serve (a cluster gateway).
pub trait Catalog: Send + Sync {
    /// The models `/v1/models` lists now: those a request can be served for.
    fn listed(&self) -> Vec<ListedModel>;
    /// The model a request names (`None`: it names none), waiting when it is being
    /// prepared; an unknown model is a 404 naming those served.
    fn resolve<'a>(&'a self, name: Option<&'a str>) -> Resolving<'a>;
    /// The metric families of the engines or routers behind the models.
    fn render_metrics(&self, out: &Exposition);
    /// The one model served whatever a request names, when there is only ever one: its
    /// requests skip reading `model` ahead of the rest of the body (the body's checks
    /// refuse another name).
    fn only(&self) -> Option<Arc<ServedModel>> {
        None
    }
}

/// One model, always there: `kvmesh serve`.
pub struct OneModel(pub Arc<ServedModel>);

impl Catalog for OneModel {
    fn listed(&self) -> Vec<ListedModel> {
        vec![ListedModel {
            name: self.0.name.clone(),
            max_model_len: self.0.max_model_len(),
        }]
    }

    fn resolve<'a>(&'a self, name: Option<&'a str>) -> Resolving<'a> {
        let m = &self.0;
        let got = match name {
            Some(n) if n != m.name => Err(ApiError::model_not_found(n, &[m.name.as_str()])),
            _ => Ok(m.clone()),
        };
        Box::pin(std::future::ready(got))
    }

    fn render_metrics(&self, out: &Exposition) {
        self.0.engine.render_metrics(out, &self.0.name);
    }

    fn only(&self) -> Option<Arc<ServedModel>> {
        Some(self.0.clone())
    }
}

/// Ends the gateway's open streams, each with an error event in the OpenAI shape: when a
/// shutdown's grace period is over, clients learn their stream was cut, not that it ended.
#[derive(Clone)]
pub struct StreamCut(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for StreamCut {
    fn default() -> StreamCut {
        StreamCut(Arc::new(tokio::sync::watch::channel(false).0))
    }
}

impl StreamCut {
    pub fn cut(&self) {
        self.0.send_replace(true);
    }

    /// Resolves once the streams are cut (never, if they are not).
    pub async fn wait(&self) {
        let mut rx = self.0.subscribe();
        if rx.wait_for(|c| *c).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Requests with grammars that may wait for the compile pool; past this many, more are
/// refused with 429 until the queue drains.
pub const MAX_WAITING_COMPILES: usize = 64;

/// A bounded number of blocking jobs at once, and of jobs waiting their turn.
pub(crate) struct WorkPool {
    pub(crate) name: &'static str,
    pub(crate) permits: Arc<tokio::sync::Semaphore>,
    waiting: Arc<std::sync::atomic::AtomicUsize>,
    max_waiting: usize,
}

/// A place in a [`WorkPool`]'s queue, given back when dropped.
pub(crate) struct Waiting(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl WorkPool {
    fn new(name: &'static str, permits: usize, max_waiting: usize) -> WorkPool {
        WorkPool {
            name,
            permits: Arc::new(tokio::sync::Semaphore::new(permits)),
            waiting: Default::default(),
            max_waiting,
        }
    }

    /// A place in the queue, unless it is full.
    pub(crate) fn enter(&self) -> Option<Waiting> {
        use std::sync::atomic::Ordering;
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_waiting).then_some(n + 1)
            })
            .ok()
            .map(|_| Waiting(self.waiting.clone()))
    }

    /// Jobs running or waiting.
    pub fn queued(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Acquire)
    }
}

pub struct AppState {
    pub catalog: Arc<dyn Catalog>,
    pub api_key: Option<String>,
    pub metrics: Arc<Metrics>,
    pub created: u64,
    /// The trace viewer's sources, when tracing is on.
    pub traces: Option<Arc<Traces>>,
    /// Requests being parsed, templated and tokenized at once, at most: that work runs off
    /// the async threads, so one client's huge prompts cannot stall the others.
    pub(crate) prepare_pool: WorkPool,
    /// The same for requests that bring grammars (structured outputs, tools), whose
    /// compiling can take hundreds of milliseconds: apart, so a flood of them never makes
    /// plain requests wait, and with a bounded queue.
    pub(crate) compile_pool: WorkPool,
    /// Cut by the server's owner when its shutdown grace period ends.
    pub streams: StreamCut,
}

impl AppState {
    pub fn new(
        catalog: Arc<dyn Catalog>,
        api_key: Option<String>,
        traces: Option<Arc<Traces>>,
    ) -> Arc<AppState> {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let metrics = Arc::new(Metrics::new());
        // The series of the models known at start are there from the first scrape.
        for m in catalog.listed() {
            metrics.model(&m.name);
        }
        Arc::new(AppState {
            catalog,
            metrics,
            api_key,
            created: unix_now(),
            traces,
            prepare_pool: WorkPool::new("prepare", cores.clamp(2, 16), usize::MAX),
            compile_pool: WorkPool::new("compile", (cores / 2).clamp(1, 8), MAX_WAITING_COMPILES),
            streams: StreamCut::default(),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The compile pool's queue is bounded: past it a place is refused (the request gets a
    /// 429), and a place given back is free again.
    #[test]
    fn a_work_pool_queues_at_most_its_bound() {
        let pool = WorkPool::new("compile", 1, 3);
        let places: Vec<Waiting> = std::iter::from_fn(|| pool.enter()).take(10).collect();
        assert_eq!(places.len(), 3);
        assert_eq!(pool.queued(), 3);
        assert!(pool.enter().is_none());
        drop(places);
        assert_eq!(pool.queued(), 0);
        assert!(pool.enter().is_some());
        // The plain pool has no bound on its queue.
        let plain = WorkPool::new("prepare", 2, usize::MAX);
        let many: Vec<Waiting> = std::iter::from_fn(|| plain.enter()).take(1000).collect();
        assert_eq!(many.len(), 1000);
    }
}
