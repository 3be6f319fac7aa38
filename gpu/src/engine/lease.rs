//! Blocks lent to a KV transfer.
//!
//! A disaggregated request has two sides. On the decode worker the engine reserves blocks
//! for the whole prompt and lends them ([`KvLease`]) to the transfer that fills them; on the
//! prefill worker it lends the blocks a prompt is computed into to the transfer that sends
//! them ([`ExportEvent::Ready`]), and says as each layer is done ([`ExportEvent::Layer`]).
//!
//! Whoever holds a clone of the lease may touch those blocks' memory (the rules are in
//! `kv_pool`); the engine frees or reuses them only after the last clone is dropped, which
//! it hears of as a command. So a transfer that is cancelled, times out or loses its peer can
//! never write into a block that was given to another sequence: the blocks stay put until
//! the writer is gone. A decode sequence whose lease ends without [`KvLease::landed`] is
//! prefilled locally from its cached prefix; one whose lease ends after it has landed goes
//! on decoding from the first token it was given.

use std::sync::Arc;

use super::request::SeqId;
use crate::device_kv::KvMemory;
use crate::kv_cache::BlockId;
use crate::kv_pool::{HostKvPool, KvSpec};
use crate::sampler::Sampled;

/// A sequence's blocks, lent to a transfer. Cheap to clone; every clone keeps them lent.
#[derive(Clone)]
pub struct KvLease(Arc<LeaseInner>);

struct LeaseInner {
    seq: SeqId,
    memory: KvMemory,
    blocks: Vec<BlockId>,
    prompt_len: usize,
    from_pos: usize,
    notify: LeaseNotify,
}

impl Drop for LeaseInner {
    fn drop(&mut self) {
        (self.notify)(LeaseEvent::Dropped(self.seq));
    }
}

/// What a lease tells its engine.
pub(super) enum LeaseEvent {
    /// A decode sequence's prompt KV has landed.
    Landed { seq: SeqId, landed: Landed },
    /// The last clone of a sequence's lease is gone.
    Dropped(SeqId),
    /// A decode sequence's transfer was given up while clones of its lease may live on (a
    /// sender that may still write): the sequence goes on in blocks of its own, and the
    /// lent ones stay held until the lease is [`LeaseEvent::Dropped`].
    Abandoned(SeqId),
}

/// How a lease reaches its engine's thread.
pub(super) type LeaseNotify = Arc<dyn Fn(LeaseEvent) + Send + Sync>;

/// What a decode sequence continues from once its prompt's KV is in place.
#[derive(Clone, Debug)]
pub struct Landed {
    /// The first generated token, sampled by the prefill worker.
    pub first: Sampled,
    /// The request's random generator after that draw, so seeded sampling goes on as it
    /// would have in one engine.
    pub rng: Option<[u64; 4]>,
    /// Prompt tokens that needed no compute (cached here or on the prefill worker).
    pub cached_tokens: usize,
    /// For a model with recurrent layers: the sequence's recurrent state after its prompt
    /// (every layer's, as [`ExportEvent::State`] carried it), which the KV alone does not
    /// give. A sequence that holds a state slot does not decode without it.
    pub state: Option<Vec<f32>>,
}

/// Where a transfer wants a sequence's blocks lent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Handover {
    /// In host memory: the pool itself, or a staging pool a device backend fills and empties
    /// (`Backend::kv_to_host`, `kv_from_host`). Every transport reads and writes these.
    #[default]
    Host,
    /// The device cache's own blocks ([`KvMemory::Device`]), on a backend that has one
    /// (`EngineInfo::device_kv`); elsewhere the same as `Host`. Only for a copy to or from
    /// another engine of this process: nothing crosses the host.
    Device,
}

/// What the prefill side hears about a sequence it exports.
pub enum ExportEvent {
    /// The sequence was admitted; its blocks cover the whole prompt. Positions below
    /// `computed` came from the prefix cache and are final already.
    Ready { lease: KvLease, computed: usize },
    /// K and V of `layer` are final for every position below `upto`.
    Layer { layer: usize, upto: usize },
    /// The first token was drawn; the request's generator is now in this state (sent
    /// before the token itself arrives on the submission).
    Sampled { rng: [u64; 4] },
    /// For a model with recurrent layers: the sequence's recurrent state after the whole
    /// prompt (sent before [`ExportEvent::Sampled`]).
    State(Vec<f32>),
}

impl KvLease {
    pub(super) fn new(
        seq: SeqId,
        memory: KvMemory,
        blocks: Vec<BlockId>,
        prompt_len: usize,
        from_pos: usize,
        notify: LeaseNotify,
    ) -> KvLease {
        KvLease(Arc::new(LeaseInner {
            seq,
            memory,
            blocks,
            prompt_len,
            from_pos,
            notify,
        }))
    }

    pub fn seq(&self) -> SeqId {
        self.0.seq
    }

    /// Gives a decode sequence's transfer up: the engine prefills the prompt itself now, in
    /// other blocks, instead of waiting for every clone of this lease to be dropped; the lent
    /// blocks are reused only once they all are. (Without other clones, dropping the lease
    /// does the same.)
    pub fn abandon(&self) {
        (self.0.notify)(LeaseEvent::Abandoned(self.0.seq));
    }

    /// Where the blocks are: host memory, or (for a transfer to another engine of this
    /// process, [`Handover::Device`](super::Handover::Device)) the device cache itself.
    pub fn memory(&self) -> &KvMemory {
        &self.0.memory
    }

    /// The host pool the blocks are in; `None` for blocks lent on the device.
    pub fn host_pool(&self) -> Option<&Arc<HostKvPool>> {
        self.0.memory.host()
    }

    pub fn spec(&self) -> &KvSpec {
        self.0.memory.spec()
    }

    /// The sequence's block table: block `i` holds positions `i * block_size ..`.
    pub fn blocks(&self) -> &[BlockId] {
        &self.0.blocks
    }

    pub fn prompt_len(&self) -> usize {
        self.0.prompt_len
    }

    /// The first position the transfer moves: on the decode side, the first one not found
    /// in its prefix cache; on the prefill side, the first one the decode side asked for.
    pub fn from_pos(&self) -> usize {
        self.0.from_pos
    }

    /// Decode side: every position from `from_pos` on has landed. The sequence decodes from
    /// `landed` once the last clone of the lease is gone.
    pub fn landed(self, landed: Landed) {
        (self.0.notify)(LeaseEvent::Landed {
            seq: self.0.seq,
            landed,
        });
    }
}
