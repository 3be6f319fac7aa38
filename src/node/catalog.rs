//! What a cluster gateway serves: every model some worker of the mesh serves, each through
//! its router pool, with the tokenizer, chat template and generation defaults of that
//! model's card. A card is fetched from one of the model's workers the first time a request
//! names the model, checked against the fingerprint the workers publish, and kept
//! (in memory, and under `--cache-dir` when given). A gateway started with `--model` has
//! that model's card from its own files.
//!
//! A card that fails its check (kept on disk, or sent by a worker) is never kept: a kept one
//! is removed and the card fetched from the workers, a worker whose card fails is asked
//! after the others. One fetch of a model's card runs at a time; after one failed at the
//! workers it asked, the model's requests get its error at once for a while (1 s, doubling
//! up to 30 s after each failure) unless a worker it did not ask has connected since.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_actors::router::WorkerLink;
use kvmesh_actors::{fetch_card_from, Pools, RoleRestarts, RouterCore};
use kvmesh_gateway::error::ApiError;
use kvmesh_gateway::tools::ToolFormat;
use kvmesh_gateway::{Catalog, ListedModel, Resolving, ServedModel};
use kvmesh_gpu::card::{CardModel, ModelCard};
use kvmesh_gpu::tokenizer::TextTokenizer;
use kvmesh_telemetry::metrics::Exposition;
use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use super::card_files::{CardFiles, FILE_PATIENCE};
use super::status::{render_restarts, RoutedDispatch};

/// How long a request waits for its model's card to be fetched (a worker to be connected,
/// the card to arrive) before it is refused with 503.
pub const CARD_PATIENCE: Duration = Duration::from_secs(10);

/// After a fetch failed at the workers it asked, how long its error stands before the card
/// is fetched again; doubled after each further failure, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The model a gateway was started with (`--model`).
pub struct LocalModel {
    pub name: String,
    pub tokenizer: Arc<TextTokenizer>,
    pub max_model_len: usize,
    pub fingerprint: String,
}

/// A model ready to serve: the fingerprint its card was checked against, and how.
struct Ready {
    fingerprint: String,
    served: Arc<ServedModel>,
}

/// How one fingerprint's card is fetched: one fetch at a time (the others wait for it and
/// find it ready), and what the failed ones found.
#[derive(Default)]
struct Fetching {
    turn: tokio::sync::Mutex<()>,
    state: Mutex<FetchState>,
}

#[derive(Default)]
struct FetchState {
    failed: Option<Failed>,
    /// Workers whose card failed its check: asked after the others.
    refused: BTreeSet<String>,
}

/// A fetch that failed at every worker it asked.
struct Failed {
    error: ApiError,
    /// Until when its error stands.
    until: Instant,
    backoff: Duration,
    asked: BTreeSet<String>,
}

/// Why a fetch from the workers failed, and whom it asked.
struct NotFetched {
    error: ApiError,
    asked: BTreeSet<String>,
}

pub struct MeshCatalog {
    pools: Arc<Pools>,
    restarts: Arc<RoleRestarts>,
    files: Option<Arc<CardFiles>>,
    /// By model name.
    ready: RwLock<BTreeMap<String, Ready>>,
    /// By fingerprint.
    fetching: Mutex<BTreeMap<String, Arc<Fetching>>>,
    /// Cards fetched from workers, by model and outcome (`ok`, `refused`: it failed its
    /// check, `failed`: none came).
    fetches: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// `--tool-call-parser`: how every model's tool calls are read.
    tool_parser: Option<ToolFormat>,
    /// The node's own engines' and KV side's families, when the gateway's node runs
    /// engines too (`--roles gateway,router,worker`, a `--no-etcd` node).
    local_metrics: std::sync::OnceLock<LocalMetrics>,
}

/// Renders a node's own worker families onto its gateway's `/metrics`.
pub type LocalMetrics = Box<dyn Fn(&Exposition) + Send + Sync>;

impl MeshCatalog {
    /// The node's own worker families join the gateway's `/metrics` (set once, at start).
    pub fn show_local_metrics(&self, render: LocalMetrics) {
        let _ = self.local_metrics.set(render);
    }

    pub fn new(
        pools: Arc<Pools>,
        restarts: Arc<RoleRestarts>,
        local: Option<LocalModel>,
        cache_dir: Option<PathBuf>,
        tool_parser: Option<ToolFormat>,
    ) -> Arc<MeshCatalog> {
        let catalog = MeshCatalog {
            pools,
            restarts,
            files: cache_dir.map(|d| Arc::new(CardFiles::new(&d))),
            ready: RwLock::new(BTreeMap::new()),
            fetching: Mutex::new(BTreeMap::new()),
            fetches: Mutex::new(BTreeMap::new()),
            tool_parser,
            local_metrics: std::sync::OnceLock::new(),
        };
        if let Some(m) = local {
            if let Some(pool) = catalog.pools.get(&m.name) {
                let served = catalog.served(&pool, m.tokenizer, m.max_model_len);
                catalog.ready.write().insert(
                    m.name.clone(),
                    Ready {
                        fingerprint: m.fingerprint,
                        served,
                    },
                );
            }
        }
        let catalog = Arc::new(catalog);
        tokio::spawn(prefetch(Arc::downgrade(&catalog)));
        catalog
    }

    fn served(
        &self,
        pool: &Arc<RouterCore>,
        tokenizer: Arc<TextTokenizer>,
        max_model_len: usize,
    ) -> Arc<ServedModel> {
        Arc::new(
            ServedModel::new(
                pool.model.clone(),
                tokenizer,
                Arc::new(RoutedDispatch(pool.clone(), self.restarts.clone())),
                max_model_len,
            )
            .with_tool_parser(self.tool_parser),
        )
    }

    /// The served model of `pool`, when its card is here and of the pool's fingerprint.
    fn ready_for(&self, pool: &RouterCore) -> Option<Arc<ServedModel>> {
        let ready = self.ready.read();
        let r = ready.get(&pool.model)?;
        (r.fingerprint == pool.model_fingerprint).then(|| r.served.clone())
    }

    /// Names of the models with a routable worker.
    fn served_names(&self) -> Vec<String> {
        self.pools
            .all()
            .iter()
            .filter(|p| !p.routable().is_empty())
            .map(|p| p.model.clone())
            .collect()
    }

    fn not_found(&self, asked: &str) -> ApiError {
        if self.pools.all().is_empty() {
            // Nothing joined yet (or everything left): the cluster is starting, not wrong.
            return ApiError::unavailable(format!(
                "no worker has joined the mesh yet, so no model is served (asked for \
                 {}); try again when one has joined",
                kvmesh_gateway::error::quoted(asked)
            ));
        }
        let names = self.served_names();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        ApiError::model_not_found(asked, &names)
    }

    /// The pool a request's `model` names. Without one, the only model there is.
    fn pool(&self, name: Option<&str>) -> Result<Arc<RouterCore>, ApiError> {
        match name {
            Some(n) => self.pools.get(n).ok_or_else(|| self.not_found(n)),
            None => {
                let all = self.pools.all();
                match all.as_slice() {
                    [one] => Ok(one.clone()),
                    [] => Err(ApiError::unavailable(
                        "no worker of any model has joined the mesh yet",
                    )),
                    _ => {
                        let names: Vec<String> =
                            all.iter().map(|p| format!("`{}`", p.model)).collect();
                        Err(ApiError::param(
                            "model",
                            format!(
                                "This server serves several models: name one of {}.",
                                names.join(", ")
                            ),
                        ))
                    }
                }
            }
        }
    }

    /// The served model of `pool`, its card fetched (or kept) and checked, by `deadline`.
    async fn resolve_pool(
        &self,
        pool: Arc<RouterCore>,
        deadline: Instant,
    ) -> Result<Arc<ServedModel>, ApiError> {
        if let Some(m) = self.ready_for(&pool) {
            return Ok(m);
        }
        let fetching = self
            .fetching
            .lock()
            .entry(pool.model_fingerprint.clone())
            .or_default()
            .clone();
        let Ok(_turn) = tokio::time::timeout_at(deadline, fetching.turn.lock()).await else {
            return Err(ApiError::unavailable(format!(
                "the card of model '{}' is still being fetched from its workers; try again",
                pool.model
            )));
        };
        // Fetched while this request waited its turn.
        if let Some(m) = self.ready_for(&pool) {
            return Ok(m);
        }
        if let Some(e) = fetching.standing(&pool) {
            return Err(e);
        }
        let loaded = match self.kept(&pool, deadline).await {
            Some(loaded) => loaded,
            None => match self.fetch(&pool, &fetching, deadline).await {
                Ok(loaded) => loaded,
                Err(NotFetched { error, asked }) => {
                    fetching.failed(&error, asked);
                    return Err(error);
                }
            },
        };
        fetching.state.lock().failed = None;
        Ok(self.serve(&pool, loaded))
    }

    /// Serves `pool`'s model with its checked card from now on.
    fn serve(&self, pool: &Arc<RouterCore>, loaded: CardModel) -> Arc<ServedModel> {
        let max_model_len = loaded.card.max_model_len;
        let served = self.served(pool, Arc::new(loaded.tokenizer), max_model_len);
        tracing::info!(
            "serving model '{}' (fingerprint {}) with the card of its workers",
            pool.model,
            pool.model_fingerprint
        );
        self.ready.write().insert(
            pool.model.clone(),
            Ready {
                fingerprint: pool.model_fingerprint.clone(),
                served: served.clone(),
            },
        );
        served
    }

    /// The card kept under `--cache-dir`, checked. One that cannot be read in time (at most
    /// [`FILE_PATIENCE`], and not past `deadline`) is passed over; one that fails its check
    /// is removed. Either way the card is fetched again.
    async fn kept(&self, pool: &RouterCore, deadline: Instant) -> Option<CardModel> {
        let files = self.files.as_ref()?;
        let fp = &pool.model_fingerprint;
        let within = FILE_PATIENCE.min(deadline.saturating_duration_since(Instant::now()));
        if within.is_zero() {
            return None;
        }
        let card = match files.read(fp, within).await {
            Ok(card) => card?,
            Err(e) => {
                tracing::warn!("model '{}': {e}; fetching its card again", pool.model);
                return None;
            }
        };
        match check(card, fp.clone()).await {
            Ok(loaded) => Some(loaded),
            Err(e) => {
                let path = files.path(fp).unwrap_or_default();
                tracing::warn!(
                    "{}: {e}; removed, and the card fetched from the model's workers",
                    path.display()
                );
                if let Err(e) = files.remove(fp).await {
                    tracing::warn!("{e}");
                }
                None
            }
        }
    }

    /// The card of `pool`'s model from one of its workers, checked, by `deadline`: each
    /// connected worker is asked in turn (those whose card failed its check before, last),
    /// and again, with a growing pause, while none is connected or none answers (each
    /// waited for at most half of [`CARD_PATIENCE`], leaving time to ask another). It
    /// fails at once when every connected worker's card failed its check.
    async fn fetch(
        &self,
        pool: &RouterCore,
        fetching: &Fetching,
        deadline: Instant,
    ) -> Result<CardModel, NotFetched> {
        let fp = &pool.model_fingerprint;
        let mut asked = BTreeSet::new();
        // This fetch's failures by worker, and whether its card was refused.
        let mut failures: BTreeMap<String, (String, bool)> = BTreeMap::new();
        let mut pause = Duration::from_millis(50);
        loop {
            for link in fetching.order(pool, &failures) {
                if Instant::now() >= deadline {
                    break;
                }
                let id = link.record.node_id.clone();
                asked.insert(id.clone());
                let within = deadline
                    .saturating_duration_since(Instant::now())
                    .min(CARD_PATIENCE / 2);
                let refused = match fetch_card_from(&link, fp, within).await {
                    Err(e) => {
                        self.count(&pool.model, "failed");
                        failures.insert(id, (e.to_string(), false));
                        continue;
                    }
                    Ok(bytes) => match check_bytes(bytes.clone(), fp.clone()).await {
                        Ok(loaded) => {
                            self.count(&pool.model, "ok");
                            fetching.state.lock().refused.remove(&id);
                            self.keep(fp, bytes);
                            return Ok(loaded);
                        }
                        Err(e) => e,
                    },
                };
                self.count(&pool.model, "refused");
                tracing::warn!("model '{}': worker {id}'s card: {refused}", pool.model);
                fetching.state.lock().refused.insert(id.clone());
                failures.insert(id.clone(), (format!("{id}: {refused}"), true));
            }
            let connected: Vec<_> = pool
                .workers()
                .into_iter()
                .filter(|w| w.connected())
                .collect();
            let all_refused = !connected.is_empty()
                && connected
                    .iter()
                    .all(|w| failures.get(&w.record.node_id).is_some_and(|f| f.1));
            let now = Instant::now();
            if all_refused || now >= deadline {
                let error = not_fetched(&pool.model, &failures);
                return Err(NotFetched { error, asked });
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }

    /// Keeps a checked card's bytes under `--cache-dir`, without holding up its requests.
    fn keep(&self, fingerprint: &str, bytes: Vec<u8>) {
        let Some(files) = self.files.clone() else {
            return;
        };
        let fp = fingerprint.to_string();
        tokio::spawn(async move {
            if let Err(e) = files.store(&fp, bytes).await {
                tracing::warn!("cannot keep the model card: {e}");
            }
        });
    }

    fn count(&self, model: &str, outcome: &'static str) {
        *self
            .fetches
            .lock()
            .entry((model.to_string(), outcome))
            .or_default() += 1;
    }
}

impl Fetching {
    /// The error of the last failed fetch while it stands: until its backoff ends, or a
    /// worker it did not ask connects.
    fn standing(&self, pool: &RouterCore) -> Option<ApiError> {
        let state = self.state.lock();
        let f = state.failed.as_ref()?;
        let now = Instant::now();
        let new_worker = pool
            .workers()
            .iter()
            .any(|w| w.connected() && !f.asked.contains(&w.record.node_id));
        if now >= f.until || new_worker {
            return None;
        }
        let mut e = f.error.clone();
        e.message = format!(
            "{} (the card is fetched again in {:.1} s)",
            e.message,
            (f.until - now).as_secs_f64()
        );
        Some(e)
    }

    /// Remembers a failed fetch: its error stands for the next backoff.
    fn failed(&self, error: &ApiError, asked: BTreeSet<String>) {
        let mut state = self.state.lock();
        if asked.is_empty() {
            // No worker was there to ask: nothing to pace.
            state.failed = None;
            return;
        }
        let backoff = state
            .failed
            .as_ref()
            .map_or(RETRY_FIRST, |f| (f.backoff * 2).min(RETRY_MAX));
        state.failed = Some(Failed {
            error: error.clone(),
            until: Instant::now() + backoff,
            backoff,
            asked,
        });
    }

    /// The connected workers of `pool` to ask now: not those whose card this fetch refused,
    /// and those whose card an earlier fetch refused last.
    fn order(
        &self,
        pool: &RouterCore,
        failures: &BTreeMap<String, (String, bool)>,
    ) -> Vec<Arc<WorkerLink>> {
        let refused = self.state.lock().refused.clone();
        let mut links: Vec<_> = pool
            .workers()
            .into_iter()
            .filter(|w| w.connected())
            .filter(|w| !failures.get(&w.record.node_id).is_some_and(|f| f.1))
            .collect();
        links.sort_by_key(|w| refused.contains(&w.record.node_id));
        links
    }
}

/// The error of a fetch that got no card it could use: 502 when a card failed its check,
/// else 503.
fn not_fetched(model: &str, failures: &BTreeMap<String, (String, bool)>) -> ApiError {
    let refused: Vec<&str> = failures
        .values()
        .filter(|f| f.1)
        .map(|f| f.0.as_str())
        .collect();
    if !refused.is_empty() {
        return ApiError::bad_gateway(format!(
            "no worker of model '{model}' gave a card that passes its check: {}",
            refused.join("; ")
        ));
    }
    let why = if failures.is_empty() {
        format!("no worker of model '{model}' is connected to fetch its card from")
    } else {
        let each: Vec<&str> = failures.values().map(|f| f.0.as_str()).collect();
        each.join("; ")
    };
    ApiError::unavailable(format!(
        "the card of model '{model}' could not be fetched from its workers within {} s: {why}",
        CARD_PATIENCE.as_secs()
    ))
}

/// Checks a card against `fingerprint` (off the async threads: a large tokenizer takes a
/// while to build).
async fn check(card: ModelCard, fingerprint: String) -> Result<CardModel, String> {
    tokio::task::spawn_blocking(move || card.load(&fingerprint).map_err(|e| e.to_string()))
        .await
        .unwrap_or_else(|e| Err(format!("checking the model card failed: {e}")))
}

/// Reads a card's bytes and checks it, as [`check`].
async fn check_bytes(bytes: Vec<u8>, fingerprint: String) -> Result<CardModel, String> {
    tokio::task::spawn_blocking(move || {
        ModelCard::from_bytes(&bytes)
            .and_then(|card| card.load(&fingerprint))
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| Err(format!("checking the model card failed: {e}")))
}

/// How often the gateway looks for models whose card it has not fetched yet.
const PREFETCH_EVERY: Duration = Duration::from_millis(100);

/// Fetches the card of every model with a connected worker as soon as it has one, so that
/// its first request does not wait for it; each model's fetch runs on its own. A request
/// that comes first shares the fetch. A card that could not be fetched or checked is tried
/// again after [`CARD_PATIENCE`] (its requests say why meanwhile). Ends with the catalog.
async fn prefetch(catalog: std::sync::Weak<MeshCatalog>) {
    // By fingerprint: fetching now (None), or failed at.
    let tries: Arc<parking_lot::Mutex<BTreeMap<String, Option<tokio::time::Instant>>>> =
        Arc::default();
    loop {
        let Some(c) = catalog.upgrade() else {
            return;
        };
        for pool in c.pools.all() {
            let fp = pool.model_fingerprint.clone();
            let due = match tries.lock().get(&fp) {
                None => true,
                Some(None) => false,
                Some(Some(failed)) => failed.elapsed() > CARD_PATIENCE,
            };
            let connected = pool.workers().iter().any(|w| w.connected());
            if !due || !connected || c.ready_for(&pool).is_some() {
                continue;
            }
            tries.lock().insert(fp.clone(), None);
            let (c, tries) = (c.clone(), tries.clone());
            tokio::spawn(async move {
                let model = pool.model.clone();
                match c.resolve_pool(pool, Instant::now() + CARD_PATIENCE).await {
                    Ok(_) => {
                        tries.lock().remove(&fp);
                    }
                    Err(e) => {
                        tracing::warn!("model '{model}': {}", e.message);
                        tries.lock().insert(fp, Some(tokio::time::Instant::now()));
                    }
                }
            });
        }
        drop(c);
        tokio::time::sleep(PREFETCH_EVERY).await;
    }
}

impl Catalog for MeshCatalog {
    fn listed(&self) -> Vec<ListedModel> {
        self.pools
            .all()
            .iter()
            .filter_map(|p| {
                let max_model_len = p.max_model_len()?;
                Some(ListedModel {
                    name: p.model.clone(),
                    max_model_len,
                })
            })
            .collect()
    }

    fn resolve<'a>(&'a self, name: Option<&'a str>) -> Resolving<'a> {
        Box::pin(async move {
            // No worker has joined at all (a cluster starting, or every worker restarting):
            // wait for one, as a request for a pool without a routable worker does, before
            // saying so.
            let deadline = Instant::now() + CARD_PATIENCE;
            while self.pools.all().is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let pool = self.pool(name)?;
            self.resolve_pool(pool, deadline).await
        })
    }

    fn render_metrics(&self, out: &Exposition) {
        kvmesh_actors::router::render_pools(&self.pools.all(), out);
        render_restarts(out, &self.restarts);
        if let Some(local) = self.local_metrics.get() {
            local(out);
        }
        let fetches = self.fetches.lock();
        out.counters(
            "kvmesh:model_card_fetches_total",
            "Model cards fetched from workers, by outcome: ok, refused (the card failed its \
             check against the model's fingerprint), failed (no card came).",
            &["model_name", "outcome"],
            fetches
                .iter()
                .map(|((m, o), n)| (vec![m.as_str(), *o], *n as f64)),
        );
    }
}
