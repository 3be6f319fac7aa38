//! Sampling on the device (greedy, temperature, top-k, top-p; see `sample_rows` in
//! kernels/sampling.cu): only the chosen token and its logprob per sequence are copied back, not a
//! vocabulary of logits. Each non-greedy row takes one uniform draw from its request's
//! seeded generator here, as the CPU sampler does.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::buffers::LogitsSpace;
use super::device::drv;
use super::kernels::{ConstrainRows, Kernels, SampleRows};
use crate::backend::error::{BackendError, BatchError};
use crate::backend::{ForwardBatch, SampleSpec};
use crate::error::Result;
use crate::sampler::Sampled;

/// Samples one token for each of the first `specs.len()` rows of `ls.logits`.
pub fn sample_logits(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    ls: &mut LogitsSpace,
    vocab: usize,
    specs: &mut [SampleSpec],
) -> Result<Vec<Sampled>> {
    let n = specs.len();
    if specs.iter().any(SampleSpec::constrained) {
        constrain(stream, k, ls, vocab, specs)?;
    }
    let host = sample_params(specs, ls.rows);
    let held = ls
        .params_held
        .take()
        .filter(|(f, k)| *f == host.floats && *k == host.top_k);
    match held {
        Some(same) => ls.params_held = Some(same),
        None => {
            let e = |e| drv("sampling parameters copy", e);
            stream
                .memcpy_htod(&host.floats, &mut ls.params_f)
                .map_err(e)?;
            stream.memcpy_htod(&host.top_k, &mut ls.top_k).map_err(e)?;
            ls.params_held = Some((host.floats, host.top_k));
        }
    }
    let rows = ls.rows;
    SampleRows {
        logits: &ls.logits,
        vocab,
        temps: ls.params_f.slice(0..rows),
        top_k: &ls.top_k,
        top_p: ls.params_f.slice(rows..2 * rows),
        uniforms: ls.params_f.slice(2 * rows..3 * rows),
        picked: &mut ls.picked,
        cap: rows,
        stats: &mut ls.sample_stats,
        ticks: &mut ls.sample_ticks,
        rows: n,
    }
    .launch(k, stream)?;
    // One copy: the ids, then (from `rows` on) the logprobs' bits.
    let picked = stream
        .clone_dtoh(&ls.picked.slice(0..rows + n))
        .map_err(|e| drv("token copy", e))?;
    stream.synchronize().map_err(|e| drv("token copy", e))?;
    Ok(picked[..n]
        .iter()
        .zip(&picked[rows..rows + n])
        .map(|(&t, &lp)| Sampled {
            token: t.max(0) as u32,
            logprob: f32::from_bits(lp as u32),
            top: Vec::new(),
        })
        .collect())
}

/// The rows' logit biases and grammar masks (waiting for masks still being computed),
/// uploaded and applied to the logits on the device.
fn constrain(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    ls: &mut LogitsSpace,
    vocab: usize,
    specs: &[SampleSpec],
) -> Result<()> {
    let h = constraints(specs, vocab);
    let up = |what: &str, e| drv(&format!("{what} copy"), e);
    let masks = stream
        .clone_htod(&h.masks)
        .map_err(|e| up("grammar masks", e))?;
    let has_mask = stream
        .clone_htod(&h.has_mask)
        .map_err(|e| up("grammar masks", e))?;
    let bias_off = stream
        .clone_htod(&h.bias_off)
        .map_err(|e| up("logit bias", e))?;
    let bias_tok = stream
        .clone_htod(&h.bias_tok)
        .map_err(|e| up("logit bias", e))?;
    let bias_val = stream
        .clone_htod(&h.bias_val)
        .map_err(|e| up("logit bias", e))?;
    ConstrainRows {
        logits: &mut ls.logits,
        vocab,
        masks: &masks,
        words: h.words,
        has_mask: &has_mask,
        bias_off: &bias_off,
        bias_tok: &bias_tok,
        bias_val: &bias_val,
        rows: specs.len(),
    }
    .launch(k, stream)
}

/// `constrain_rows`'s inputs laid out on the host.
struct ConstraintsHost {
    words: usize,
    masks: Vec<u32>,
    has_mask: Vec<i32>,
    bias_off: Vec<i32>,
    /// Never empty (a zero-length upload is refused): a row-less pad when no row has a bias.
    bias_tok: Vec<i32>,
    bias_val: Vec<f32>,
}

fn constraints(specs: &[SampleSpec], vocab: usize) -> ConstraintsHost {
    let words = crate::guided::mask_words(vocab);
    let mut h = ConstraintsHost {
        words,
        masks: vec![0; specs.len() * words],
        has_mask: vec![0; specs.len()],
        bias_off: vec![0],
        bias_tok: Vec::new(),
        bias_val: Vec::new(),
    };
    for (r, s) in specs.iter().enumerate() {
        if let Some(m) = s.mask() {
            let n = m.len().min(words);
            h.masks[r * words..r * words + n].copy_from_slice(&m[..n]);
            h.has_mask[r] = 1;
        }
        for &(t, b) in &s.params.logit_bias {
            h.bias_tok.push(t.min(i32::MAX as u32) as i32);
            h.bias_val.push(b);
        }
        h.bias_off.push(h.bias_tok.len() as i32);
    }
    if h.bias_tok.is_empty() {
        h.bias_tok.push(-1);
        h.bias_val.push(0.0);
    }
    h
}

/// The host side of `sample_rows`'s parameters, padded to the buffers' `rows`.
struct SampleParamsHost {
    /// temperatures, then top_p, then uniforms: three runs of `rows`.
    floats: Vec<f32>,
    top_k: Vec<i32>,
}

/// Lays the sequences' sampling parameters out for `sample_rows`. Greedy rows (temperature
/// about 0 or top_k 1, as the CPU sampler decides) draw nothing from their generator; every
/// other row draws exactly one uniform, so a seed's stream advances as on the CPU.
fn sample_params(specs: &mut [SampleSpec], rows: usize) -> SampleParamsHost {
    let mut floats = vec![0.0f32; 3 * rows];
    let mut top_k = vec![0i32; rows];
    for (i, s) in specs.iter_mut().enumerate() {
        let p = s.params;
        let greedy = p.temperature <= 1e-5 || p.top_k == 1;
        floats[i] = if greedy { 0.0 } else { p.temperature };
        floats[rows + i] = p.top_p.clamp(0.0, 1.0);
        top_k[i] = p.top_k.min(i32::MAX as usize) as i32;
        if !greedy {
            // Below 1 after rounding to f32, so the draw never lands past the total.
            floats[2 * rows + i] = (s.rng.next_f64() as f32).min(1.0 - f32::EPSILON);
        }
    }
    SampleParamsHost { floats, top_k }
}

/// A backend whose step leaves its rows' logits in a `LogitsSpace` on the device: the dense
/// and the hybrid one share what follows from there.
pub(super) trait LogitsStep {
    /// Runs the step; returns how many rows have logits.
    fn run_step(&mut self, batch: &ForwardBatch) -> Result<usize>;
    /// The stream, the kernels, the logits space and the vocabulary.
    fn logits(&mut self) -> (&Arc<CudaStream>, &Kernels, Option<&mut LogitsSpace>, usize);
}

/// `Backend::forward` for such a backend: the step, then its logits copied to the host.
pub(super) fn forward_logits(
    b: &mut impl LogitsStep,
    batch: &ForwardBatch,
) -> Result<Vec<Vec<f32>>> {
    let n = b.run_step(batch)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let (stream, _, ls, v) = b.logits();
    let ls = ls.ok_or(BackendError::Invariant("logits space missing"))?;
    let host = stream
        .clone_dtoh(&ls.logits.slice(0..n * v))
        .map_err(|e| drv("logits copy", e))?;
    // A copy to pageable memory completes before returning, but say so explicitly.
    stream.synchronize().map_err(|e| drv("logits copy", e))?;
    Ok(host.chunks_exact(v).map(<[f32]>::to_vec).collect())
}

/// `Backend::forward_sample` for such a backend: sampled on the device, after the rows'
/// logit biases and grammar masks (`constrain_rows`, before `sample_rows`). A request that
/// asks for top logprobs falls back to copying the logits and sampling on the host (bias and
/// mask applied there).
pub(super) fn forward_sampled(
    b: &mut impl LogitsStep,
    batch: &ForwardBatch,
    specs: &mut [SampleSpec],
) -> Result<Vec<Sampled>> {
    if specs
        .iter()
        .any(|s| !matches!(s.params.logprobs, None | Some(0)))
    {
        let logits = forward_logits(b, batch)?;
        return Ok(logits
            .iter()
            .zip(specs.iter_mut())
            .map(|(l, s)| s.sample(l))
            .collect());
    }
    let n = b.run_step(batch)?;
    if n != specs.len() {
        return Err(BatchError::SpecCount {
            seqs: n,
            specs: specs.len(),
        }
        .into());
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    let (stream, k, ls, vocab) = b.logits();
    let ls = ls.ok_or(BackendError::Invariant("logits space missing"))?;
    sample_logits(stream, k, ls, vocab, specs)
}

/// Samples each row of host `logits` (`specs.len()` rows of `vocab`) on device `ordinal`,
/// through the same buffers and launches as a forward pass's logits: for checking the
/// device sampler against the CPU's on rows of any vocabulary.
pub fn sample_host_logits(
    ordinal: usize,
    logits: &[f32],
    vocab: usize,
    specs: &mut [SampleSpec],
) -> Result<Vec<Sampled>> {
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
    let stream = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
    let (k, _) = Kernels::load(&ctx)?;
    let mut cfg = crate::init::preset(None, "qwen2.5-0.5b")?;
    cfg.vocab_size = vocab;
    let mut ls = LogitsSpace::alloc(&stream, &cfg, specs.len())?;
    if logits.len() != specs.len() * vocab {
        return Err(BatchError::LogitsShape {
            logits: logits.len(),
            rows: specs.len(),
            vocab,
        }
        .into());
    }
    stream
        .memcpy_htod(logits, &mut ls.logits)
        .map_err(|e| drv("logits upload", e))?;
    sample_logits(&stream, &k, &mut ls, vocab, specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constraints_lay_out_masks_and_biases_per_row() {
        use crate::backend::MaskSlot;
        use crate::sampler::{Rng, SamplingParams};
        let plain = SamplingParams::default();
        let biased = SamplingParams {
            logit_bias: vec![(3, -100.0), (40, 5.0)],
            ..Default::default()
        };
        let slot = MaskSlot::new();
        slot.set(vec![0b1010, 0x8000_0000]).unwrap();
        let (mut r0, mut r1) = (Rng::seeded(1), Rng::seeded(2));
        let specs = [
            SampleSpec {
                params: &biased,
                rng: &mut r0,
                mask: None,
            },
            SampleSpec {
                params: &plain,
                rng: &mut r1,
                mask: Some(&slot),
            },
        ];
        let h = constraints(&specs, 64);
        assert_eq!(h.words, 2);
        assert_eq!(h.has_mask, [0, 1]);
        assert_eq!(h.masks, [0, 0, 0b1010, 0x8000_0000]);
        assert_eq!(h.bias_off, [0, 2, 2]);
        assert_eq!((h.bias_tok, h.bias_val), (vec![3, 40], vec![-100.0, 5.0]));
    }

    #[test]
    fn sampling_parameters_draw_only_for_random_rows() {
        use crate::sampler::{Rng, SamplingParams};
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let random = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            ..Default::default()
        };
        let (mut r0, mut r1) = (Rng::seeded(5), Rng::seeded(5));
        let mut specs = [
            SampleSpec {
                params: &greedy,
                rng: &mut r0,
                mask: None,
            },
            SampleSpec {
                params: &random,
                rng: &mut r1,
                mask: None,
            },
        ];
        let h = sample_params(&mut specs, 4);
        assert_eq!(h.floats.len(), 12);
        assert_eq!(&h.floats[0..2], &[0.0, 0.7]);
        assert_eq!(&h.floats[4..6], &[1.0, 0.9]);
        assert_eq!(h.top_k[..2], [0, 40]);
        let mut fresh = Rng::seeded(5);
        assert_eq!(h.floats[8], 0.0);
        assert_eq!(h.floats[9], fresh.next_f64() as f32);
        // The greedy row's generator was not touched; the random row's advanced once.
        assert_eq!(r0.next_u64(), Rng::seeded(5).next_u64());
        assert_eq!(r1.next_u64(), fresh.next_u64());
    }
}
