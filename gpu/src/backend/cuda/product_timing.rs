//! A decode step's products timed one kind at a time on the device's own clock (CUDA
//! events): what `gpu-bench --product-sweep` prints to say where a small batch's step goes,
//! between reading the weights at the card's bandwidth and each launch's fixed cost. Nsight
//! Compute times kernels one at a time with the caches emptied before each, which inflates the
//! small ones; here each kind runs as a step runs it, one layer after another, after other
//! memory has pushed the weights out of L2.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};

use super::device::drv;
use super::gemm::Products;
use super::weights::Linear;
use super::CudaBackend;
use crate::error::Result;

/// One kind of product at `rows` rows.
#[derive(Clone, Debug, PartialEq)]
pub struct ProductTiming {
    /// "q/k/v", "o", "gate/up + SiLU", "down" or "LM head".
    pub name: &'static str,
    pub rows: usize,
    /// Outputs and inputs of one layer's product.
    pub n: usize,
    pub k: usize,
    /// Bytes one layer's product reads (its weights, scales and bias).
    pub bytes: usize,
    /// Microseconds of one launch with nothing queued before or after it: its start, its
    /// reads and its drain (the best of the repetitions).
    pub alone_us: f64,
    /// Microseconds a launch of it takes within a run of every layer's, back to back as a
    /// step issues them (and overlapped as a step overlaps them, with programmatic dependent
    /// launch): the best of the repetitions.
    pub chained_us: f64,
}

/// Bytes written before each timed run, so no weight read comes from L2 (larger than any
/// L2 so far: 50 MB on an H100, 60 MB on a B200).
const FLUSH_BYTES: usize = 256 << 20;

impl CudaBackend {
    /// Times each kind of the model's products at `rows` rows (1 for batch-1 decode): one
    /// launch alone, and a run over every layer (the LM head once), each the best of `reps`
    /// after a warm-up. Runs through the same kernels a step of that many rows takes
    /// (`skinny_max_rows`, FP8 parts), on zero activations.
    pub fn time_products(&mut self, rows: usize, reps: usize) -> Result<Vec<ProductTiming>> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let s = self.stream.clone();
        let cfg = &self.cfg;
        let alloc = |n: usize| {
            s.alloc_zeros::<u16>(n.max(1))
                .map_err(|e| drv("the product sweep's buffers", e))
        };
        let widest = cfg.hidden_size.max(cfg.intermediate_size).max(cfg.q_dim());
        let x = alloc(rows * widest)?;
        let mut act = alloc(rows * cfg.intermediate_size)?;
        let outs = cfg
            .vocab_size
            .max(2 * cfg.intermediate_size)
            .max(cfg.q_dim() + 2 * cfg.kv_dim());
        let mut y = s
            .alloc_zeros::<f32>(rows * outs)
            .map_err(|e| drv("the product sweep's buffers", e))?;
        let mut flush = s
            .alloc_zeros::<u8>(FLUSH_BYTES)
            .map_err(|e| drv("the product sweep's buffers", e))?;
        let mm = Products {
            blas: &self.blas,
            s: &s,
            k: &self.k,
            skinny_max_rows: self.skinny_max_rows,
            fp8: self.fp8.as_ref(),
        };
        let w = &self.w;
        let kinds: [(&'static str, Pick); 4] = [
            ("q/k/v", |l| &l.qkv_proj),
            ("o", |l| &l.o_proj),
            ("gate/up + SiLU", |l| &l.gate_up_proj),
            ("down", |l| &l.down_proj),
        ];
        let mut out = Vec::new();
        for (name, pick) in kinds {
            let Some(first) = w.layers.first().map(pick) else {
                break;
            };
            let (n, k) = dims(first);
            let mut run = |layers: &[&Linear]| -> Result<()> {
                for l in layers {
                    if name == "gate/up + SiLU" {
                        mm.gate_up_silu_proj(l, rows, &x, &mut y, &mut act)?;
                    } else {
                        mm.proj(l, rows, &x, &mut y)?;
                    }
                }
                Ok(())
            };
            let all: Vec<&Linear> = w.layers.iter().map(pick).collect();
            let alone = best_of(&s, &mut flush, reps, 1, || run(&all[..1]))?;
            let chained = best_of(&s, &mut flush, reps, all.len(), || run(&all))?;
            out.push(ProductTiming {
                name,
                rows,
                n,
                k,
                bytes: first.step_bytes(),
                alone_us: alone,
                chained_us: chained,
            });
        }
        let (head, bytes) = match &w.lm_head {
            Some(l) => (&l.w, 2 * l.w.len()),
            None => (&w.embed_tokens, 2 * w.embed_tokens.len()),
        };
        let (n, k) = (cfg.vocab_size, cfg.hidden_size);
        let lm = best_of(&s, &mut flush, reps, 1, || {
            mm.product(&x, head, &mut y, (rows, n, k))
        })?;
        out.push(ProductTiming {
            name: "LM head",
            rows,
            n,
            k,
            bytes,
            alone_us: lm,
            chained_us: lm,
        });
        Ok(out)
    }
}

/// Which of a layer's products a kind is.
type Pick = fn(&super::weights::DevLayer) -> &Linear;

/// Outputs and inputs of a product (a gate/up's outputs are its gate's and up's together).
fn dims(l: &Linear) -> (usize, usize) {
    match l {
        Linear::Bf16(l) => (l.out, l.inp),
        Linear::Fp8(l) => (l.out, l.inp),
    }
}

/// Microseconds per launch of `launches` launches that `run` enqueues: the best of `reps`
/// timed runs after one untimed one, each after `flush` has been written over.
fn best_of(
    s: &Arc<CudaStream>,
    flush: &mut CudaSlice<u8>,
    reps: usize,
    launches: usize,
    mut run: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let e = |e| drv("product sweep timing", e);
    let mut best = f64::INFINITY;
    for i in 0..=reps.max(1) {
        s.memset_zeros(flush).map_err(e)?;
        let start = s.record_event(timing).map_err(e)?;
        run()?;
        let end = s.record_event(timing).map_err(e)?;
        let ms = f64::from(start.elapsed_ms(&end).map_err(e)?);
        if i > 0 {
            best = best.min(ms * 1e3 / launches.max(1) as f64);
        }
    }
    Ok(best)
}
