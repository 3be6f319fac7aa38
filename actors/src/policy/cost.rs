//! What a request costs on a worker, in seconds: the time model every cost-based policy
//! shares (see the policy module's docs for what goes into it).

/// One routable worker as a policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Requests queued or running there, as far as this router knows.
    pub load: f64,
    /// Generated tokens per second one sequence gets there (> 0).
    pub capacity: f64,
    /// How many of the request's leading KV blocks the worker holds (or will, for blocks
    /// of requests just sent there).
    pub cached_blocks: usize,
    /// Prompt tokens this router sent there that are not computed yet (no first token).
    pub queued_prompt_tokens: f64,
    /// Prompt tokens per second it computes (> 0).
    pub prefill_rate: f64,
    /// Its decode step in seconds, `step_base + step_per_seq * batch`, as it measured it;
    /// both 0 until it has decoded.
    pub step_base: f64,
    pub step_per_seq: f64,
    /// Sequences it runs at once (0: unknown, no limit assumed).
    pub max_running: f64,
}

/// What a policy knows of the request.
#[derive(Clone, Copy, Debug)]
pub struct RequestShape {
    pub prompt_tokens: usize,
    pub block_size: usize,
    /// Tokens it is expected to generate (at least 1).
    pub output_tokens: usize,
}

/// Seconds the request would spend on this worker apart from computing its own prompt:
/// the prompts queued ahead of it, its decode in that batch, the wait for a slot. What the
/// prefix policy's imbalance bound compares: it grows with the work a worker holds only as
/// far as that work slows a newcomer there.
pub(super) fn backlog(c: &Candidate, req: RequestShape) -> f64 {
    expected_time(c, 0.0, req.output_tokens.max(1) as f64)
}

/// The least a sequence is taken to add to a decode step, relative to the step's fixed
/// part (0.2%: 16 µs on an 8 ms step).
const MIN_SLOPE: f64 = 0.002;

/// Seconds the request costs the cluster on this worker when `uncached` of its prompt
/// tokens must be computed: its own wait, prefill and decode, and the time it adds to the
/// sequences already there.
pub(super) fn expected_time(c: &Candidate, uncached: f64, out: f64) -> f64 {
    let n = c.load.max(0.0);
    let limit = if c.max_running >= 1.0 {
        c.max_running
    } else {
        f64::INFINITY
    };
    // The prompts queued ahead of it, then its own. (Its prefill also stalls the
    // sequences decoding there; that delays their tokens, not anyone's first token, and
    // weighing it made cache hits look dearer than they are.)
    let prompt = (c.queued_prompt_tokens + uncached) / c.prefill_rate.max(1e-9);
    let measured = c.step_base > 0.0 || c.step_per_seq > 0.0;
    if !measured {
        // Served in turn at the declared per-sequence rate.
        return prompt + out * (n + 1.0) / c.capacity.max(1e-9);
    }
    let batch = (n + 1.0).min(limit);
    // A fit that saw one batch size only says nothing of the slope; a step never gets
    // cheaper with more sequences, and a small floor keeps equal workers sharing equally
    // instead of one taking everything on a timing-noise difference in their bases.
    let per_seq = c.step_per_seq.max(c.step_base * MIN_SLOPE);
    let step = c.step_base + per_seq * batch;
    // Each of the others there runs a little slower while it decodes.
    let slowdown = per_seq * (batch - 1.0);
    // Past the batch limit it waits for a slot; slots free as sequences finish.
    let queue = if n + 1.0 > limit {
        (n + 1.0 - limit) / limit * out * step
    } else {
        0.0
    };
    prompt + out * (step + slowdown) + queue
}
