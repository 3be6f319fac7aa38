//! A model as served: its config, tokenizer and weights, from a Hugging Face folder or from
//! files compiled into the binary.

use std::path::Path;
use std::sync::Arc;

use crate::backend::cpu::{CpuBackend, CpuModel, HybridBackend, HybridModel};
use crate::backend::error::BackendError;
use crate::backend::sim::SimBackend;
use crate::backend::{Backend, CudaOptions};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_pool::{KvDtype, KvSpec};
use crate::safetensors::WeightStore;
use crate::tokenizer::{TextTokenizer, TokenizerFiles};

/// How the CPU backend runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuOptions {
    /// Prompt-sized products of bf16 weights with the activations rounded to bf16, on
    /// AVX512-BF16 (`CpuModel::with_bf16_products`; `--cpu-bf16-products`): faster prefill,
    /// bf16 rounding of the products' inputs as GPU engines have. Dense models only.
    pub bf16_products: bool,
    /// FP8 checkpoints: products of more rows than this round their input to e4m3 as an
    /// FP8 GEMM does (`CpuModel::with_fp8_activations`), the model the CUDA backend's FP8
    /// path computes (its decode GEMVs read few rows unquantized: give it
    /// `CudaOptions::fp8_gemv_max_rows`). `None`, the default, runs the dequantized model.
    pub fp8_activations_above: Option<usize>,
}

/// A model's weights as the CPU backends hold them.
#[derive(Clone)]
pub enum CpuWeights {
    Dense(Arc<CpuModel>),
    Hybrid(Arc<HybridModel>),
}

pub struct LoadedModel {
    /// The folder's name, or the embedded model's.
    pub name: String,
    pub config: ModelConfig,
    pub tokenizer: Arc<TextTokenizer>,
    pub weights: WeightStore,
    /// The text of `config.json` and the tokenizer's files as read: what a model card
    /// gives a gateway that has no copy of the model.
    pub config_json: String,
    pub files: TokenizerFiles,
    /// The ids a sim backend of this model emits ([`sim_outputs`]), found once: finding
    /// them decodes and encodes much of the vocabulary, and `--replicas` starts thousands.
    sim_words: std::sync::OnceLock<Vec<u32>>,
    /// The CPU backends' weights, made on first use and shared by every engine built from
    /// this model (a node's prefill and decode engines hold one copy, not two).
    cpu_weights: std::sync::OnceLock<(CpuOptions, CpuWeights)>,
    /// What was derived from the model once for many engines of it: fingerprints by
    /// numerics, and bytes by key ([`LoadedModel::derived_bytes`]).
    derived: std::sync::Mutex<Derived>,
    /// Device copies of the weights by device, while a backend holds one: the GPU backends
    /// of this model on one device share one copy.
    pub device_weights: crate::backend::DeviceWeightCache,
}

#[derive(Default)]
struct Derived {
    fingerprints: Vec<(Numerics, String)>,
    bytes: Vec<(String, Arc<Vec<u8>>)>,
}

/// Whose numbers a served model's tokens are: the model's own (a backend that runs its
/// math, on any device), or the sim backend's, which reads no weight and makes its tokens
/// up. Part of the fingerprint: a router never routes one name's requests to both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numerics {
    Model,
    Simulated,
}

/// Files of a model compiled into the binary.
pub struct EmbeddedModel {
    pub name: &'static str,
    pub config_json: &'static str,
    pub safetensors: &'static [u8],
    pub tokenizer_json: &'static [u8],
    pub tokenizer_config: Option<&'static str>,
    pub chat_template: Option<&'static str>,
    pub generation_config: Option<&'static str>,
}

/// Where a build with the `external-default-model` feature reads the default model's
/// weights: `$KVMESH_DEFAULT_MODEL_DIR`, else `models/shakespeare` under the working
/// directory (the repository root, where the GPU checks run).
fn external_weights_dir() -> std::path::PathBuf {
    std::env::var_os("KVMESH_DEFAULT_MODEL_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("models/shakespeare"))
}

impl LoadedModel {
    /// The weights the CPU backends run with `opts`, made the first time (bf16 kept as bf16)
    /// and shared by every later caller with the same options: engines built from one
    /// `LoadedModel` hold one copy. A caller with other options gets a copy of its own.
    pub fn cpu_weights(&self, opts: CpuOptions) -> Result<CpuWeights> {
        if let Some((o, w)) = self.cpu_weights.get() {
            if *o == opts {
                return Ok(w.clone());
            }
        }
        let w = if self.config.hybrid.is_some() {
            let m = HybridModel::load(&self.config, &self.weights)?;
            let m = match opts.fp8_activations_above {
                Some(rows) => m.with_fp8_activations(&self.weights, rows)?,
                None => m,
            };
            CpuWeights::Hybrid(Arc::new(m))
        } else {
            let m = CpuModel::load(&self.config, &self.weights)?;
            let m = if opts.bf16_products {
                m.with_bf16_products()
            } else {
                m
            };
            let m = match opts.fp8_activations_above {
                Some(rows) => m.with_fp8_activations(&self.weights, rows)?,
                None => m,
            };
            CpuWeights::Dense(Arc::new(m))
        };
        // Two threads loading at once: the first stored wins and both use it.
        let (o, kept) = self.cpu_weights.get_or_init(|| (opts, w.clone()));
        Ok(if *o == opts { kept.clone() } else { w })
    }

    pub fn from_dir(dir: &Path) -> Result<LoadedModel> {
        if !dir.is_dir() {
            return Err(EngineError::BadModel(format!(
                "{} is not a model folder",
                dir.display()
            )));
        }
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| {
            EngineError::BadModel(format!(
                "{} is missing or unreadable ({e})",
                cfg_path.display()
            ))
        })?;
        let config = ModelConfig::from_json(&text)?;
        let files = TokenizerFiles::read_dir(dir)?;
        let tokenizer = TextTokenizer::from_files(&files, &config.eos_token_ids)?;
        let weights = WeightStore::open_dir(dir)?;
        let name = std::fs::canonicalize(dir)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| dir.display().to_string());
        Self::checked(LoadedModel {
            name,
            config,
            tokenizer: Arc::new(tokenizer),
            weights,
            config_json: text,
            files,
            sim_words: Default::default(),
            cpu_weights: Default::default(),
            derived: Default::default(),
            device_weights: Default::default(),
        })
    }

    pub fn from_embedded(e: &EmbeddedModel) -> Result<LoadedModel> {
        let config = ModelConfig::from_json(e.config_json)?;
        let files = TokenizerFiles {
            tokenizer_json: e.tokenizer_json.to_vec(),
            tokenizer_config: e.tokenizer_config.map(String::from),
            chat_template_jinja: e.chat_template.map(String::from),
            generation_config: e.generation_config.map(String::from),
        };
        let tokenizer = TextTokenizer::from_files(&files, &config.eos_token_ids)?;
        let weights = if e.safetensors.is_empty() {
            // Built with `external-default-model`: the same files, read from the repository.
            let dir = external_weights_dir();
            WeightStore::open_dir(&dir).map_err(|err| {
                EngineError::InvalidRequest(format!(
                    "this kvmesh was built without the default model's weights (feature \
                     external-default-model) and reads them from {}: {err}; run it from the \
                     repository root or set KVMESH_DEFAULT_MODEL_DIR",
                    dir.display()
                ))
            })?
        } else {
            WeightStore::from_static("model.safetensors", e.safetensors)?
        };
        Self::checked(LoadedModel {
            name: e.name.to_string(),
            config,
            tokenizer: Arc::new(tokenizer),
            weights,
            config_json: e.config_json.to_string(),
            files,
            sim_words: Default::default(),
            cpu_weights: Default::default(),
            derived: Default::default(),
            device_weights: Default::default(),
        })
    }

    /// A short fingerprint of what makes two copies of a model compute the same numbers and
    /// read the same text: the parsed config, the tokenizer (every token and id, end ids, its
    /// config, chat template and generation defaults) and the served digest
    /// ([`LoadedModel::served_digest`]), which says whose numbers they are. Two workers that
    /// disagree on it must not exchange KV or share a name's requests, and a gateway must not
    /// tokenize for one with the other's tokenizer.
    pub fn fingerprint(&self, numerics: Numerics) -> String {
        let known = self
            .derived()
            .fingerprints
            .iter()
            .find(|(n, _)| *n == numerics)
            .map(|(_, f)| f.clone());
        if let Some(f) = known {
            return f;
        }
        let f = fingerprint_of(
            &self.config,
            &self.tokenizer,
            &self.files,
            &self.served_digest(numerics),
        );
        self.derived().fingerprints.push((numerics, f.clone()));
        f
    }

    /// Bytes derived from the model (a model card, say), made by `make` the first time
    /// `key` is asked for and shared after that.
    pub fn derived_bytes(
        &self,
        key: &str,
        make: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<Arc<Vec<u8>>> {
        if let Some((_, b)) = self.derived().bytes.iter().find(|(k, _)| k == key) {
            return Ok(b.clone());
        }
        let b = Arc::new(make()?);
        self.derived().bytes.push((key.to_string(), b.clone()));
        Ok(b)
    }

    fn derived(&self) -> std::sync::MutexGuard<'_, Derived> {
        self.derived.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The weights' digest as served: [`LoadedModel::weights_digest`] when the backend
    /// computes with the weights, and a mark of the timing model in front of it when it does
    /// not, so that the sim backend's made-up tokens never pass for the model's.
    pub fn served_digest(&self, numerics: Numerics) -> String {
        match numerics {
            Numerics::Model => self.weights_digest(),
            Numerics::Simulated => format!("sim-{}", self.weights_digest()),
        }
    }

    /// A digest of the weights: every tensor's name, dtype and shape, and a sample of its
    /// bytes (its start, middle and end). A model card carries it, so that a gateway without
    /// the weights can still recompute the fingerprint from the card's files.
    pub fn weights_digest(&self) -> String {
        let mut h = Fnv::default();
        let mut names = self.weights.names();
        names.sort_unstable();
        for name in names {
            let Some((info, bytes)) = self.weights.raw(name) else {
                continue;
            };
            h.write(name.as_bytes());
            h.write(format!("{:?}{:?}", info.dtype, info.shape).as_bytes());
            const SAMPLE: usize = 256;
            let n = bytes.len();
            for start in [0, n / 2, n.saturating_sub(SAMPLE)] {
                h.write(&bytes[start.min(n)..(start + SAMPLE).min(n)]);
            }
        }
        format!("{:016x}", h.0)
    }

    fn checked(m: LoadedModel) -> Result<LoadedModel> {
        check_tensors(&m.config, &m.weights)?;
        if m.tokenizer.vocab_size() > m.config.vocab_size {
            tracing::warn!(
                "tokenizer has {} tokens but the model's vocabulary is {}; ids past it are refused",
                m.tokenizer.vocab_size(),
                m.config.vocab_size
            );
        }
        Ok(m)
    }
}

/// Refuses weights that do not match the config: a tensor the config implies is missing, or
/// one it does not account for is present (a bias the config turned off, a layer beyond
/// `num_hidden_layers`, a head for another task). Either means the config does not describe
/// these weights, and running them anyway would compute something else than the model.
pub fn check_tensors(cfg: &ModelConfig, w: &WeightStore) -> Result<()> {
    let expected = cfg.expected_tensors();
    let missing: Vec<&str> = expected
        .iter()
        .map(String::as_str)
        .filter(|n| !w.contains(n))
        .collect();
    if !missing.is_empty() {
        return Err(EngineError::BadModel(format!(
            "weights: {} tensor(s) the config implies are missing: {}{}",
            missing.len(),
            missing[..missing.len().min(4)].join(", "),
            if missing.len() > 4 { ", …" } else { "" }
        )));
    }
    let known: std::collections::HashSet<&str> = expected.iter().map(String::as_str).collect();
    let extra: Vec<&str> = w
        .names()
        .into_iter()
        // Rotary tables some old checkpoints carry; recomputed from the config, as
        // transformers does.
        .filter(|n| !known.contains(n) && !n.ends_with("rotary_emb.inv_freq"))
        // Parts of a checkpoint the config knows of and leaves unread (Qwen3.5's vision
        // tower and multi-token-prediction head).
        .filter(|n| !cfg.ignores_tensor(n))
        .collect();
    for name in extra {
        if name == "lm_head.weight" && cfg.tie_word_embeddings {
            let same = match (w.raw(name), w.raw("model.embed_tokens.weight")) {
                (Some((a, ab)), Some((b, bb))) => {
                    a.dtype == b.dtype && a.shape == b.shape && ab == bb
                }
                _ => false,
            };
            if same {
                continue;
            }
            return Err(EngineError::BadModel(
                "config.json says tie_word_embeddings is true, but the weights hold an                  lm_head.weight that differs from model.embed_tokens.weight; set                  tie_word_embeddings to false if the separate head is meant"
                    .into(),
            ));
        }
        let why = if name.ends_with(".bias") {
            " (a bias the config does not turn on: attention_bias / mlp_bias)"
        } else if name.starts_with("model.layers.") {
            " (more layers or parts than the config describes)"
        } else {
            ""
        };
        return Err(EngineError::BadModel(format!(
            "weights: tensor `{name}` is in the checkpoint but not in the {} model its              config.json describes{why}; refusing rather than ignoring it",
            cfg.arch.architecture_name()
        )));
    }
    crate::quant::check_tensors(cfg, w)
}

/// Which backend runs the math.
#[derive(Clone, Debug)]
pub enum BackendKind {
    Cpu(CpuOptions),
    /// No math: a timing model (see `backend::sim`).
    Sim(crate::backend::sim::SimTiming),
    /// A CUDA device (builds with the `cuda` feature).
    Cuda(CudaOptions),
}

/// Resolves `--device auto|cpu|cuda|cuda:N` against this build and this machine. A CUDA
/// device comes with graphs on; `--enforce-eager` is the caller's to apply.
pub fn resolve_device(spec: &str) -> Result<BackendKind> {
    let cuda_ordinal = match spec {
        "cpu" => return Ok(BackendKind::Cpu(CpuOptions::default())),
        "auto" => {
            return Ok(match cuda_devices() {
                Ok(n) if n > 0 => BackendKind::Cuda(CudaOptions::device(0)),
                _ => BackendKind::Cpu(CpuOptions::default()),
            })
        }
        "cuda" => 0,
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => {
                return Err(EngineError::InvalidRequest(format!(
                    "--device {other}: expected auto, cpu, cuda or cuda:N"
                )))
            }
        },
    };
    let count = cuda_devices()?;
    if cuda_ordinal >= count {
        return Err(BackendError::NoDevice {
            spec: spec.to_string(),
            found: count,
        }
        .into());
    }
    Ok(BackendKind::Cuda(CudaOptions::device(cuda_ordinal)))
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> Result<usize> {
    crate::backend::cuda::device_count()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Result<usize> {
    Err(BackendError::NoCuda.into())
}

pub use crate::backend::KvBudget;

/// Blocks of `per_block` bytes a host-memory budget buys (the CPU and sim backends').
fn host_blocks(kv: KvBudget, per_block: usize) -> Result<usize> {
    match kv {
        KvBudget::Blocks(n) => Ok(n),
        KvBudget::Bytes(b) => Ok((b / per_block).max(1)),
        KvBudget::Share(_) => Err(EngineError::InvalidRequest(
            "a share of device memory sizes a GPU's KV cache; give this backend its KV cache in bytes or blocks".into(),
        )),
    }
}

/// The backend for an engine with the default limits (see [`build_backend_for`]).
pub fn build_backend(
    kind: BackendKind,
    model: &LoadedModel,
    block_size: usize,
    kv: KvBudget,
) -> Result<Box<dyn Backend>> {
    let engine = crate::engine::EngineConfig {
        block_size,
        ..Default::default()
    };
    build_backend_for(kind, model, kv, &engine)
}

/// The CPU backend of a model with Qwen3.5's hybrid layers (`build_backend_for`).
fn cpu_hybrid_backend(
    opts: CpuOptions,
    model: &LoadedModel,
    kv: KvBudget,
    engine: &crate::engine::EngineConfig,
) -> Result<Box<dyn Backend>> {
    let (block_size, max_num_seqs) = (engine.block_size, engine.max_num_seqs);
    if opts.bf16_products {
        return Err(EngineError::InvalidRequest(
            "--cpu-bf16-products runs dense models' products only; this model has \
             Qwen3.5's hybrid layers: leave the flag out"
                .into(),
        ));
    }
    let cfg = &model.config;
    let split = HybridBackend::split_budget(
        cfg,
        block_size,
        kv,
        max_num_seqs,
        engine.enable_prefix_caching,
    )?;
    let per_state_mib = cfg
        .hybrid
        .as_ref()
        .map_or(0, |h| h.state_bytes_per_sequence())
        >> 20;
    if split.slots < max_num_seqs {
        tracing::warn!(
            "the KV budget holds recurrent state for {} sequences at once, fewer \
             than --max-num-seqs {max_num_seqs}: their states would take more than half \
             of it ({per_state_mib} MiB each); raise --kv-cache-gib to run more",
            split.slots
        );
    } else if engine.enable_prefix_caching && split.snapshots < max_num_seqs {
        tracing::warn!(
            "the KV budget keeps {} saved states for the prefix cache ({per_state_mib} \
             MiB each), fewer than --max-num-seqs {max_num_seqs}; raise --kv-cache-gib \
             to reuse more prefixes",
            split.snapshots
        );
    }
    let CpuWeights::Hybrid(m) = model.cpu_weights(opts)? else {
        unreachable!("a hybrid config loads hybrid weights")
    };
    Ok(Box::new(HybridBackend::new(
        m,
        split.blocks,
        block_size,
        split.slots,
        split.snapshots,
    )?))
}

/// The backend for an engine with `engine`'s limits: its block size, and for a model with
/// recurrent layers what it keeps per running sequence (`max_num_seqs` state slots) and for
/// its prefix cache (saved states, with `enable_prefix_caching`); see
/// [`HybridBackend::split_budget`].
pub fn build_backend_for(
    kind: BackendKind,
    model: &LoadedModel,
    kv: KvBudget,
    engine: &crate::engine::EngineConfig,
) -> Result<Box<dyn Backend>> {
    let block_size = engine.block_size;
    match kind {
        BackendKind::Cpu(opts) if model.config.hybrid.is_some() => {
            cpu_hybrid_backend(opts, model, kv, engine)
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda(opts) if model.config.hybrid.is_some() => {
            use crate::backend::cuda::CudaHybridBackend;
            Ok(Box::new(CudaHybridBackend::new(
                &model.config,
                &model.weights,
                opts,
                kv,
                block_size,
                engine.max_num_seqs,
                engine.enable_prefix_caching,
            )?))
        }
        BackendKind::Cpu(opts) => {
            let per_block = CpuBackend::kv_bytes_per_block(&model.config, block_size);
            let blocks = host_blocks(kv, per_block)?;
            let CpuWeights::Dense(m) = model.cpu_weights(opts)? else {
                unreachable!("a dense config loads dense weights")
            };
            if opts.bf16_products && !m.bf16_products_run() {
                tracing::warn!(
                    "--cpu-bf16-products: this CPU has no AVX512-BF16 (or the weights are not \
                     bf16); products stay in f32"
                );
            } else if !opts.bf16_products && m.bf16_products_available() {
                tracing::info!(
                    "prompt products run in f32 (the reference numerics, within 2e-3 of \
                     transformers in f32); this CPU has AVX512-BF16, and --cpu-bf16-products \
                     would run them with activations rounded to bf16, as llama.cpp does, for \
                     about 1.4x the prefill speed"
                );
            }
            Ok(Box::new(CpuBackend::new(m, blocks, block_size)?))
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda(opts) => cuda_backend(model, opts, kv, block_size),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda(_) => Err(BackendError::NoCuda.into()),
        BackendKind::Sim(timing) => {
            // Budgeted as a GPU would hold it: bf16 K and V for every layer. A hybrid model
            // is timed as a dense one of its shape (its linear layers' KV counted as if
            // they kept it, its state slots not at all): the sim makes its tokens up, and
            // its timing model has no recurrent layers.
            let spec = KvSpec {
                num_layers: model.config.num_layers,
                block_size,
                num_kv_heads: model.config.num_kv_heads,
                head_dim: model.config.head_dim,
                dtype: KvDtype::Bf16,
            };
            let per_block = spec.bytes_per_token() * block_size;
            let blocks = host_blocks(kv, per_block)?;
            Ok(Box::new(SimBackend::new(
                timing,
                spec,
                blocks,
                model.config.vocab_size,
                model
                    .sim_words
                    .get_or_init(|| sim_outputs(&model.tokenizer, model.config.vocab_size))
                    .clone(),
            )?))
        }
    }
}

/// A CUDA backend of `model`, sharing the device copy of its weights with the model's other
/// backends on that device.
#[cfg(feature = "cuda")]
fn cuda_backend(
    model: &LoadedModel,
    opts: CudaOptions,
    kv: KvBudget,
    block_size: usize,
) -> Result<Box<dyn Backend>> {
    Ok(Box::new(crate::backend::cuda::CudaBackend::of_model(
        &model.config,
        &model.weights,
        &model.device_weights,
        opts,
        kv,
        block_size,
    )?))
}

/// The most whole-word tokens the sim draws its outputs from (plenty for varied text; a
/// large vocabulary is not scanned to the end).
const SIM_WORDS: usize = 2048;

/// The ids a sim backend emits. A real model's text mostly tokenizes back into the ids it was
/// generated as, so a chat's next turn finds its previous answer in the prefix cache; random
/// ids would not (two ids decode to bytes that re-tokenize as one, or a stray byte as
/// several), and every multi-turn measurement would miss on each answer. So the sim emits
/// whole words: tokens that decode to a run of ASCII letters, with the space before them,
/// kept only when two of them in a row tokenize back to exactly those two ids, and the
/// whole list only when a long run of them drawn at random does too. A tokenizer where that
/// fails (or that has too few such words) gets every id it can decode except eos and bos,
/// as before, and a log line says so: the sim's timing is the same either way.
pub fn sim_outputs(tok: &TextTokenizer, config_vocab: usize) -> Vec<u32> {
    let span = tok.vocab_size().min(config_vocab) as u32;
    let special: Vec<u32> = tok.eos_ids().iter().copied().chain(tok.bos_id()).collect();
    let words = word_tokens(tok, span, &special);
    if words.len() >= 16 && round_trips(tok, &words) {
        return words;
    }
    tracing::info!(
        "sim backend: this tokenizer has {} round-tripping whole-word tokens; emitting any id instead, so a chat's earlier answers may not be found in the prefix cache",
        words.len()
    );
    (0..span).filter(|t| !special.contains(t)).collect()
}

fn word_tokens(tok: &TextTokenizer, span: u32, special: &[u32]) -> Vec<u32> {
    let mut words = Vec::new();
    for id in 0..span {
        if words.len() == SIM_WORDS {
            break;
        }
        if special.contains(&id) {
            continue;
        }
        let Ok(one) = tok.decode(&[id], false) else {
            continue;
        };
        let w = one.trim_start_matches(' ');
        if w.is_empty() || !w.bytes().all(|b| b.is_ascii_alphabetic()) {
            continue;
        }
        // The space belongs to the token (" the"), whether or not decoding shows it first.
        let Ok(two) = tok.decode(&[id, id], false) else {
            continue;
        };
        if two.trim_start_matches(' ') != format!("{w} {w}") {
            continue;
        }
        if tok.encode(&two, false).ok().as_deref() == Some(&[id, id][..]) {
            words.push(id);
        }
    }
    words
}

/// A fixed pseudo-random run of `words` decodes to text that encodes back to the same ids.
fn round_trips(tok: &TextTokenizer, words: &[u32]) -> bool {
    let mut z: u64 = 0x9e37_79b9_7f4a_7c15;
    let run: Vec<u32> = (0..256)
        .map(|_| {
            z = z.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            words[((z >> 33) % words.len() as u64) as usize]
        })
        .collect();
    tok.decode(&run, false)
        .and_then(|text| tok.encode(&text, false))
        .is_ok_and(|ids| ids == run)
}

/// 64-bit FNV-1a: small and stable across machines and versions (the standard library's
/// hashers are neither promised to be).
/// The fingerprint of a model from its config, its tokenizer and the files that made it,
/// and its weights' digest: what [`LoadedModel::fingerprint`] computes with the weights at
/// hand, and what a gateway recomputes from a model card without them.
pub fn fingerprint_of(
    config: &ModelConfig,
    tokenizer: &TextTokenizer,
    files: &TokenizerFiles,
    weights_digest: &str,
) -> String {
    let mut h = Fnv::default();
    h.write(format!("{config:?}").as_bytes());
    h.write(&(tokenizer.vocab_size() as u64).to_le_bytes());
    for id in tokenizer.eos_ids() {
        h.write(&id.to_le_bytes());
    }
    // The tokenizer: a gateway tokenizes for workers, so ids must mean the same text.
    for (id, token) in tokenizer.vocabulary() {
        h.write(&id.to_le_bytes());
        h.write(token.as_bytes());
    }
    // What shapes the prompt and the defaults: the chat template and generation config.
    for text in [
        &files.tokenizer_config,
        &files.chat_template_jinja,
        &files.generation_config,
    ] {
        match text {
            Some(t) => {
                h.write(&[1]);
                h.write(&(t.len() as u64).to_le_bytes());
                h.write(t.as_bytes());
            }
            None => h.write(&[0]),
        }
    }
    h.write(weights_digest.as_bytes());
    format!("{:016x}", h.0)
}

struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod sim_output_tests {
    use super::*;

    fn shakespeare() -> TextTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/shakespeare");
        let files = TokenizerFiles::read_dir(&dir).unwrap();
        TextTokenizer::from_files(&files, &[]).unwrap()
    }

    #[test]
    fn the_sims_words_tokenize_back_into_themselves() {
        let tok = shakespeare();
        let words = sim_outputs(&tok, 1 << 20);
        assert!(words.len() >= 100, "only {} words", words.len());
        for &w in &words {
            assert!(!tok.eos_ids().contains(&w) && tok.bos_id() != Some(w));
            let text = tok.decode(&[w], false).unwrap();
            assert!(
                text.trim_start().bytes().all(|b| b.is_ascii_alphabetic()),
                "{text:?}"
            );
        }
        // An answer as a sim worker writes it, then sent back as the next turn's history.
        let answer: Vec<u32> = (0..200).map(|i| words[(i * 7919) % words.len()]).collect();
        let text = tok.decode(&answer, false).unwrap();
        assert_eq!(tok.encode(&text, false).unwrap(), answer);
    }
}

#[cfg(test)]
mod shared_weight_tests {
    use super::*;

    #[test]
    fn engines_built_from_one_model_share_its_cpu_weights() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/shakespeare");
        let m = LoadedModel::from_dir(&dir).unwrap();
        let first = build_backend(
            BackendKind::Cpu(CpuOptions::default()),
            &m,
            16,
            KvBudget::Blocks(8),
        )
        .unwrap();
        let second = build_backend(
            BackendKind::Cpu(CpuOptions::default()),
            &m,
            16,
            KvBudget::Blocks(8),
        )
        .unwrap();
        let CpuWeights::Dense(w) = m.cpu_weights(CpuOptions::default()).unwrap() else {
            panic!("the default model is dense");
        };
        // The model's cache, both backends and `w` itself: one copy, four holders.
        assert_eq!(Arc::strong_count(&w), 4);
        drop((first, second));
        assert_eq!(Arc::strong_count(&w), 2);
    }

    /// A device copy is shared by device while a backend holds it, and never across devices,
    /// types or models.
    #[test]
    fn device_weights_are_shared_per_device_while_held() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/shakespeare");
        let (m, other) = (
            LoadedModel::from_dir(&dir).unwrap(),
            LoadedModel::from_dir(&dir).unwrap(),
        );
        assert!(m.device_weights.held::<Vec<u8>>(0).is_none());
        let w = Arc::new(vec![1u8, 2, 3]);
        m.device_weights.hold(0, &w);
        let got = m
            .device_weights
            .held::<Vec<u8>>(0)
            .expect("held on device 0");
        assert!(Arc::ptr_eq(&got, &w));
        assert!(
            m.device_weights.held::<Vec<u8>>(1).is_none(),
            "another device"
        );
        assert!(m.device_weights.held::<String>(0).is_none(), "another type");
        assert!(
            other.device_weights.held::<Vec<u8>>(0).is_none(),
            "another model"
        );
        drop((got, w));
        assert!(
            m.device_weights.held::<Vec<u8>>(0).is_none(),
            "none once no one holds it"
        );
    }
}
