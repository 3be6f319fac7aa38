//! Every message nodes exchange, as rkyv archives (framed by [`super::frame`]).
//!
//! A request is one bi-directional stream: the router writes one [`StreamRequest`], the
//! worker answers with [`TokenEvent`]s until the last token or a failure. The router stops
//! reading (STOP_SENDING) to cancel. Load flows the other way on a uni-directional stream
//! the worker opens on each router connection: a [`LoadReport`] every few hundred ms.
//!
//! KV transfers (see [`crate::kv`] for the exchange) have their own messages at the end: a
//! decode worker's [`PrefillRequest`], the prefill worker's [`PrefillEvent`]s, and each data
//! stream's [`KvStreamHello`] and [`KvPiece`] headers.

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    pub request_id: u64,
    pub prompt: Vec<u32>,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub max_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub logprobs: Option<u32>,
    /// Seeded draws already spent on tokens another worker generated: set when a request
    /// is continued after its worker was lost (the prompt then ends with those tokens).
    pub resume_draws: u64,
    /// W3C trace context of the caller's span.
    pub traceparent: Option<String>,
    /// The prefill worker to take the prompt's KV from, when the router disaggregates.
    pub prefill: Option<PrefillPeer>,
    /// OpenAI's `logit_bias`: added to these tokens' logits before sampling.
    pub logit_bias: Vec<TokenBias>,
    /// The grammar the output must follow.
    pub guide: Option<WireGuide>,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct TokenBias {
    pub token: u32,
    pub bias: f32,
}

/// A request's grammar: llguidance's `TopLevelGrammar` as JSON, and how many of the prompt's
/// last tokens are output it has already read (a request continued on another worker).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct WireGuide {
    pub grammar: String,
    pub replay: u32,
}

/// A prefill worker as a decode worker needs to reach it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct PrefillPeer {
    pub node_id: String,
    pub quic_addr: String,
    pub cert_sha256: String,
    /// Prefill remotely only when at least this many prompt tokens are not cached on the
    /// decode worker (which knows its cache exactly; the router only estimates it).
    pub min_tokens: u32,
    /// The prefill worker can send KV with UCX puts.
    pub ucx: bool,
    /// The prefill worker's cache is on a GPU, so it can copy KV into a decode worker's
    /// exported pool on this host (CUDA IPC).
    pub cuda_ipc: bool,
    /// The prefill worker's cache is on a GPU and its UCX was built with CUDA: it puts KV
    /// from its cache on the GPU into a decode worker's registered cache on a GPU.
    pub ucx_cuda: bool,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq)]
pub enum Finish {
    Stop,
    Length,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum TokenEvent {
    Token {
        token: u32,
        logprob: f32,
        top: Vec<TopLogprob>,
        finish: Option<Finish>,
        cached_tokens: u32,
    },
    /// The worker could not take the request (full queue, bad input): nothing was generated,
    /// so `retryable` says whether another worker may succeed; `queue_full` that it is busy
    /// (not restarting or shutting down).
    Rejected {
        message: String,
        retryable: bool,
        queue_full: bool,
    },
    /// Generation failed after it started.
    Failed { message: String },
}

/// The first message on a bidirectional stream to a worker.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum StreamRequest {
    /// A router's request to generate; answered with [`TokenEvent`]s.
    Generate(GenerateRequest),
    /// A decode worker's request to prefill into its blocks; answered with
    /// [`PrefillEvent`]s, the KV itself on data streams.
    Prefill(PrefillRequest),
    /// A gateway's request for the model card of the model of this fingerprint; answered
    /// with one [`CardReply`].
    Card { fingerprint: String },
}

/// A worker's answer to [`StreamRequest::Card`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum CardReply {
    /// The card, as JSON (kvmesh-gpu's `ModelCard`).
    Card(Vec<u8>),
    /// The worker serves no model of that fingerprint, or has no card.
    Refused { message: String },
}

impl CardReply {
    /// The longest card (its JSON bytes) a [`CardReply`] frame carries. A worker with a
    /// longer card refuses to start: no gateway could read it.
    pub fn max_card_bytes() -> usize {
        use crate::wire::frame::{encode, Bounded, MAX_FRAME};
        let limit = Self::MAX_BYTES.min(MAX_FRAME);
        // The archive around the bytes, and room to align what follows them.
        let around = encode(&CardReply::Card(Vec::new())).map_or(64, |a| a.len()) + 16;
        limit - around
    }
}

/// The first message on a unidirectional stream, saying what it carries.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum UniHeader {
    /// [`LoadReport`]s, from a worker to a router.
    Load,
    /// A KV transfer's data (see [`crate::kv`]).
    Kv(KvStreamHello),
    /// [`KvEventBatch`]es, from a worker to a router: which prompt prefixes its cache holds.
    KvEvents,
}

/// Changes to the prefix blocks a worker's cache holds (by the chained block hash both
/// sides compute from the tokens), batched. The first batch on a stream is a snapshot:
/// the receiver replaces what it knew with `stored`. Within a batch each hash appears once,
/// with its latest state, so the lists may be applied in any order.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, Default, PartialEq)]
pub struct KvEventBatch {
    pub snapshot: bool,
    pub stored: Vec<u64>,
    pub removed: Vec<u64>,
}

/// A worker's live load, pushed to every router connected to it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    pub running: u32,
    pub waiting: u32,
    /// Prompt and generated tokens of the sequences the worker holds.
    pub tokens_in_flight: u64,
    pub kv_usage: f32,
    pub total_blocks: u32,
    /// Generated tokens per second over the last report interval.
    pub gen_tokens_per_s: f32,
    /// Tokens per second one running sequence gets, smoothed over busy intervals (the
    /// declared capacity until the node has been busy).
    pub capacity_tokens_per_s: f32,
    /// Prompt tokens per busy second (0 until measured).
    pub prompt_tokens_per_s: f32,
    /// A decode step's time as `base + per_seq * batch`, fitted over its recent steps, in
    /// milliseconds (both 0 until it has decoded): how much one more sequence slows it.
    pub step_base_ms: f32,
    pub step_per_seq_ms: f32,
    /// Sequences it runs at once; more wait for a slot.
    pub max_running: u32,
    /// The node's prefill role, when it has one: requests queued and prompt tokens held,
    /// KV use, and prompt tokens per busy second.
    pub prefill: Option<PrefillLoad>,
    /// The node is shutting down: it finishes what it has and takes nothing new. Sent at
    /// once when draining starts, so routers stop picking it within one network hop.
    pub draining: bool,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, Default, PartialEq)]
pub struct PrefillLoad {
    pub running: u32,
    pub waiting: u32,
    pub tokens_in_flight: u64,
    pub kv_usage: f32,
    pub tokens_per_s: f32,
}

/// What a prefill worker and a decode worker must share for KV to mean the same on both.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// The model's fingerprint (architecture, shapes, vocabulary, weights).
    pub model: String,
    /// Element type and backend family, e.g. "f32" (cpu), "bf16" (cuda), "sim-bf16".
    pub dtype: String,
    pub num_layers: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

impl KvLayout {
    /// Bytes of K (or V) for one position of one layer.
    pub fn bytes_per_pos(&self) -> usize {
        let elem = if self.dtype.ends_with("f32") { 4 } else { 2 };
        self.num_kv_heads as usize * self.head_dim as usize * elem
    }

    pub fn describe(&self) -> String {
        format!(
            "model {}, KV {} with {} layers x {} KV heads x {} dims, block size {}",
            self.model,
            self.dtype,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size
        )
    }

    /// `None` when the two agree; otherwise what differs, naming both sides.
    pub fn mismatch(&self, mine: &str, other: &KvLayout, theirs: &str) -> Option<String> {
        (self != other).then(|| {
            format!(
                "KV layouts differ: {mine} has {}; {theirs} has {}",
                self.describe(),
                other.describe()
            )
        })
    }
}

/// Where the prefill worker sends the bytes.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum DataPath {
    /// Unidirectional QUIC streams opened back on the request's connection.
    Quic { streams: u32 },
    /// TCP connections to the decode worker's KV listener.
    Tcp { addr: String, connections: u32 },
    /// One-sided UCX puts straight into the decode worker's registered KV buffers (RDMA
    /// writes where the fabric has them), and a [`KvLandedNotice`] per piece on `lanes` QUIC
    /// streams once its puts are flushed.
    Ucx {
        /// The decode worker's UCX worker address.
        worker: Vec<u8>,
        /// Which registration of the decode worker's the keys belong to.
        registration: u64,
        /// Per layer, its K buffer then its V buffer.
        buffers: Vec<UcxBuffer>,
        lanes: u32,
        /// Whether each notice carries a checksum of the piece's bytes (for tests).
        checksum: bool,
        /// The buffers are the decode worker's KV cache on a GPU (UCX built with CUDA on
        /// both ends): the prefill worker puts from its own cache on the GPU too.
        device: bool,
    },
    /// Copies on the GPU straight into the decode worker's KV pool, which it exported
    /// once (CUDA IPC, two processes of one host), and a [`KvLandedNotice`] per piece on
    /// one QUIC stream once its copies have completed.
    CudaIpc(Box<CudaIpcPath>),
}

/// Where a CUDA IPC transfer copies to (boxed: larger than the other data paths).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct CudaIpcPath {
    /// The driver's IPC handle of the pool's one allocation (64 bytes).
    pub handle: Vec<u8>,
    /// The allocation's length in bytes.
    pub len: u64,
    /// Per layer, the offsets of its K buffer then its V buffer in the allocation.
    pub offsets: Vec<u64>,
    /// The pool's blocks per layer buffer (the bounds every copy is checked against).
    pub num_blocks: u64,
    /// Which export of the decode worker's (notices name it back).
    pub registration: u64,
    /// The decode worker's host (Linux's boot id): a handle means nothing elsewhere.
    pub host: String,
}

/// A registered KV buffer of the decode worker.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct UcxBuffer {
    pub base: u64,
    pub len: u64,
    /// UCX's packed remote key for it.
    pub rkey: Vec<u8>,
}

/// UCX transfers: a piece's puts have completed at the decode worker (flushed). The piece's
/// `payload_bytes` is what the puts wrote; `checksum` is of those bytes, K then V, when the
/// decode worker asked for it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct KvLandedNotice {
    pub piece: KvPiece,
    /// The decode worker's registration the puts used (its keys and buffers).
    pub registration: u64,
    pub checksum: Option<u64>,
    /// UCX's transport layer for the puts (`tcp`, `cma`, `rc_mlx5`, ...), for traces.
    pub tl: String,
}

/// The decode worker asks a prefill worker to compute a prompt into its blocks.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct PrefillRequest {
    pub transfer_id: u64,
    /// Proves a data stream belongs to this transfer (TCP has no other authentication).
    pub secret: u64,
    /// The decode worker's node id, for messages.
    pub decode_node: String,
    /// The prompt and how to sample its first token.
    pub request: GenerateRequest,
    /// Positions below this are cached on the decode worker and not sent.
    pub from_pos: u32,
    /// The decode worker's block table for the prompt.
    pub dest_blocks: Vec<u32>,
    pub layout: KvLayout,
    pub data: DataPath,
}

/// The prefill worker's answers on the request stream.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum PrefillEvent {
    /// Admitted: computing now (`cached` positions were in its prefix cache).
    Started { cached: u32 },
    /// Every piece is sent; the first token and the sampler's state after drawing it.
    Done {
        token: u32,
        logprob: f32,
        top: Vec<TopLogprob>,
        rng: Option<[u64; 4]>,
        cached: u32,
        bytes: u64,
        /// For a model with recurrent layers (Qwen3.5): the sequence's recurrent state after
        /// the prompt, which the KV alone does not carry.
        state: Option<Vec<f32>>,
    },
    /// Not done, and nothing more will come; `retryable` when another worker may succeed.
    Failed { message: String, retryable: bool },
}

/// The first frame of every KV data stream.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct KvStreamHello {
    pub transfer_id: u64,
    pub secret: u64,
    pub stream: u32,
}

/// One piece's header; `payload_bytes` of K then V follow it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct KvPiece {
    pub transfer_id: u64,
    pub layer: u32,
    pub first_pos: u32,
    pub num_pos: u32,
    /// The destination blocks these positions fall in, in order (checked by the receiver
    /// against its own table).
    pub blocks: Vec<u32>,
    pub bytes_per_pos: u32,
    pub payload_bytes: u64,
}

/// Each message's frame bound (see [`Bounded`]): generous for what it can legitimately hold,
/// and far below [`MAX_FRAME`] where that is small.
mod bounds {
    use super::*;
    use crate::wire::frame::{Bounded, MAX_FRAME};

    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;

    macro_rules! bounded {
        ($($t:ty => $max:expr),* $(,)?) => {
            $(impl Bounded for $t { const MAX_BYTES: usize = $max; })*
        };
    }

    bounded! {
        // A prompt at the longest context and a grammar: as large as a frame may be.
        GenerateRequest => MAX_FRAME,
        StreamRequest => MAX_FRAME,
        // A model card carries the tokenizer (tens of MB for the largest vocabularies).
        CardReply => MAX_FRAME,
        // A token, its text and top logprobs, or the final statistics.
        TokenEvent => 4 * MIB,
        // The snapshot of a large cache's block hashes.
        KvEventBatch => 32 * MIB,
        // A KV layout with a UCX key per buffer of every layer, or a model's recurrent state
        // (Qwen3.5-9B's is 50 MiB).
        PrefillEvent => MAX_FRAME,
        // Fixed-size headers and reports.
        UniHeader => 4 * KIB,
        LoadReport => 4 * KIB,
        KvStreamHello => 256,
        // A piece's destination blocks.
        KvPiece => MIB,
        KvLandedNotice => MIB,
    }
}

#[cfg(test)]
mod tests {
    use super::CardReply;
    use crate::wire::frame::{frame, read_frame, MAX_FRAME};

    #[tokio::test]
    async fn a_card_of_the_largest_size_fits_its_frame_and_a_larger_one_does_not() {
        let max = CardReply::max_card_bytes();
        assert!(max > MAX_FRAME - 1024 && max < MAX_FRAME, "{max}");
        let card = CardReply::Card(vec![b' '; max]);
        let f = frame(&card).unwrap();
        let back = read_frame::<CardReply, _>(&mut &f[..]).await.unwrap();
        assert!(
            back == Some(card),
            "the largest card did not come back whole"
        );
        let over = frame(&CardReply::Card(vec![b' '; MAX_FRAME])).unwrap();
        let e = read_frame::<CardReply, _>(&mut &over[..])
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("CardReply") && e.contains("limit"), "{e}");
    }
}
