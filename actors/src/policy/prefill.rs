//! Which prefill node computes a decode node's prompt.

/// A prefill node as the disaggregation choice sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrefillCandidate {
    /// Prompts queued there (its report, plus those this router sent since).
    pub queued: f64,
    /// Prompt tokens it holds or has been sent and not finished.
    pub tokens_queued: f64,
    /// Prompt tokens per second it computes when busy (0 until measured).
    pub tokens_per_s: f64,
    /// KV room, in tokens.
    pub free_tokens: f64,
}

/// Before a prefill node has been measured, its rate is taken as this (prompt tokens per
/// second); the least expected wait then falls back to the fewest queued tokens.
const UNMEASURED_PREFILL_RATE: f64 = 1000.0;

/// The prefill node with the least expected wait for a prompt of `tokens` uncached tokens,
/// among those with room: fewer than `max_queue` prompts queued and KV for the prompt.
pub fn pick_prefill(cands: &[PrefillCandidate], tokens: usize, max_queue: usize) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, c) in cands.iter().enumerate() {
        if c.queued >= max_queue as f64 || c.free_tokens < tokens as f64 {
            continue;
        }
        let rate = if c.tokens_per_s > 0.0 {
            c.tokens_per_s
        } else {
            UNMEASURED_PREFILL_RATE
        };
        let wait = (c.tokens_queued + tokens as f64) / rate;
        if best.is_none_or(|(_, b)| wait < b) {
            best = Some((i, wait));
        }
    }
    best.map(|(i, _)| i)
}
