//! Gated DeltaNet's mixing on the device (`kernels/delta.cu`): the causal convolution and the
//! gated delta rule with its gated norm, for every sequence of a step in two launches. The
//! CPU's [`delta::mix`] is the reference, and the recurrent state is laid out as the CPU's
//! slots are (`StateLayout`), so a state moves between the backends unchanged.
//!
//! Three paths for prompts, the same rule: `gated_delta_rule` alone (a block per value head
//! holds the whole state and does the normalisation, the gates and the gated norm per token),
//! the scan path (`DeltaMix::scan`: those parts in launches of their own, each value column's
//! state over 4 threads in blocks of 32 columns, tokens staged in shared memory), whose
//! serial part per token is a few shared-memory reads and shuffles rather than block-wide
//! sums, and the scan path in the chunked form the CPU uses (`DeltaMix::chunk_mats`: each
//! chunk's `(I + A)^-1` for all chunks at once, then the chunks in order as small matrix
//! products), whose serial part is per chunk of 32 tokens. Decode steps run the first.
//! [`mix_on_device`] runs one layer for a batch given on the host, which is how
//! `tests/cuda_parity.rs` holds these kernels to the CPU on a GPU.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PushKernelArg};

use super::device::drv;
use super::kernels::{failed, holds, Kernels};
use super::shapes::{self, grid};
use crate::backend::cpu::delta::{self, DeltaParams};
use crate::error::{EngineError, Result};

/// A layer's sizes as the kernels index them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaDims {
    /// Convolution channels (q, k and v): `2 * nk * dk + nv * dv`.
    pub cd: usize,
    /// A row of the stacked input projections: `cd + nv * dv + 2 * nv`.
    pub row: usize,
    pub kw: usize,
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl DeltaDims {
    /// The sizes of `p`'s layer, refused by name where the kernels cannot take them.
    pub fn of(p: &DeltaParams) -> Result<DeltaDims> {
        let hy = &p.hy;
        let d = DeltaDims {
            cd: hy.conv_dim(),
            row: hy.conv_dim() + hy.value_dim() + 2 * hy.linear_num_value_heads,
            kw: hy.linear_conv_kernel_dim,
            nk: hy.linear_num_key_heads,
            nv: hy.linear_num_value_heads,
            dk: hy.linear_key_head_dim,
            dv: hy.linear_value_head_dim,
        };
        let max = shapes::MAX_DELTA_HEAD;
        let refuse = |what: String| {
            Err(EngineError::BadModel(format!(
                "the CUDA backend's Gated DeltaNet kernels do not take {what}"
            )))
        };
        if d.dk == 0 || d.dk > max || d.dv == 0 || d.dv > max {
            return refuse(format!(
                "heads of {} x {} (linear_key_head_dim x linear_value_head_dim; at most {max})",
                d.dk, d.dv
            ));
        }
        if d.kw == 0 || d.kw > shapes::MAX_CONV_KERNEL {
            return refuse(format!(
                "a convolution of {} taps (linear_conv_kernel_dim; at most {})",
                d.kw,
                shapes::MAX_CONV_KERNEL
            ));
        }
        if d.nk == 0 || !d.nv.is_multiple_of(d.nk) {
            return refuse(format!("{} value heads over {} key heads", d.nv, d.nk));
        }
        Ok(d)
    }

    /// f32 values of one layer's part of a slot: the window, then the delta state.
    pub fn layer_floats(&self) -> usize {
        (self.kw - 1) * self.cd + self.nv * self.dk * self.dv
    }
}

/// Where a layer's state is in the slot pool: slot `s` at `s * slot_stride + layer_off`.
#[derive(Clone, Copy, Debug)]
pub struct StateAt {
    pub slot_stride: usize,
    pub layer_off: usize,
}

/// The step's sequences as the kernels read them: `[S, 4]` of first row, rows, slot, fresh.
pub fn seq_table(seqs: &[(usize, usize, u32, bool)]) -> Vec<i32> {
    seqs.iter()
        .flat_map(|&(first, n, slot, fresh)| [first as i32, n as i32, slot as i32, fresh as i32])
        .collect()
}

/// One layer's convolution then delta rule for `num_seqs` sequences whose `tokens` rows of
/// `proj` are in the step; `out` gets `[tokens, nv * dv]` bf16 rows.
pub struct DeltaMix<'a> {
    pub dims: DeltaDims,
    pub proj: &'a CudaSlice<f32>,
    pub conv: &'a CudaSlice<f32>,
    pub neg_a: &'a CudaSlice<f32>,
    pub dt_bias: &'a CudaSlice<f32>,
    pub norm: &'a CudaSlice<f32>,
    pub eps: f32,
    pub states: &'a mut CudaSlice<f32>,
    pub at: StateAt,
    /// The largest slot id in `seqs`, checked against `states`.
    pub max_slot: usize,
    pub seqs: &'a CudaSlice<i32>,
    pub num_seqs: usize,
    pub tokens: usize,
    /// Scratch `[tokens, cd]`: the convolution's output.
    pub mixed: &'a mut CudaSlice<f32>,
    pub out: &'a mut CudaSlice<u16>,
    /// Run the scan path (which also overwrites `proj`'s b and a columns with the gates),
    /// and the most tokens a sequence has in the step (its launch bounds).
    pub scan: Option<usize>,
    /// On the scan path, the recurrence in the chunked form (`delta_chunk_*`) in place of
    /// `delta_scan`, with this scratch for each chunk's matrices (`chunk_mats_len`).
    pub chunk_mats: Option<&'a mut CudaSlice<f32>>,
}

/// f32s the chunked form's scratch takes for `tokens` tokens: per token row, the rows of its
/// chunk's two `CHUNK_LEN`-square matrices for each value head.
pub fn chunk_mats_len(d: &DeltaDims, tokens: usize) -> usize {
    tokens * 2 * shapes::CHUNK_LEN * d.nv
}

/// Which way a step with prompts runs the recurrence (`mix_on_device`, the timings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaPath {
    /// `delta_conv_silu` then `gated_delta_rule`, token by token.
    Recurrent,
    /// The scan path (`CudaOptions::gdn_scan`).
    Scan,
    /// The scan path with the chunked form (`CudaOptions::gdn_chunked`).
    Chunked,
}

impl DeltaPath {
    /// `DeltaMix::scan` for a step whose longest sequence has `longest` tokens.
    pub fn scan(self, longest: usize) -> Option<usize> {
        (self != DeltaPath::Recurrent).then_some(longest)
    }
}

/// The sizes and offsets the launches pass, as the kernels take them.
struct Figures {
    row: i32,
    kw: i32,
    cd: i32,
    nk: i32,
    nv: i32,
    dk: i32,
    dv: i32,
    /// A slot's stride in the pool, and where this layer's window and delta state start.
    stride: i64,
    conv_off: i64,
    delta_off: i64,
}

impl DeltaMix<'_> {
    fn figures(&self) -> Figures {
        let d = self.dims;
        Figures {
            row: d.row as i32,
            kw: d.kw as i32,
            cd: d.cd as i32,
            nk: d.nk as i32,
            nv: d.nv as i32,
            dk: d.dk as i32,
            dv: d.dv as i32,
            stride: self.at.slot_stride as i64,
            conv_off: self.at.layer_off as i64,
            delta_off: (self.at.layer_off + (d.kw - 1) * d.cd) as i64,
        }
    }

    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        self.check()?;
        match self.scan {
            Some(longest) => self.launch_scan(k, s, longest),
            None => self.launch_recurrent(k, s),
        }
    }

    fn check(&self) -> Result<()> {
        let d = self.dims;
        let n = "gated DeltaNet";
        holds(n, "proj", self.proj.len(), self.tokens * d.row)?;
        holds(n, "conv", self.conv.len(), d.cd * d.kw)?;
        holds(n, "neg_a", self.neg_a.len(), d.nv)?;
        holds(n, "dt_bias", self.dt_bias.len(), d.nv)?;
        holds(n, "norm", self.norm.len(), d.dv)?;
        holds(n, "seqs", self.seqs.len(), 4 * self.num_seqs)?;
        holds(n, "mixed", self.mixed.len(), self.tokens * d.cd)?;
        holds(n, "out", self.out.len(), self.tokens * d.nv * d.dv)?;
        holds(
            n,
            "states",
            self.states.len(),
            self.max_slot * self.at.slot_stride + self.at.layer_off + d.layer_floats(),
        )?;
        if let Some(longest) = self.scan {
            if longest > self.tokens {
                return Err(EngineError::InvalidRequest(format!(
                    "a sequence of {longest} tokens in a step of {}",
                    self.tokens
                )));
            }
        }
        Ok(())
    }

    fn launch_recurrent(mut self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let d = self.dims;
        let Figures {
            row,
            cd,
            nk,
            nv,
            dk,
            dv,
            stride,
            delta_off,
            ..
        } = self.figures();

        let threads = shapes::DELTA_CONV.threads as usize;
        let cfg = grid(
            &shapes::DELTA_CONV,
            d.cd.div_ceil(threads),
            self.num_seqs,
            1,
        )?;
        self.launch_conv(s, &k.delta_conv, cfg, "delta_conv_silu")?;

        let cfg = grid(&shapes::GATED_DELTA, d.nv, self.num_seqs, 1)?;
        let mut b = s.launch_builder(&k.gated_delta);
        b.arg(&*self.mixed)
            .arg(&cd)
            .arg(self.proj)
            .arg(&row)
            .arg(self.neg_a)
            .arg(self.dt_bias)
            .arg(self.norm)
            .arg(&mut *self.states)
            .arg(&stride)
            .arg(&delta_off)
            .arg(self.seqs)
            .arg(&mut *self.out)
            .arg(&nk)
            .arg(&nv)
            .arg(&dk)
            .arg(&dv)
            .arg(&self.eps);
        // SAFETY: as above, for `gated_delta_rule`; dk and dv are at most its block and its
        // register arrays (`DeltaDims::of`).
        unsafe { b.launch(cfg) }.map_err(failed("gated_delta_rule"))?;
        Ok(())
    }

    /// The convolution, `delta_conv_silu` or `delta_conv_chunks` (the same arguments; the
    /// latter leaves the windows to `delta_conv_window`).
    fn launch_conv(
        &mut self,
        s: &CudaStream,
        f: &cudarc::driver::CudaFunction,
        cfg: cudarc::driver::LaunchConfig,
        name: &'static str,
    ) -> Result<()> {
        let Figures {
            row,
            kw,
            cd,
            stride,
            conv_off,
            ..
        } = self.figures();
        let mut b = s.launch_builder(f);
        b.arg(self.proj)
            .arg(&row)
            .arg(self.conv)
            .arg(&kw)
            .arg(&mut *self.states)
            .arg(&stride)
            .arg(&conv_off)
            .arg(self.seqs)
            .arg(&mut *self.mixed)
            .arg(&cd);
        // SAFETY: the arguments match both kernels' signatures in order and type; every
        // buffer holds what the grid reads or writes (`check`), the sequences' rows lie
        // within `tokens` (and, for the chunked grid, none is longer than its bound), their
        // slots within `max_slot` (the caller's table).
        unsafe { b.launch(cfg) }.map_err(failed(name))?;
        Ok(())
    }

    /// The scan path (`kernels/delta.cu`): five launches, each after the one before in
    /// stream order.
    fn launch_scan(mut self, k: &Kernels, s: &CudaStream, longest: usize) -> Result<()> {
        let d = self.dims;
        let Figures {
            row,
            kw,
            cd,
            nk,
            nv,
            dk,
            dv,
            stride,
            conv_off,
            ..
        } = self.figures();
        let ns = self.num_seqs;
        if ns == 0 || self.tokens == 0 {
            return Ok(());
        }
        let conv_blocks = d.cd.div_ceil(shapes::DELTA_CONV_CHUNKS.threads as usize);
        let cfg = grid(
            &shapes::DELTA_CONV_CHUNKS,
            conv_blocks,
            longest.div_ceil(shapes::DCONV_TOKENS).max(1),
            ns,
        )?;
        self.launch_conv(s, &k.delta_conv_chunks, cfg, "delta_conv_chunks")?;

        let cfg = grid(&shapes::DELTA_CONV_WINDOW, conv_blocks, ns, 1)?;
        let mut b = s.launch_builder(&k.delta_conv_window);
        b.arg(self.proj)
            .arg(&row)
            .arg(&kw)
            .arg(&mut *self.states)
            .arg(&stride)
            .arg(&conv_off)
            .arg(self.seqs)
            .arg(&cd);
        // SAFETY: as above, for `delta_conv_window`.
        unsafe { b.launch(cfg) }.map_err(failed("delta_conv_window"))?;

        let chunked = self.chunk_mats.is_some();
        let log_gate = i32::from(chunked);
        let cfg = grid(&shapes::DELTA_QK_GATES, self.tokens, 1, 1)?;
        let mut b = s.launch_builder(&k.delta_qk_gates);
        b.arg(&mut *self.mixed)
            .arg(&cd)
            .arg(self.proj)
            .arg(&row)
            .arg(self.neg_a)
            .arg(self.dt_bias)
            .arg(&nk)
            .arg(&nv)
            .arg(&dk)
            .arg(&dv)
            .arg(&log_gate);
        // SAFETY: as above, for `delta_qk_gates`: a block a row of `tokens`; it writes the
        // gates over b and a in `proj`, which only the delta rule reads.
        unsafe { b.launch(cfg) }.map_err(failed("delta_qk_gates"))?;
        match self.chunk_mats.take() {
            Some(mats) => {
                self.launch_chunk_prep(k, s, longest, mats)?;
                self.launch_state_scan(k, s, Some(mats))?;
            }
            None => self.launch_state_scan(k, s, None)?,
        }
        self.launch_gated_norm(k, s)
    }

    /// `delta_chunk_prep`: every chunk's `(I + A)^-1` and `P` into `mats`, for the chunked
    /// form's `delta_chunk_scan`.
    fn launch_chunk_prep(
        &mut self,
        k: &Kernels,
        s: &CudaStream,
        longest: usize,
        mats: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let d = self.dims;
        holds(
            "delta_chunk_prep",
            "chunk_mats",
            mats.len(),
            chunk_mats_len(&d, self.tokens),
        )?;
        let f = self.figures();
        let chunks = longest.div_ceil(shapes::CHUNK_LEN).max(1);
        let cfg = grid(&shapes::DELTA_CHUNK_PREP, d.nv, chunks, self.num_seqs)?;
        let mut b = s.launch_builder(&k.delta_chunk_prep);
        b.arg(&*self.mixed)
            .arg(&f.cd)
            .arg(self.proj)
            .arg(&f.row)
            .arg(mats)
            .arg(self.seqs)
            .arg(&f.nk)
            .arg(&f.nv)
            .arg(&f.dk)
            .arg(&f.dv);
        // SAFETY: as above, for `delta_chunk_prep`: a block per (value head, chunk,
        // sequence), none past its sequence's rows (`longest` bounds them); `mats` holds
        // 2 CHUNK_LEN nv values for each of the step's rows (checked above); dk is at most its
        // shared rows (`DeltaDims::of`).
        unsafe { b.launch(cfg) }.map_err(failed("delta_chunk_prep"))?;
        Ok(())
    }

    /// The recurrence over the step's tokens, its raw output over v in `mixed`: `delta_scan`
    /// token by token, or with the chunks' matrices `delta_chunk_scan` chunk by chunk (the
    /// same arguments and grid, `mats` after `row`).
    fn launch_state_scan(
        &mut self,
        k: &Kernels,
        s: &CudaStream,
        mats: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let d = self.dims;
        let f = self.figures();
        let (func, shape, name) = match mats {
            None => (&k.delta_scan, &shapes::DELTA_SCAN, "delta_scan"),
            Some(_) => (
                &k.delta_chunk_scan,
                &shapes::DELTA_CHUNK_SCAN,
                "delta_chunk_scan",
            ),
        };
        let cfg = grid(shape, d.nv, d.dv.div_ceil(shapes::SCAN_COLS), self.num_seqs)?;
        let mut b = s.launch_builder(func);
        b.arg(&mut *self.mixed)
            .arg(&f.cd)
            .arg(self.proj)
            .arg(&f.row);
        if let Some(mats) = mats {
            b.arg(&*mats);
        }
        b.arg(&mut *self.states)
            .arg(&f.stride)
            .arg(&f.delta_off)
            .arg(self.seqs)
            .arg(&f.nk)
            .arg(&f.nv)
            .arg(&f.dk)
            .arg(&f.dv);
        // SAFETY: as above, for `delta_scan` and `delta_chunk_scan` (whose `mats` is as
        // `delta_chunk_prep` wrote it); dk and dv are at most their shared arrays and register
        // arrays (`DeltaDims::of`).
        unsafe { b.launch(cfg) }.map_err(failed(name))?;
        Ok(())
    }

    /// `delta_gated_norm`: o / rms(o) * w * silu(z) as bf16 into `out`, a block a row.
    fn launch_gated_norm(&mut self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let Figures {
            row,
            cd,
            nk,
            nv,
            dk,
            dv,
            ..
        } = self.figures();
        let cfg = grid(&shapes::DELTA_GATED_NORM, self.tokens, 1, 1)?;
        let mut b = s.launch_builder(&k.delta_gated_norm);
        b.arg(&*self.mixed)
            .arg(&cd)
            .arg(self.proj)
            .arg(&row)
            .arg(self.norm)
            .arg(&mut *self.out)
            .arg(&nk)
            .arg(&nv)
            .arg(&dk)
            .arg(&dv)
            .arg(&self.eps);
        // SAFETY: as above, for `delta_gated_norm`: a block a row of `tokens`.
        unsafe { b.launch(cfg) }.map_err(failed("delta_gated_norm"))?;
        Ok(())
    }
}

/// One layer's mixing on device `ordinal` for sequences given on the host, for checking the
/// kernels against [`delta::mix`] (along `path`): `seqs` are (tokens, fresh) in row order over `proj`
/// (`[tokens, row]`), `states[i]` sequence `i`'s window then delta state for this layer
/// (updated). Returns `[tokens, nv * dv]`, widened from the kernels' bf16.
pub fn mix_on_device(
    ordinal: usize,
    p: &DeltaParams,
    proj: &[f32],
    seqs: &[(usize, bool)],
    states: &mut [Vec<f32>],
    path: DeltaPath,
) -> Result<Vec<f32>> {
    let d = DeltaDims::of(p)?;
    let per = d.layer_floats();
    if states.len() != seqs.len() || states.iter().any(|s| s.len() != per) {
        return Err(EngineError::InvalidRequest(format!(
            "one state of {per} values per sequence is needed"
        )));
    }
    let tokens: usize = seqs.iter().map(|s| s.0).sum();
    if proj.len() != tokens * d.row {
        return Err(EngineError::InvalidRequest(format!(
            "proj holds {} values, not {tokens} rows of {}",
            proj.len(),
            d.row
        )));
    }
    let scan = path.scan(seqs.iter().map(|s| s.0).max().unwrap_or(0));
    let ctx: Arc<CudaContext> =
        CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
    let s = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
    let (k, _) = Kernels::load(&ctx)?;
    let up = |v: &[f32]| s.clone_htod(v).map_err(|e| drv("upload", e));
    let mut first = 0;
    let table: Vec<(usize, usize, u32, bool)> = seqs
        .iter()
        .enumerate()
        .map(|(i, &(n, fresh))| {
            let t = (first, n, i as u32, fresh);
            first += n;
            t
        })
        .collect();
    let seq_rows = s
        .clone_htod(&seq_table(&table))
        .map_err(|e| drv("upload", e))?;
    let mut pool = up(&states.concat())?;
    let mut mixed = s
        .alloc_zeros::<f32>(tokens * d.cd)
        .map_err(|e| drv("alloc", e))?;
    let mut out = s
        .alloc_zeros::<u16>(tokens * d.nv * d.dv)
        .map_err(|e| drv("alloc", e))?;
    let mut mats = s
        .alloc_zeros::<f32>(chunk_mats_len(&d, tokens).max(1))
        .map_err(|e| drv("alloc", e))?;
    let (proj_d, conv, neg_a, dt_bias, norm) = (
        up(proj)?,
        up(&p.conv)?,
        up(&p.neg_a)?,
        up(&p.dt_bias)?,
        up(&p.norm)?,
    );
    DeltaMix {
        dims: d,
        proj: &proj_d,
        conv: &conv,
        neg_a: &neg_a,
        dt_bias: &dt_bias,
        norm: &norm,
        eps: p.eps,
        states: &mut pool,
        at: StateAt {
            slot_stride: per,
            layer_off: 0,
        },
        max_slot: seqs.len().saturating_sub(1),
        seqs: &seq_rows,
        num_seqs: seqs.len(),
        tokens,
        mixed: &mut mixed,
        out: &mut out,
        scan,
        chunk_mats: (path == DeltaPath::Chunked).then_some(&mut mats),
    }
    .launch(&k, &s)?;
    let back = s.clone_dtoh(&pool).map_err(|e| drv("download", e))?;
    for (dst, src) in states.iter_mut().zip(back.chunks_exact(per)) {
        dst.copy_from_slice(src);
    }
    let bits = s.clone_dtoh(&out).map_err(|e| drv("download", e))?;
    Ok(bits
        .into_iter()
        .map(|b| f32::from_bits((b as u32) << 16))
        .collect())
}

/// The CPU's result for the same inputs as [`mix_on_device`] (each sequence through
/// [`delta::mix`] in turn, a fresh one from zeros), for the comparison.
pub fn mix_on_host(
    p: &DeltaParams,
    proj: &[f32],
    seqs: &[(usize, bool)],
    states: &mut [Vec<f32>],
    chunk: usize,
) -> Result<Vec<f32>> {
    let d = DeltaDims::of(p)?;
    let conv = (d.kw - 1) * d.cd;
    let mut out = Vec::new();
    let mut at = 0;
    for (&(n, fresh), st) in seqs.iter().zip(states.iter_mut()) {
        if fresh {
            st.fill(0.0);
        }
        let (window, state) = st.split_at_mut(conv);
        let rows = &proj[at * d.row..(at + n) * d.row];
        out.extend(delta::mix(p, rows, n, window, state, chunk));
        at += n;
    }
    Ok(out)
}
