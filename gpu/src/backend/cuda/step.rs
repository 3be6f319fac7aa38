//! One step, from the engine's batch to logits on the device: the batch is laid out on the
//! host, then either replayed through the decode graph of its bucket or uploaded and
//! launched eagerly (`forward`).

use super::batch::{self, BatchLayout};
use super::buffers::{LogitsSpace, StepDims, StepInputs, Workspace};
use super::device::drv;
use super::graphs::{self, DecodeGraph, GraphHostInputs};
use super::prefill_graphs::{PaddedTokens, PrefillGraph, PrefillGraphs};
use super::CudaBackend;
use crate::backend::ForwardBatch;
use crate::error::Result;

impl CudaBackend {
    /// Runs the step up to the logits, which it leaves in `self.ls.logits` (rows in batch
    /// order). Returns how many rows have logits. A pure decode step that fits a bucket
    /// replays a captured CUDA graph (see `run_graph`); anything else is launched eagerly.
    pub(super) fn run(&mut self, batch: &ForwardBatch) -> Result<usize> {
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(0);
        }
        let layout = batch::build(
            batch,
            self.kv.block_size(),
            self.kv.num_blocks,
            self.cfg.vocab_size,
        )?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        if let Some(n) = self.run_graph(&layout)? {
            return Ok(n);
        }
        self.ensure_workspace(t)?;
        let dims = StepDims::of(&layout);
        if dims.logits > 0 {
            self.ensure_logits_space(dims.logits)?;
        }
        let inputs = StepInputs::upload(&self.stream, &layout)?;
        if let Some(n) = self.run_piecewise(&layout, &dims, &inputs)? {
            return Ok(n);
        }
        self.enqueue(&dims, &inputs)
    }

    /// A step of up to `prefill_graphs::MAX_TOKENS` tokens with `CudaOptions::prefill_graphs`:
    /// its bucket's segments replayed (each captured on first use), the attention launches
    /// (over `inputs`, the step's own) between them and the logits after. `None` when the
    /// step does not qualify; the caller then runs it eagerly.
    fn run_piecewise(
        &mut self,
        layout: &BatchLayout,
        dims: &StepDims,
        inputs: &StepInputs,
    ) -> Result<Option<usize>> {
        let Some(b) = self.prefill_graphs.bucket(layout) else {
            return Ok(None);
        };
        self.ensure_workspace(b)?;
        let host = self.prefill_graphs.padded(layout, b);
        let mut g = self.prefill_graphs.take(&self.stream, b)?;
        let r = self.replay_segments(&mut g, &host, b, dims, inputs);
        self.prefill_graphs.put_back(b, g);
        r.map(Some)
    }

    /// Uploads `host` into `g`'s buffers, then each segment (captured first if it is not)
    /// and the attention after it, then the logits. A segment whose capture fails runs
    /// eagerly, and the graphs are switched off for later steps (with a warning).
    fn replay_segments(
        &mut self,
        g: &mut PrefillGraph,
        host: &PaddedTokens,
        b: usize,
        dims: &StepDims,
        inputs: &StepInputs,
    ) -> Result<usize> {
        g.upload(&self.stream, host)?;
        let seg_dims = PrefillGraphs::dims(b);
        let layers = self.prefill_graphs.segments() - 1;
        for seg in 0..=layers {
            if g.segments[seg].is_none() && self.prefill_graphs.enabled() {
                let (ctx, stream) = (self.ctx.clone(), self.stream.clone());
                let inp = &g.inputs;
                let captured = graphs::capture(&ctx, &stream, || {
                    self.enqueue_segment(&seg_dims, inp, seg).map(|()| 0)
                });
                match captured {
                    Ok(graph) => g.segments[seg] = Some(graph),
                    Err(e) => {
                        tracing::warn!(
                            error = %e,
                            bucket = b,
                            segment = seg,
                            "prefill graph capture failed; steps with prompts run eagerly from now on"
                        );
                        self.prefill_graphs.disable();
                    }
                }
            }
            match &g.segments[seg] {
                Some(graph) => graph.launch("prefill segment")?,
                None => self.enqueue_segment(&seg_dims, &g.inputs, seg)?,
            }
            if seg < layers {
                self.enqueue_attention(dims, inputs, seg)?;
            }
        }
        self.enqueue_logits(dims, inputs)
    }

    /// The pure-decode fast path: copies the step's inputs, padded to the bucket, into the
    /// bucket's fixed device buffers and replays its graph, capturing it first if there is
    /// none yet (the first decode step of each bucket, and the first after the workspace
    /// grew). Returns `None`, and the caller runs the step eagerly, when the step does not
    /// qualify (`DecodeGraphs::bucket`) or the capture failed.
    fn run_graph(&mut self, layout: &BatchLayout) -> Result<Option<usize>> {
        let Some(b) = self.graphs.bucket(layout) else {
            return Ok(None);
        };
        self.ensure_workspace(b)?;
        self.ensure_logits_space(b)?;
        let host = self.graphs.host_inputs(layout, b);
        let mut g = self.graphs.take(&self.stream, b)?;
        let r = self.replay(&mut g, &host, b);
        self.graphs.put_back(b, g);
        Ok(r?.map(|()| layout.num_seqs()))
    }

    /// Uploads `host` into `g`'s buffers, captures `g` if needed, and launches it.
    /// `Ok(None)` when capture failed: graphs are then switched off for this backend (with a
    /// warning) and the step runs eagerly, so a driver or library that cannot capture costs
    /// speed, not correctness.
    fn replay(
        &mut self,
        g: &mut DecodeGraph,
        host: &GraphHostInputs,
        b: usize,
    ) -> Result<Option<()>> {
        g.upload(&self.stream, host)?;
        if g.exec.is_none() {
            let dims = self.graphs.dims(b);
            let (ctx, stream) = (self.ctx.clone(), self.stream.clone());
            match graphs::capture(&ctx, &stream, || self.enqueue(&dims, &g.inputs)) {
                Ok(graph) => g.exec = Some(graph),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        bucket = b,
                        "CUDA graph capture failed; decode steps run eagerly from now on"
                    );
                    self.graphs.disable();
                    return Ok(None);
                }
            }
        }
        self.graphs.launch(g, &self.stream)?;
        Ok(Some(()))
    }

    /// Activations for at least `t` tokens.
    fn ensure_workspace(&mut self, t: usize) -> Result<()> {
        if self.ws.as_ref().is_some_and(|w| w.tokens >= t) {
            return Ok(());
        }
        // Drop the old buffers first so their memory can be reused; graphs captured with
        // them would launch on freed memory.
        self.ws = None;
        self.graphs.drop_captured();
        self.prefill_graphs.drop_captured();
        self.ws = Some(Workspace::alloc(
            &self.stream,
            &self.cfg,
            t.next_power_of_two(),
        )?);
        if let Some(f) = &mut self.fp8 {
            f.ensure_tokens(&self.stream, t.next_power_of_two())?;
        }
        Ok(())
    }

    /// Logits buffers for at least `rows` rows.
    fn ensure_logits_space(&mut self, rows: usize) -> Result<()> {
        if self.ls.as_ref().is_some_and(|l| l.rows >= rows) {
            return Ok(());
        }
        self.ls = None;
        self.graphs.drop_captured();
        self.ls = Some(LogitsSpace::alloc(
            &self.stream,
            &self.cfg,
            rows.next_power_of_two(),
        )?);
        Ok(())
    }
}
