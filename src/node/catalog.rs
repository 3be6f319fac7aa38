//! What a cluster gateway serves: every model some worker of the mesh serves, each through
//! its router pool, with the tokenizer, chat template and generation defaults of that
//! model's card. A card is fetched from one of the model's workers the first time a
//! request names the model, checked against the fingerprint the workers publish, and kept
//! (in memory, and under `--cache-dir` when given). A gateway started with `--model` has
//! that model's card from its own files.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_actors::{fetch_card, Pools, RoleRestarts, RouterCore};
use kvmesh_gateway::error::ApiError;
use kvmesh_gateway::{Catalog, ListedModel, Resolving, ServedModel};
use kvmesh_gpu::card::ModelCard;
use kvmesh_gpu::tokenizer::TextTokenizer;
use kvmesh_telemetry::metrics::Exposition;
use parking_lot::RwLock;

use super::status::{render_restarts, RoutedDispatch};

/// How long a request waits for its model's card to be fetched (a worker to be connected,
/// the card to arrive) before it is refused with 503.
pub const CARD_PATIENCE: Duration = Duration::from_secs(10);

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

pub struct MeshCatalog {
    pools: Arc<Pools>,
    restarts: Arc<RoleRestarts>,
    cache_dir: Option<PathBuf>,
    /// By model name.
    ready: RwLock<BTreeMap<String, Ready>>,
    /// One fetch at a time per fingerprint; the others wait for it and find it ready.
    fetching: tokio::sync::Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl MeshCatalog {
    pub fn new(
        pools: Arc<Pools>,
        restarts: Arc<RoleRestarts>,
        local: Option<LocalModel>,
        cache_dir: Option<PathBuf>,
    ) -> Arc<MeshCatalog> {
        let catalog = MeshCatalog {
            pools,
            restarts,
            cache_dir,
            ready: RwLock::new(BTreeMap::new()),
            fetching: tokio::sync::Mutex::new(BTreeMap::new()),
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
        Arc::new(ServedModel::new(
            pool.model.clone(),
            tokenizer,
            Arc::new(RoutedDispatch(pool.clone(), self.restarts.clone())),
            max_model_len,
        ))
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
                 '{asked}'); try again when one has joined"
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

    async fn resolve_pool(&self, pool: Arc<RouterCore>) -> Result<Arc<ServedModel>, ApiError> {
        if let Some(m) = self.ready_for(&pool) {
            return Ok(m);
        }
        let fingerprint = pool.model_fingerprint.clone();
        let turn = self
            .fetching
            .lock()
            .await
            .entry(fingerprint.clone())
            .or_default()
            .clone();
        let _turn = turn.lock().await;
        // Fetched while this request waited its turn.
        if let Some(m) = self.ready_for(&pool) {
            return Ok(m);
        }
        let card = self.card(&pool).await?;
        let max_model_len = card.max_model_len;
        let name = pool.model.clone();
        let loaded = tokio::task::spawn_blocking(move || card.load(&fingerprint))
            .await
            .map_err(|e| ApiError::internal(format!("loading a model card failed: {e}")))?
            .map_err(|e| ApiError::bad_gateway(e.to_string()))?;
        self.store(&loaded.card);
        let served = self.served(&pool, Arc::new(loaded.tokenizer), max_model_len);
        tracing::info!(
            "serving model '{name}' (fingerprint {}) with the card of its workers",
            pool.model_fingerprint
        );
        self.ready.write().insert(
            name,
            Ready {
                fingerprint: pool.model_fingerprint.clone(),
                served: served.clone(),
            },
        );
        Ok(served)
    }

    /// The card of `pool`'s model: from `--cache-dir`, else from one of its workers, waiting
    /// up to [`CARD_PATIENCE`] for one to be connected and answer.
    async fn card(&self, pool: &RouterCore) -> Result<ModelCard, ApiError> {
        if let Some(card) = self.cached(&pool.model_fingerprint) {
            return Ok(card);
        }
        let deadline = tokio::time::Instant::now() + CARD_PATIENCE;
        loop {
            let why = match fetch_card(pool).await {
                Ok(bytes) => match ModelCard::from_bytes(&bytes) {
                    Ok(card) => return Ok(card),
                    Err(e) => return Err(ApiError::bad_gateway(e.to_string())),
                },
                Err(why) => why,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::unavailable(format!(
                    "the card of model '{}' could not be fetched from its workers within {} s: \
                     {why}",
                    pool.model,
                    CARD_PATIENCE.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn card_path(&self, fingerprint: &str) -> Option<PathBuf> {
        let ok = !fingerprint.is_empty() && fingerprint.chars().all(|c| c.is_ascii_hexdigit());
        let dir = self.cache_dir.as_ref().filter(|_| ok)?;
        Some(dir.join("cards").join(format!("{fingerprint}.json")))
    }

    /// A card kept under `--cache-dir`; one that cannot be read is fetched again.
    fn cached(&self, fingerprint: &str) -> Option<ModelCard> {
        let path = self.card_path(fingerprint)?;
        let bytes = std::fs::read(&path).ok()?;
        match ModelCard::from_bytes(&bytes) {
            Ok(card) => Some(card),
            Err(e) => {
                tracing::warn!("{}: {e}; fetching the card again", path.display());
                None
            }
        }
    }

    /// Keeps a checked card under `--cache-dir` (written whole, then renamed into place).
    fn store(&self, card: &ModelCard) {
        let Some(path) = self.card_path(&card.fingerprint) else {
            return;
        };
        let tmp = path.with_extension("json.tmp");
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, card.to_bytes()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!("cannot keep the model card in {}: {e}", path.display());
        }
    }
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
                match c.resolve_pool(pool).await {
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
            let deadline = tokio::time::Instant::now() + CARD_PATIENCE;
            while self.pools.all().is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let pool = self.pool(name)?;
            self.resolve_pool(pool).await
        })
    }

    fn render_metrics(&self, out: &Exposition) {
        kvmesh_actors::router::render_pools(&self.pools.all(), out);
        render_restarts(out, &self.restarts);
    }
}
