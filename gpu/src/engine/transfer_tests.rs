//! The engine's two transfer paths, on `sim` backends (host KV pools, deterministic tokens):
//! what a prefill engine reports and lends, what a decode engine does with a lease that lands,
//! fails or outlives its sequence, and that every block comes back.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use std::sync::Arc;

use super::*;
use crate::backend::error::BackendError;
use crate::backend::sim::{SimBackend, SimTiming};
use crate::backend::{Backend, ForwardBatch};
use crate::device_kv::{CopyRun, DeviceCopy, DeviceKey, DeviceKvPool, MappedPool, PoolExport};
use crate::error::Result;
use crate::kv_cache::BlockId;
use crate::kv_pool::{HostKvPool, KvDtype, KvKind, KvSpec};
use crate::sampler::{Sampled, SamplingParams};

pub(super) const VOCAB: usize = 64;
pub(super) const BLOCKS: usize = 32;

/// A sim backend that takes no time and may emit any id of the vocabulary.
fn zero_cost_sim(spec: KvSpec) -> SimBackend {
    timed_sim(SimTiming::zero(), spec)
}

/// A sim backend with `timing`, emitting any id of the vocabulary.
pub(super) fn timed_sim(timing: SimTiming, spec: KvSpec) -> SimBackend {
    SimBackend::new(timing, spec, BLOCKS, VOCAB, (0..VOCAB as u32).collect()).unwrap()
}

/// Three small layers, blocks of 4 tokens.
pub(super) fn small_spec() -> KvSpec {
    KvSpec {
        num_layers: 3,
        block_size: 4,
        num_kv_heads: 1,
        head_dim: 4,
        dtype: KvDtype::Bf16,
    }
}

fn engine(max_num_batched_tokens: usize) -> EngineHandle {
    let backend = zero_cost_sim(small_spec());
    spawn(
        Box::new(backend),
        EngineConfig {
            max_model_len: 100,
            block_size: 4,
            max_num_batched_tokens,
            ..Default::default()
        },
        vec![],
        VOCAB,
    )
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| (t * 7 + 3) % 60).collect()
}

fn tokens(sub: &mut Submission) -> Vec<u32> {
    super::tests::drain(sub)
}

/// Whether `cond` holds within 2 s.
fn eventually(cond: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Waits until every block of `h` is free again.
fn all_free(h: &EngineHandle) -> bool {
    eventually(|| h.stats.free_blocks.load(Ordering::Relaxed) == BLOCKS)
}

/// A handed-over prompt's landing with its first token and nothing cached or carried.
fn landed_with(token: u32) -> Landed {
    Landed {
        first: Sampled {
            token,
            logprob: 0.0,
            top: vec![],
        },
        rng: None,
        cached_tokens: 0,
        state: None,
    }
}

fn local_run(p: &[u32], n: usize) -> Vec<u32> {
    let h = engine(64);
    let mut s = h
        .submit(Request {
            prompt: p.to_vec(),
            params: greedy(n),
        })
        .unwrap();
    tokens(&mut s)
}

#[test]
fn export_reports_every_layer_in_chunks_and_holds_blocks_until_the_lease_returns() {
    // Chunks of 8 tokens: a 21-token prompt is computed in three steps.
    let h = engine(8);
    let p = prompt(21);
    let (mut sub, mut ev) = h
        .submit_export(
            Request {
                prompt: p.clone(),
                params: greedy(1),
            },
            4,
        )
        .unwrap();
    let first = tokens(&mut sub);
    let ExportEvent::Ready { lease, computed } = ev.blocking_recv().unwrap() else {
        panic!("Ready comes first");
    };
    assert_eq!((computed, lease.from_pos(), lease.prompt_len()), (0, 4, 21));
    assert_eq!(lease.blocks().len(), 6, "the whole prompt is reserved");
    let mut seen = vec![Vec::new(); 3];
    let mut sampled = 0;
    while let Ok(e) = ev.try_recv() {
        match e {
            ExportEvent::Layer { layer, upto } => seen[layer].push(upto),
            ExportEvent::Sampled { .. } => sampled += 1,
            ExportEvent::Ready { .. } => panic!("one Ready"),
            ExportEvent::State(_) => panic!("a dense model has no recurrent state"),
        }
    }
    assert_eq!(sampled, 1);
    for s in &seen {
        assert_eq!(s, &[8, 16, 21], "each layer reported after each chunk");
    }
    assert_eq!(first, local_run(&p, 1));
    // Finished, but the blocks stay lent until the lease is dropped.
    assert!(eventually(
        || h.stats.held_blocks.load(Ordering::Relaxed) == 6
    ));
    drop(lease);
    assert!(all_free(&h), "blocks came back with the lease");
}

#[test]
fn a_landed_lease_decodes_exactly_as_a_local_run() {
    let h = engine(64);
    let p = prompt(19);
    let want = local_run(&p, 6);
    let (mut sub, lease) = h
        .submit_remote_prefill(
            Request {
                prompt: p.clone(),
                params: greedy(6),
            },
            1,
        )
        .unwrap();
    let lease = lease.blocking_recv().expect("a lease, not a local prefill");
    assert_eq!((lease.from_pos(), lease.prompt_len()), (0, 19));
    assert!(eventually(
        || h.stats.awaiting_kv.load(Ordering::Relaxed) == 1
    ));
    // A clone outlives `landed`: decoding waits for it.
    let clone = lease.clone();
    lease.landed(Landed {
        first: Sampled {
            token: want[0],
            logprob: 0.0,
            top: vec![],
        },
        rng: None,
        cached_tokens: 3,
        state: None,
    });
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        sub.events.try_recv().is_err(),
        "nothing before the last clone is gone"
    );
    drop(clone);
    assert_eq!(tokens(&mut sub), want);
    assert!(all_free(&h));
}

/// A decode sequence of `p` for `n` tokens that always asks for a transfer, and its lease.
fn remote(h: &EngineHandle, p: &[u32], n: usize) -> (Submission, KvLease) {
    let (sub, lease) = h
        .submit_remote_prefill(
            Request {
                prompt: p.to_vec(),
                params: greedy(n),
            },
            1,
        )
        .unwrap();
    (sub, lease.blocking_recv().unwrap())
}

#[test]
fn a_lease_returned_without_landing_prefills_locally() {
    let h = engine(64);
    let p = prompt(13);
    let (mut sub, lease) = remote(&h, &p, 5);
    drop(lease);
    assert_eq!(tokens(&mut sub), local_run(&p, 5));
    assert!(all_free(&h));
}

/// A transfer given up while a clone of its lease lives on (a UCX sender that may still
/// write): the sequence is prefilled here at once, in other blocks, and the lent ones stay
/// held until the last clone is dropped.
#[test]
fn an_abandoned_lease_prefills_locally_while_the_lent_blocks_stay_held() {
    let h = engine(64);
    let p = prompt(13);
    let (mut sub, lease) = remote(&h, &p, 5);
    let sender = lease.clone();
    let lent: Vec<BlockId> = lease.blocks().to_vec();
    lease.abandon();
    drop(lease);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(tokens(&mut sub));
    });
    let got = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the sequence finished while the lease was still out");
    assert_eq!(got, local_run(&p, 5));
    assert!(eventually(
        || h.stats.held_blocks.load(Ordering::Relaxed) == lent.len()
    ));
    assert_eq!(sender.blocks(), &lent[..]);
    drop(sender);
    assert!(all_free(&h));
}

#[test]
fn a_cached_prompt_prefills_locally_and_an_abort_waits_for_the_lease() {
    let h = engine(64);
    let p = prompt(21);
    let mut warm = h
        .submit(Request {
            prompt: p.clone(),
            params: greedy(2),
        })
        .unwrap();
    tokens(&mut warm);
    // 20 of 21 tokens cached: fewer than 8 uncached, so no transfer.
    let (mut sub, lease) = h
        .submit_remote_prefill(
            Request {
                prompt: p.clone(),
                params: greedy(2),
            },
            8,
        )
        .unwrap();
    assert_eq!(tokens(&mut sub), local_run(&p, 2));
    assert!(lease.blocking_recv().is_err(), "the lease channel closed");

    // A request dropped while its lease is out: blocks are held until the lease returns.
    let q: Vec<u32> = (0..30).map(|t| (t * 5 + 1) % 60).collect();
    let (sub, lease) = h
        .submit_remote_prefill(
            Request {
                prompt: q,
                params: greedy(2),
            },
            1,
        )
        .unwrap();
    let lease = lease.blocking_recv().unwrap();
    assert_eq!(lease.from_pos(), 0);
    drop(sub);
    assert!(eventually(
        || h.stats.held_blocks.load(Ordering::Relaxed) == 8
    ));
    drop(lease);
    assert!(all_free(&h));
}

#[test]
fn transfers_are_refused_by_a_backend_without_host_memory() {
    let h = spawn(
        Box::new(super::tests::NoHostKv),
        EngineConfig::default(),
        vec![],
        10,
    );
    let e = h
        .submit_export(
            Request {
                prompt: vec![1, 2],
                params: greedy(1),
            },
            0,
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("disaggregated prefill is not available"), "{e}");
}

/// A backend whose KV the engine cannot see (like `cuda`): it stages transfers through host
/// pools. Its forward writes a pattern of (position, layer) into every computed slot and
/// checks, before computing, that every earlier position of each sequence holds it, so a
/// sequence decoding on KV that did not arrive intact fails.
struct Staged {
    inner: SimBackend,
    pool: Arc<HostKvPool>,
    /// Lends its blocks as device memory (`Backend::device_kv`): its host pool standing for
    /// a GPU cache, copied by `HostCopy`; staging is then an error.
    device: Option<Arc<DeviceKvPool>>,
}

/// A "device" copier over host memory, for `Staged::on_device`.
struct HostCopy;

impl DeviceCopy for HostCopy {
    fn device(&self) -> DeviceKey {
        DeviceKey { ordinal: 0 }
    }

    unsafe fn copy(&self, runs: &[CopyRun], _dst: DeviceKey) -> std::result::Result<(), String> {
        for r in runs {
            // SAFETY: the trait's contract (host memory here).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    r.src as usize as *const u8,
                    r.dst as usize as *mut u8,
                    r.len as usize,
                )
            };
        }
        Ok(())
    }

    fn map(&self, _: &PoolExport) -> std::result::Result<MappedPool, String> {
        Err("no IPC here".into())
    }

    fn bind_thread(&self) -> std::result::Result<(), String> {
        Ok(())
    }
}

impl Staged {
    fn new() -> Staged {
        let spec = KvSpec {
            num_layers: 3,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
            dtype: KvDtype::Bf16,
        };
        let inner = zero_cost_sim(spec);
        let pool = inner.host_kv().unwrap();
        Staged {
            inner,
            pool,
            device: None,
        }
    }

    /// A `Staged` whose blocks are lent as device memory.
    fn on_device() -> Staged {
        let mut st = Staged::new();
        let p = &st.pool;
        let addr = |l, kind| p.base(l, kind) as usize as u64;
        let k = (0..3).map(|l| addr(l, KvKind::K)).collect();
        let v = (0..3).map(|l| addr(l, KvKind::V)).collect();
        // SAFETY: the pool's own buffers, kept alive by `keep`.
        let pool = unsafe {
            DeviceKvPool::new(
                p.spec().clone(),
                p.num_blocks(),
                k,
                v,
                Arc::new(HostCopy),
                None,
                p.clone(),
            )
        };
        st.device = Some(Arc::new(pool));
        st
    }

    fn pattern(pos: usize, layer: usize, kind: KvKind) -> u8 {
        (pos * 7 + layer * 13 + (kind == KvKind::V) as usize * 101) as u8
    }

    /// The bytes of one position of one layer in a pool.
    #[allow(clippy::mut_from_ref)]
    fn slot<'a>(
        pool: &'a HostKvPool,
        table: &[BlockId],
        pos: usize,
        layer: usize,
        kind: KvKind,
    ) -> &'a mut [u8] {
        let s = pool.spec();
        let b = table[pos / s.block_size].0 as usize;
        let off = (b * s.block_size + pos % s.block_size) * s.bytes_per_pos();
        // SAFETY: test code; the engine gives the backend these slots alone.
        unsafe {
            std::slice::from_raw_parts_mut(pool.base(layer, kind).add(off), s.bytes_per_pos())
        }
    }
}

impl Backend for Staged {
    fn device(&self) -> String {
        "staged".into()
    }
    fn num_blocks(&self) -> usize {
        BLOCKS
    }
    fn kv_spec(&self) -> Option<KvSpec> {
        self.inner.kv_spec()
    }
    fn kv_staging(&self) -> bool {
        true
    }
    fn device_kv(&self) -> Option<Arc<DeviceKvPool>> {
        self.device.clone()
    }
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        for s in &batch.seqs {
            for layer in 0..3 {
                for kind in [KvKind::K, KvKind::V] {
                    for pos in 0..s.start_pos {
                        let v = Self::slot(&self.pool, s.block_table, pos, layer, kind);
                        if v.iter().any(|&x| x != Self::pattern(pos, layer, kind)) {
                            return Err(BackendError::Invariant(
                                "a position before the step holds the wrong KV",
                            )
                            .into());
                        }
                    }
                    for pos in s.start_pos..s.start_pos + s.tokens.len() {
                        Self::slot(&self.pool, s.block_table, pos, layer, kind)
                            .fill(Self::pattern(pos, layer, kind));
                    }
                }
            }
        }
        self.inner.forward(batch)
    }
    fn kv_to_host(
        &mut self,
        table: &[BlockId],
        positions: std::ops::Range<usize>,
        dst: &HostKvPool,
        dst_table: &[BlockId],
    ) -> Result<()> {
        if self.device.is_some() {
            return Err(BackendError::Invariant("staged out on a device handover").into());
        }
        for pos in positions {
            for layer in 0..3 {
                for kind in [KvKind::K, KvKind::V] {
                    let v = Self::slot(&self.pool, table, pos, layer, kind).to_vec();
                    Self::slot(dst, dst_table, pos, layer, kind).copy_from_slice(&v);
                }
            }
        }
        Ok(())
    }
    fn kv_from_host(
        &mut self,
        src: &HostKvPool,
        src_table: &[BlockId],
        positions: std::ops::Range<usize>,
        table: &[BlockId],
    ) -> Result<()> {
        if self.device.is_some() {
            return Err(BackendError::Invariant("staged in on a device handover").into());
        }
        let first_block = positions.start / 4;
        for pos in positions {
            let i = pos / 4 - first_block;
            let (st, t) = (&src_table[i..=i], &table[i..=i]);
            let local = pos % 4;
            for layer in 0..3 {
                for kind in [KvKind::K, KvKind::V] {
                    let v = Self::slot(src, st, local, layer, kind).to_vec();
                    Self::slot(&self.pool, t, local, layer, kind).copy_from_slice(&v);
                }
            }
        }
        Ok(())
    }
}

/// An engine on `backend`, blocks of 4 tokens, prompts in chunks of `budget`.
fn staged_engine(backend: Staged, budget: usize) -> EngineHandle {
    spawn(
        Box::new(backend),
        EngineConfig {
            max_model_len: 100,
            block_size: 4,
            max_num_batched_tokens: budget,
            ..Default::default()
        },
        vec![],
        VOCAB,
    )
}

/// Through host staging (a backend without host-visible KV, like `cuda`): the prefill side's
/// staged copy holds what it computed, layer reports follow each chunk, and a decode side
/// that lands those bytes decodes on them (its backend checks every position it attends to).
#[test]
fn staged_transfers_carry_the_kv_intact() {
    let spawn_staged = |budget| staged_engine(Staged::new(), budget);
    let (p, d) = (spawn_staged(8), spawn_staged(64));
    assert!(p.info.kv_transfer);
    let prompt = prompt(21);
    let (mut psub, mut pev) = p
        .submit_export(
            Request {
                prompt: prompt.clone(),
                params: greedy(1),
            },
            0,
        )
        .unwrap();
    let first = tokens(&mut psub);
    let ExportEvent::Ready { lease: plo, .. } = pev.blocking_recv().unwrap() else {
        panic!("Ready first")
    };
    let mut reported = vec![0; 3];
    while let Ok(e) = pev.try_recv() {
        if let ExportEvent::Layer { layer, upto } = e {
            reported[layer] = upto;
        }
    }
    assert_eq!(
        reported,
        vec![21; 3],
        "every layer reported up to the prompt's end"
    );

    let (mut dsub, dlease) = d
        .submit_remote_prefill(
            Request {
                prompt: prompt.clone(),
                params: greedy(5),
            },
            1,
        )
        .unwrap();
    let dlo = dlease.blocking_recv().unwrap();
    for pos in 0..21 {
        for layer in 0..3 {
            for kind in [KvKind::K, KvKind::V] {
                let v =
                    Staged::slot(plo.host_pool().unwrap(), plo.blocks(), pos, layer, kind).to_vec();
                assert_eq!(
                    v[0],
                    Staged::pattern(pos, layer, kind),
                    "staged on the prefill side"
                );
                Staged::slot(dlo.host_pool().unwrap(), dlo.blocks(), pos, layer, kind)
                    .copy_from_slice(&v);
            }
        }
    }
    drop(plo);
    dlo.landed(landed_with(first[0]));
    assert_eq!(tokens(&mut dsub), local_run(&prompt, 5));
    assert!(all_free(&p) && all_free(&d));
}

/// `Handover::Device` asks for the device cache's own blocks; a backend without device KV
/// (host pools, or staging like the test's `Staged`) lends host memory as it always does, so
/// every transport still reaches the blocks.
#[test]
fn a_device_handover_lends_host_memory_where_the_backend_has_no_device_kv() {
    use crate::device_kv::KvMemory;
    let sim = engine(64);
    let staged = staged_engine(
        Staged::new(),
        EngineConfig::default().max_num_batched_tokens,
    );
    for h in [&sim, &staged] {
        assert_eq!(h.info.device_kv, None);
        let req = Request {
            prompt: prompt(10),
            params: greedy(1),
        };
        let (mut sub, mut ev) = h
            .submit_export_on(req.clone(), 0, Handover::Device)
            .unwrap();
        let ExportEvent::Ready { lease, .. } = ev.blocking_recv().unwrap() else {
            panic!("Ready first")
        };
        assert!(matches!(lease.memory(), KvMemory::Host(_)));
        tokens(&mut sub);
        drop(lease);
        let (_sub, rx) = h
            .submit_remote_prefill_on(req, 1, Handover::Device)
            .unwrap();
        let lease = rx.blocking_recv().expect("a lease");
        assert!(lease.host_pool().is_some(), "host memory");
        drop(lease);
        assert!(all_free(h));
    }
}

/// `Handover::Device` on a backend with device KV (`Staged::on_device`: host memory standing
/// for a GPU cache): both leases are the caches' own blocks, nothing is staged (staging
/// fails that backend), a copy through the pool's copier carries the prompt, chunked, and
/// the decode side decodes on it exactly as a local run does, every block freed after.
#[test]
fn device_handovers_lend_the_caches_own_blocks_and_stage_nothing() {
    use crate::device_kv::KvMemory;
    let spawn_dev = |budget| staged_engine(Staged::on_device(), budget);
    let (p, d) = (spawn_dev(8), spawn_dev(64));
    assert_eq!(p.info.device_kv, Some(DeviceKey { ordinal: 0 }));
    let prompt = prompt(21);
    let req = |n| Request {
        prompt: prompt.clone(),
        params: greedy(n),
    };
    let (mut psub, mut pev) = p.submit_export_on(req(1), 0, Handover::Device).unwrap();
    let first = tokens(&mut psub);
    let ExportEvent::Ready { lease: plo, .. } = pev.blocking_recv().unwrap() else {
        panic!("Ready first")
    };
    let (mut dsub, dlease) = d
        .submit_remote_prefill_on(req(5), 1, Handover::Device)
        .unwrap();
    let dlo = dlease.blocking_recv().unwrap();
    let (KvMemory::Device(sp), KvMemory::Device(dp)) = (plo.memory(), dlo.memory()) else {
        panic!("both leases on the device")
    };
    let bpp = sp.spec().bytes_per_pos() as u64;
    let mut runs = Vec::new();
    for layer in 0..3 {
        for kind in [KvKind::K, KvKind::V] {
            for pos in 0..21 {
                let at = |base: u64, t: &[BlockId]| {
                    base + ((t[pos / 4].0 as usize * 4 + pos % 4) as u64) * bpp
                };
                runs.push(CopyRun {
                    src: at(sp.base(layer, kind), plo.blocks()),
                    dst: at(dp.base(layer, kind), dlo.blocks()),
                    len: bpp,
                });
            }
        }
    }
    // SAFETY: the export is finished; the decode side's blocks are lent to this copy.
    unsafe { sp.copier().copy(&runs, dp.device()) }.unwrap();
    drop(plo);
    dlo.landed(landed_with(first[0]));
    assert_eq!(tokens(&mut dsub), local_run(&prompt, 5));
    assert!(all_free(&p) && all_free(&d));
}
