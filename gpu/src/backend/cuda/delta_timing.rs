//! Gated DeltaNet's mixing (`delta_conv_silu`, then `gated_delta_rule` with its gated norm;
//! or the scan path's five launches) timed alone on one layer's shapes, with CUDA events: what `gpu-bench --gated-deltanet`
//! prints beside flash-linear-attention's kernels on the same shapes
//! (`scripts/fla_peer_bench.py`).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaContext;

use super::delta::{chunk_mats_len, seq_table, DeltaDims, DeltaMix, DeltaPath, StateAt};
use super::device::drv;
use super::kernels::Kernels;
use crate::backend::cpu::delta::DeltaParams;
use crate::error::Result;

/// One timed shape: `seqs` sequences of `tokens` new tokens each, starting from a zero
/// state (`fresh`, a prompt) or continuing one (decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaCase {
    pub label: &'static str,
    pub seqs: usize,
    pub tokens: usize,
    pub fresh: bool,
}

/// Prompts of one sequence (what a prefill of that length pays per linear layer), a batch of
/// shorter prompts, and decode steps of 1, 32 and 256 sequences.
pub const DELTA_CASES: &[DeltaCase] = &[
    DeltaCase {
        label: "prefill 1 x 1024",
        seqs: 1,
        tokens: 1024,
        fresh: true,
    },
    DeltaCase {
        label: "prefill 1 x 8192",
        seqs: 1,
        tokens: 8192,
        fresh: true,
    },
    DeltaCase {
        label: "prefill 16 x 1024",
        seqs: 16,
        tokens: 1024,
        fresh: true,
    },
    DeltaCase {
        label: "decode 1",
        seqs: 1,
        tokens: 1,
        fresh: false,
    },
    DeltaCase {
        label: "decode 32",
        seqs: 32,
        tokens: 1,
        fresh: false,
    },
    DeltaCase {
        label: "decode 256",
        seqs: 256,
        tokens: 1,
        fresh: false,
    },
];

/// Median milliseconds of one layer's mixing for `case` on device `ordinal` along `path`,
/// over `reps` runs after one warm-up. The projections are pseudo-random in [-1.5, 1.5), as the parity
/// test draws them; the states stay on the device between runs.
pub fn time_delta_mix(
    ordinal: usize,
    p: &DeltaParams,
    case: &DeltaCase,
    reps: usize,
    path: DeltaPath,
) -> Result<f64> {
    let d = DeltaDims::of(p)?;
    let scan = path.scan(case.tokens);
    let ctx: Arc<CudaContext> =
        CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
    let s = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
    let (k, _) = Kernels::load(&ctx)?;
    let tokens = case.seqs * case.tokens;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let proj: Vec<f32> = (0..tokens * d.row)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 1.5
        })
        .collect();
    let up = |v: &[f32]| s.clone_htod(v).map_err(|e| drv("upload", e));
    let (proj, conv, neg_a, dt_bias, norm) = (
        up(&proj)?,
        up(&p.conv)?,
        up(&p.neg_a)?,
        up(&p.dt_bias)?,
        up(&p.norm)?,
    );
    let table: Vec<(usize, usize, u32, bool)> = (0..case.seqs)
        .map(|i| (i * case.tokens, case.tokens, i as u32, case.fresh))
        .collect();
    let seqs = s
        .clone_htod(&seq_table(&table))
        .map_err(|e| drv("upload", e))?;
    let per = d.layer_floats();
    let alloc = "the timed layer's buffers";
    let mut states = s
        .alloc_zeros::<f32>(case.seqs * per)
        .map_err(|e| drv(alloc, e))?;
    let mut mixed = s
        .alloc_zeros::<f32>(tokens * d.cd)
        .map_err(|e| drv(alloc, e))?;
    let mut out = s
        .alloc_zeros::<u16>(tokens * d.nv * d.dv)
        .map_err(|e| drv(alloc, e))?;
    let mut mats = s
        .alloc_zeros::<f32>(chunk_mats_len(&d, tokens).max(1))
        .map_err(|e| drv(alloc, e))?;
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(reps);
    for i in 0..=reps {
        let start = s.record_event(timing).map_err(|e| drv("timing event", e))?;
        DeltaMix {
            dims: d,
            proj: &proj,
            conv: &conv,
            neg_a: &neg_a,
            dt_bias: &dt_bias,
            norm: &norm,
            eps: p.eps,
            states: &mut states,
            at: StateAt {
                slot_stride: per,
                layer_off: 0,
            },
            max_slot: case.seqs.saturating_sub(1),
            seqs: &seqs,
            num_seqs: case.seqs,
            tokens,
            mixed: &mut mixed,
            out: &mut out,
            scan,
            chunk_mats: (path == DeltaPath::Chunked).then_some(&mut mats),
        }
        .launch(&k, &s)?;
        let end = s.record_event(timing).map_err(|e| drv("timing event", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| drv("timing", e))?;
        if i > 0 {
            times.push(f64::from(ms));
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times.get(times.len() / 2).copied().unwrap_or(f64::NAN))
}
