//! The backend under test, dense or hybrid, behind one face for the runs.

use kvmesh_gpu::backend::cuda::{CudaBackend, CudaHybridBackend, Device};
use kvmesh_gpu::backend::Backend;

/// The backend under test: a dense model's, or a hybrid (Qwen3.5) model's, whose steps
/// also read and write each sequence's recurrent state (a slot per sequence).
pub enum Gpu {
    Dense(Box<CudaBackend>),
    Hybrid(Box<CudaHybridBackend>),
}

impl Gpu {
    pub fn backend(&mut self) -> &mut dyn Backend {
        match self {
            Gpu::Dense(b) => b.as_mut(),
            Gpu::Hybrid(b) => b.as_mut(),
        }
    }

    pub fn measure(&self) -> Device<'_> {
        match self {
            Gpu::Dense(b) => b.measure(),
            Gpu::Hybrid(b) => b.measure(),
        }
    }

    /// Sequence `s`'s recurrent-state slot, for a hybrid model.
    pub fn slot(&self, s: usize) -> Option<u32> {
        matches!(self, Gpu::Hybrid(_)).then_some(s as u32)
    }

    pub fn weight_bytes_per_step(&self) -> usize {
        match self {
            Gpu::Dense(b) => b.weight_bytes_per_step(),
            Gpu::Hybrid(b) => b.weight_bytes_per_step(),
        }
    }

    /// Recurrent state a step reads and writes per sequence (0 for a dense model).
    pub fn state_bytes_per_seq(&self) -> usize {
        match self {
            Gpu::Dense(_) => 0,
            Gpu::Hybrid(b) => b.state_bytes_per_seq(),
        }
    }

    /// Whether steps with prompts replayed piecewise graphs (dense models only).
    pub fn prefill_graphs(&self) -> bool {
        match self {
            Gpu::Dense(b) => b.prefill_graphs_enabled(),
            Gpu::Hybrid(_) => false,
        }
    }

    /// Whether decode steps replayed CUDA graphs.
    pub fn cuda_graphs(&self) -> bool {
        match self {
            Gpu::Dense(b) => b.cuda_graphs_enabled(),
            Gpu::Hybrid(b) => b.cuda_graphs_enabled(),
        }
    }

    /// `CudaBackend::time_products` at `rows` rows; none for a hybrid model (its layers
    /// differ), said on stderr.
    pub fn time_products(
        &mut self,
        rows: usize,
        reps: usize,
    ) -> anyhow::Result<Vec<kvmesh_gpu::backend::cuda::ProductTiming>> {
        match self {
            Gpu::Dense(b) => Ok(b.time_products(rows, reps)?),
            Gpu::Hybrid(_) => {
                eprintln!("--product-sweep: dense models only; skipped");
                Ok(Vec::new())
            }
        }
    }

    /// Times decode-graph replays on the device from now on.
    pub fn time_graph_replays(&mut self) -> anyhow::Result<()> {
        match self {
            Gpu::Dense(b) => b.time_graph_replays()?,
            Gpu::Hybrid(b) => b.time_graph_replays()?,
        }
        Ok(())
    }

    /// The device's seconds over the last step's graph, when it replayed one.
    pub fn last_graph_replay_secs(&mut self) -> anyhow::Result<Option<f64>> {
        Ok(match self {
            Gpu::Dense(b) => b.last_graph_replay_secs()?,
            Gpu::Hybrid(b) => b.last_graph_replay_secs()?,
        })
    }
}
