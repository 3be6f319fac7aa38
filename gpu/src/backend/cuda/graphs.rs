//! CUDA graphs for pure decode steps: one per batch-size bucket (`batch::bucket_for`),
//! captured on first use with fixed input buffers and replayed with the step's inputs,
//! padded to the bucket, copied into them.
//!
//! Why graphs: a decode step is a few hundred small launches whose CPU-side cost is
//! comparable to the GPU work at small batch; a replay is one launch. `--enforce-eager`
//! turns them off (as in vLLM), and so does a capture that fails: that costs speed, not
//! correctness.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaStream};

use super::batch::{self, BatchLayout};
use super::buffers::{StepDims, StepInputs};
use super::device::drv;
use crate::backend::error::BackendError;
use crate::config::ModelConfig;
use crate::error::Result;

/// `CudaGraph` holds raw driver handles and so is not `Send`. The backend must be `Send`
/// (the engine moves it to its own thread) and touches a graph only through `&mut self`,
/// one thread at a time, which is all the driver asks: graphs must not be used
/// concurrently, not never from another thread.
pub struct SendGraph(CudaGraph);

// SAFETY: see above; the graph is never shared, only moved with its owner.
unsafe impl Send for SendGraph {}

impl SendGraph {
    /// Launches the graph on the stream it was captured from; `what` names it in an error.
    pub fn launch(&self, what: &str) -> Result<()> {
        self.0
            .launch()
            .map_err(|e| drv(&format!("{what} launch"), e))
    }
}

/// One decode bucket: the fixed device buffers its graph reads its inputs from (a replay
/// sees whatever was copied into them just before), and the graph once captured.
pub struct DecodeGraph {
    pub inputs: StepInputs,
    /// `None` until captured, and again whenever the workspace or logits buffers are
    /// reallocated, since the captured launches hold their old addresses.
    pub exec: Option<SendGraph>,
    /// What `inputs.tables` holds, so a step copies only the rows that changed.
    tables: TableMirror,
    /// Whether `seq_starts` and `logits_rows`, the same for every step of the bucket
    /// (`0..=bucket`, `0..bucket`), have been copied.
    fixed_copied: bool,
}

impl DecodeGraph {
    /// Copies a step's padded inputs into the graph's buffers: the block tables only where
    /// they changed since the last step (`TableMirror`).
    pub fn upload(&mut self, stream: &Arc<CudaStream>, host: &GraphHostInputs) -> Result<()> {
        let tokens = (&host.token_ids[..], &host.positions[..], &host.slots[..]);
        self.inputs.upload_tokens(stream, tokens, "decode graph")?;
        let i = &mut self.inputs;
        let e = |e| drv("decode graph input upload", e);
        if !self.fixed_copied {
            stream
                .memcpy_htod(&host.seq_starts, &mut i.seq_starts)
                .map_err(e)?;
            stream
                .memcpy_htod(&host.logits_rows, &mut i.logits_rows)
                .map_err(e)?;
            self.fixed_copied = true;
        }
        stream
            .memcpy_htod(&host.seq_lens, &mut i.seq_lens)
            .map_err(e)?;
        for r in self.tables.update(&host.tables) {
            let mut dst = i.tables.slice_mut(r.clone());
            if let Err(err) = stream.memcpy_htod(&self.tables.host[r], &mut dst) {
                // The device may now hold less than the copy says: copy everything next time.
                self.tables.used = None;
                return Err(e(err));
            }
        }
        Ok(())
    }

    /// Replays the captured graph; nothing to do before it is captured.
    pub fn launch(&self) -> Result<()> {
        if let Some(exec) = &self.exec {
            exec.launch("decode graph")?;
        }
        Ok(())
    }
}

/// Records what `record` enqueues on `stream` into a graph, ready to launch.
pub fn capture(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    record: impl FnOnce() -> Result<usize>,
) -> Result<SendGraph> {
    // SAFETY: the backend issues all its work on one stream, which orders it without
    // cudarc's per-buffer events. Tracking is off only while capturing, because a capture
    // may not wait on events recorded before it began.
    unsafe { ctx.disable_event_tracking() };
    let captured = match stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    {
        Err(e) => Err(drv("graph capture start", e)),
        Ok(()) => {
            let r = record();
            // End the capture whatever happened, so the stream leaves capture mode.
            let end = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(|e| drv("graph capture", e));
            r.and(end).and_then(|graph| {
                graph
                    .ok_or_else(|| BackendError::Invariant("graph capture recorded nothing").into())
            })
        }
    };
    // SAFETY: restores cudarc's default.
    unsafe { ctx.enable_event_tracking() };
    captured.map(SendGraph)
}

/// The decode graphs of one backend, by bucket.
pub struct DecodeGraphs {
    by_bucket: HashMap<usize, DecodeGraph>,
    /// Off with `--enforce-eager`, or after a capture failed.
    enabled: bool,
    /// Block-table width of every graph: enough blocks for the model's context length
    /// (or the whole pool, if smaller). Longer sequences decode eagerly.
    width: usize,
    /// The extra KV block, outside the scheduler's pool, that padding sequences write to.
    scratch_block: i32,
    block_size: usize,
    /// Events around each replay, when a benchmark asked (`time_replays`).
    timer: Option<ReplayTimer>,
}

/// The device time of the last replay: events recorded on the stream before and after it.
struct ReplayTimer {
    start: CudaEvent,
    end: CudaEvent,
    /// Whether a replay has been recorded since the last reading.
    recorded: bool,
}

impl DecodeGraphs {
    /// Graphs for a cache of `num_blocks` blocks (plus the scratch block) when `wanted`. They
    /// also need the scratch block's slots to fit the kernels' 32-bit indices.
    pub fn new(
        wanted: bool,
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> DecodeGraphs {
        let fits = (num_blocks + 1)
            .checked_mul(block_size)
            .is_some_and(|slots| i32::try_from(slots).is_ok());
        DecodeGraphs {
            by_bucket: HashMap::new(),
            enabled: wanted && fits,
            width: cfg.max_context().div_ceil(block_size).clamp(1, num_blocks),
            scratch_block: i32::try_from(num_blocks).unwrap_or(i32::MAX),
            block_size,
            timer: None,
        }
    }

    /// Records events around every replay from now on, so that `last_replay_secs` tells how
    /// long the device took over the graph itself, apart from the host's work around it
    /// (uploads, sampling, copies back). Two event records a step: for benchmarks.
    pub fn time_replays(&mut self, ctx: &Arc<CudaContext>) -> Result<()> {
        let ev = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| drv("replay timing events", e))
        };
        self.timer = Some(ReplayTimer {
            start: ev()?,
            end: ev()?,
            recorded: false,
        });
        Ok(())
    }

    /// Launches `g` (see `DecodeGraph::launch`), between the timer's events when timing.
    pub fn launch(&mut self, g: &DecodeGraph, stream: &CudaStream) -> Result<()> {
        let Some(t) = &mut self.timer else {
            return g.launch();
        };
        let e = |e| drv("replay timing event", e);
        t.start.record(stream).map_err(e)?;
        g.launch()?;
        t.end.record(stream).map_err(e)?;
        t.recorded = true;
        Ok(())
    }

    /// Seconds the device spent on the last replay since the previous reading (waiting for
    /// it to finish), or `None` when none was timed.
    pub fn last_replay_secs(&mut self) -> Result<Option<f64>> {
        let Some(t) = self.timer.as_mut().filter(|t| t.recorded) else {
            return Ok(None);
        };
        t.recorded = false;
        let ms = t
            .start
            .elapsed_ms(&t.end)
            .map_err(|e| drv("replay timing", e))?;
        Ok(Some(f64::from(ms) / 1e3))
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The bucket `layout` replays in, or `None` when it runs eagerly: graphs are off, or the
    /// step is not pure decode, has a sequence that wants no logits, has more sequences than
    /// the largest bucket, or a block table wider than the graphs'.
    pub fn bucket(&self, layout: &BatchLayout) -> Option<usize> {
        let n = layout.num_seqs();
        if !self.enabled
            || !layout.is_decode()
            || layout.num_tokens() != n
            || layout.logits_rows.len() != n
            || layout.max_blocks > self.width
        {
            return None;
        }
        batch::bucket_for(n)
    }

    /// What a graph of `bucket` sequences launches with.
    pub fn dims(&self, bucket: usize) -> StepDims {
        StepDims::decode(bucket, self.width)
    }

    /// `layout`'s inputs padded to `bucket`.
    pub fn host_inputs(&self, layout: &BatchLayout, bucket: usize) -> GraphHostInputs {
        graph_inputs(
            layout,
            bucket,
            self.width,
            self.scratch_block,
            self.block_size,
        )
    }

    /// Takes `bucket`'s graph out (allocating its input buffers the first time), so that it
    /// can be captured while the backend is borrowed; `put_back` returns it.
    pub fn take(&mut self, stream: &Arc<CudaStream>, bucket: usize) -> Result<DecodeGraph> {
        match self.by_bucket.remove(&bucket) {
            Some(g) => Ok(g),
            None => Ok(DecodeGraph {
                inputs: StepInputs::zeroed(stream, bucket, self.width)?,
                exec: None,
                tables: TableMirror::new(bucket, self.width),
                fixed_copied: false,
            }),
        }
    }

    /// Keeps `g` for the next step of `bucket`, unless graphs were turned off meanwhile.
    pub fn put_back(&mut self, bucket: usize, g: DecodeGraph) {
        if self.enabled {
            self.by_bucket.insert(bucket, g);
        }
    }

    /// Forgets captured graphs (keeping their input buffers); the next decode step of each
    /// bucket captures again.
    pub fn drop_captured(&mut self) {
        for g in self.by_bucket.values_mut() {
            g.exec = None;
        }
    }

    /// Turns graphs off for good (after a failed capture).
    pub fn disable(&mut self) {
        self.enabled = false;
        self.by_bucket.clear();
    }
}

/// A pure decode step's inputs padded to a bucket of `bucket` sequences with block tables
/// `width` wide, built on the host. The padding sequences each run one token at position 0
/// whose K and V go to the scratch block (one block past the scheduler's pool), and attend
/// over that one slot, so they touch no real sequence's cache; their logits rows are
/// computed and ignored.
#[derive(Debug, PartialEq, Eq)]
pub struct GraphHostInputs {
    token_ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    seq_starts: Vec<i32>,
    seq_lens: Vec<i32>,
    tables: TableRows,
    logits_rows: Vec<i32>,
}

/// A step's block tables as the graph's rows hold them, without building those rows: row
/// `s < rows.len()` is `rows[s]` (the layout's, `max_blocks` wide) then `fill`, every other
/// row `fill` alone, each `width` wide.
#[derive(Debug, PartialEq, Eq)]
struct TableRows {
    rows: Vec<Vec<i32>>,
    fill: i32,
}

/// Most separate copies `TableMirror::update` asks for in a step; more become one.
const MAX_TABLE_COPIES: usize = 16;

/// The host's copy of a graph's block tables (`bucket` rows of `width`) as last copied to
/// the device, and how much of each row is not `fill`. A step's tables differ from the last
/// one's only where a sequence gained a block or the batch changed, so `update` copies those
/// rows alone: at 256 sequences and 32k-token contexts, a 2 MiB copy a step becomes a few
/// rows of a few KiB.
#[derive(Debug)]
struct TableMirror {
    host: Vec<i32>,
    width: usize,
    /// Per row, the leading entries that may differ from the fill; `None` until the first
    /// update (the device buffer starts zeroed, not filled).
    used: Option<Vec<usize>>,
    fill: i32,
}

impl TableMirror {
    fn new(bucket: usize, width: usize) -> TableMirror {
        TableMirror {
            host: vec![0; bucket * width],
            width,
            used: None,
            fill: 0,
        }
    }

    /// Brings the copy to `t`; returns the ranges (in entries) that changed, in order.
    fn update(&mut self, t: &TableRows) -> Vec<std::ops::Range<usize>> {
        let (w, rows) = (self.width, self.host.len() / self.width.max(1));
        let Some(used) = self.used.as_mut().filter(|_| self.fill == t.fill) else {
            // First use (or another fill): write every row.
            self.host.fill(t.fill);
            let mut used = vec![0; rows];
            for (s, r) in t.rows.iter().enumerate() {
                self.host[s * w..s * w + r.len()].copy_from_slice(r);
                used[s] = r.len();
            }
            self.used = Some(used);
            self.fill = t.fill;
            return std::iter::once(0..self.host.len()).collect();
        };
        let mut dirty: Vec<std::ops::Range<usize>> = Vec::new();
        for (s, u) in used.iter_mut().enumerate() {
            let new: &[i32] = t.rows.get(s).map_or(&[], Vec::as_slice);
            let span = (*u).max(new.len());
            let row = &mut self.host[s * w..s * w + span];
            let Some(first) = (0..span).find(|&i| row[i] != new.get(i).copied().unwrap_or(t.fill))
            else {
                *u = new.len();
                continue;
            };
            row[..new.len()].copy_from_slice(new);
            row[new.len()..].fill(t.fill);
            *u = new.len();
            let r = s * w + first..s * w + span;
            match dirty.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => dirty.push(r),
            }
        }
        // Past a few copies, one over the whole changed span costs less than many small ones.
        match (dirty.first(), dirty.last()) {
            (Some(a), Some(b)) if dirty.len() > MAX_TABLE_COPIES => {
                std::iter::once(a.start..b.end).collect()
            }
            _ => dirty,
        }
    }
}

/// See `GraphHostInputs`. The caller guarantees `layout` is pure decode with every sequence
/// wanting logits, `num_seqs <= bucket` and `max_blocks <= width`.
fn graph_inputs(
    layout: &BatchLayout,
    bucket: usize,
    width: usize,
    scratch_block: i32,
    block_size: usize,
) -> GraphHostInputs {
    let n = layout.num_seqs();
    let pad = |v: &[i32], fill: i32| {
        let mut v = v.to_vec();
        v.resize(bucket, fill);
        v
    };
    // Each sequence's own blocks, not the layout's rows padded to the longest with block 0:
    // no kernel reads a table past a sequence's length, and a row then changes only when its
    // own sequence gains a block (not every row whenever the longest one does).
    let mb = layout.max_blocks.min(width);
    let tables = TableRows {
        rows: (0..n)
            .map(|s| {
                let own = (layout.seq_lens[s].max(0) as usize).div_ceil(block_size);
                layout.block_tables[s * layout.max_blocks..][..own.min(mb)].to_vec()
            })
            .collect(),
        fill: scratch_block,
    };
    GraphHostInputs {
        token_ids: pad(&layout.token_ids, 0),
        positions: pad(&layout.positions, 0),
        slots: pad(&layout.slot_mapping, scratch_block * block_size as i32),
        seq_starts: (0..=bucket as i32).collect(),
        seq_lens: pad(&layout.seq_lens, 1),
        tables,
        logits_rows: (0..bucket as i32).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{ForwardBatch, SeqInput};
    use crate::kv_cache::BlockId;

    /// Padding must never point a real sequence's table or a padding token's KV write at a
    /// block the scheduler owns: everything padded goes to the scratch block.
    #[test]
    fn decode_graph_inputs_pad_to_the_scratch_block() {
        let (t0, t1) = ([BlockId(3), BlockId(4)], [BlockId(7)]);
        let batch = ForwardBatch {
            seqs: vec![
                SeqInput {
                    tokens: &[11],
                    start_pos: 5,
                    context_len: 0,
                    block_table: &t0,
                    want_logits: true,
                    state_slot: None,
                },
                SeqInput {
                    tokens: &[12],
                    start_pos: 2,
                    context_len: 0,
                    block_table: &t1,
                    want_logits: true,
                    state_slot: None,
                },
            ],
        };
        let layout = batch::build(&batch, 4, 8, 100).unwrap();
        let g = graph_inputs(&layout, 4, 3, 8, 4);
        assert_eq!(g.token_ids, vec![11, 12, 0, 0]);
        assert_eq!(g.positions, vec![5, 2, 0, 0]);
        assert_eq!(g.slots, vec![4 * 4 + 1, 7 * 4 + 2, 32, 32]);
        assert_eq!(g.seq_starts, vec![0, 1, 2, 3, 4]);
        assert_eq!(g.seq_lens, vec![6, 3, 1, 1]);
        // Sequence 1's row: its own block, then the scratch block (never read past seq_lens).
        let mut m = TableMirror::new(4, 3);
        assert_eq!(
            m.update(&g.tables),
            std::iter::once(0..12).collect::<Vec<_>>()
        );
        assert_eq!(m.host, vec![3, 4, 8, 7, 8, 8, 8, 8, 8, 8, 8, 8]);
        assert_eq!(g.logits_rows, vec![0, 1, 2, 3]);
    }

    /// Many rows changing at once come back as one copy over their span.
    #[test]
    fn many_changed_rows_are_copied_as_one_span() {
        let (bucket, width) = (40, 4);
        let mut m = TableMirror::new(bucket, width);
        let step = |b: i32| TableRows {
            rows: (0..bucket as i32).map(|s| vec![s, b]).collect(),
            fill: -1,
        };
        m.update(&step(100));
        // Every row's second entry changes: 40 ranges, one copy.
        let got = m.update(&step(200));
        assert_eq!(
            got,
            std::iter::once(1..(bucket - 1) * width + 2).collect::<Vec<_>>()
        );
        assert_eq!(m.host, whole(&step(200), bucket, width));
    }

    /// The whole table as a step's rows describe it, built from nothing.
    fn whole(t: &TableRows, bucket: usize, width: usize) -> Vec<i32> {
        let mut v = vec![t.fill; bucket * width];
        for (s, r) in t.rows.iter().enumerate() {
            v[s * width..s * width + r.len()].copy_from_slice(r);
        }
        v
    }

    /// Step after step, the mirror holds exactly the table built from nothing, and the ranges
    /// it returns cover every entry that changed and nothing of the rows that did not.
    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn block_tables_are_copied_only_where_they_changed() {
        let (bucket, width, fill) = (4, 6, 99);
        let rows = |r: &[&[i32]]| TableRows {
            rows: r.iter().map(|x| x.to_vec()).collect(),
            fill,
        };
        let mut m = TableMirror::new(bucket, width);
        let steps = [
            (rows(&[&[1, 2], &[5, 0]]), vec![0..24]),
            // The same step again: nothing to copy.
            (rows(&[&[1, 2], &[5, 0]]), vec![]),
            // Sequence 1 gains a block (the layout widens every row to 3, padding with 0).
            (rows(&[&[1, 2, 0], &[5, 6, 0]]), vec![2..3, 7..9]),
            // A third sequence joins.
            (rows(&[&[1, 2, 0], &[5, 6, 0], &[7, 0, 0]]), vec![12..15]),
            // The first leaves: every row shifts.
            (rows(&[&[5, 6], &[7, 0]]), vec![0..3, 6..9, 12..15]),
            // Back to one sequence with a short table: row 1 returns to the fill.
            (rows(&[&[5, 6]]), vec![6..8]),
        ];
        for (i, (t, want)) in steps.iter().enumerate() {
            let before = m.host.clone();
            let got = m.update(t);
            assert_eq!(m.host, whole(t, bucket, width), "step {i}: the mirror");
            assert_eq!(&got, want, "step {i}: the ranges copied");
            for (k, (a, b)) in before.iter().zip(&m.host).enumerate() {
                if a != b && i > 0 {
                    assert!(
                        got.iter().any(|r| r.contains(&k)),
                        "step {i}: entry {k} changed"
                    );
                }
            }
        }
    }
}
