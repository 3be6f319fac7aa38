//! Saved recurrent states for the prefix cache of a model with recurrent layers (Qwen3.5's
//! linear attention).
//!
//! Cached KV blocks let a dense model resume a sequence at any block boundary of a cached
//! prefix. A model whose layers carry a state from token to token needs that state too, and
//! the state after a prefix depends on every token of it, so a prefix can only be resumed at
//! a boundary whose state was saved. The rule:
//!
//! - a prompt's last block boundary before its last token (where a repeated prompt, or a
//!   longer one that starts with it, resumes) is saved: the chunk that would cross it stops
//!   there, so the state is exact at it;
//! - while a sequence decodes, the state at each block boundary it reaches is saved in place
//!   of its previous decode boundary, so the latest one outlives the sequence (where the next
//!   turn of a chat, whose prompt is this one's prompt and answer, resumes) without one
//!   sequence's long answer flushing everyone else's saved prompts;
//! - saved states live in the backend's snapshot slots, found by the hash of the prefix's
//!   last block ([`BlockHash`] chains over every token before it, so equal hashes mean equal
//!   prefixes); when every slot is taken the least recently used is evicted;
//! - a sequence resumes at the longest cached prefix whose last boundary has a saved state,
//!   after the engine copies that state into the sequence's own slot before the step.
//!
//! A saved state whose blocks were evicted is never resumed (the blocks are matched first);
//! blocks without a saved state are resumed only up to the last boundary that has one.

use std::collections::HashMap;

use crate::kv_cache::BlockHash;

/// The saved states: which snapshot slot holds the state after which prefix.
#[derive(Debug)]
pub(crate) struct Snapshots {
    /// Snapshot slot ids free to take (ids as the backend numbers them, after the running
    /// slots).
    free: Vec<u32>,
    /// The saved states: slot and last use.
    saved: HashMap<BlockHash, (u32, u64)>,
    /// Advances with every use, for least-recently-used eviction.
    clock: u64,
}

impl Snapshots {
    /// `count` snapshot slots with ids `first..first + count`.
    pub fn new(first: u32, count: usize) -> Snapshots {
        Snapshots {
            free: (first..first + count as u32).rev().collect(),
            saved: HashMap::new(),
            clock: 0,
        }
    }

    /// Whether any state can be saved at all.
    pub fn enabled(&self) -> bool {
        !self.free.is_empty() || !self.saved.is_empty()
    }

    /// States saved now.
    pub fn len(&self) -> usize {
        self.saved.len()
    }

    pub fn contains(&self, h: BlockHash) -> bool {
        self.saved.contains_key(&h)
    }

    /// The slot holding the state after prefix `h`, counted as a use.
    pub fn take_use(&mut self, h: BlockHash) -> Option<u32> {
        self.clock += 1;
        let clock = self.clock;
        self.saved.get_mut(&h).map(|e| {
            e.1 = clock;
            e.0
        })
    }

    /// A slot to save the state after prefix `h` into, replacing the saved state `replaces`
    /// (the same sequence's previous decode boundary) if it is still saved, else a free
    /// slot, else the least recently used one's. `None` when `h` is saved already (it is
    /// then counted as a use) or there are no slots.
    pub fn save(&mut self, h: BlockHash, replaces: Option<BlockHash>) -> Option<u32> {
        if self.take_use(h).is_some() {
            return None;
        }
        let slot = match replaces.and_then(|r| self.saved.remove(&r)) {
            Some((slot, _)) => slot,
            None => match self.free.pop() {
                Some(slot) => slot,
                None => {
                    let (&oldest, _) = self.saved.iter().min_by_key(|(_, &(_, used))| used)?;
                    self.saved.remove(&oldest).expect("present").0
                }
            },
        };
        self.saved.insert(h, (slot, self.clock));
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn saved_states_are_found_and_the_least_recently_used_is_evicted() {
        let mut s = Snapshots::new(10, 2);
        assert!(s.enabled());
        let a = s.save(h(1), None).unwrap();
        let b = s.save(h(2), None).unwrap();
        assert_ne!(a, b);
        assert!([a, b].iter().all(|x| (10..12).contains(x)));
        // Saving what is saved is a use, not a copy.
        assert_eq!(s.save(h(1), None), None);
        // Full: the least recently used (2) goes.
        let c = s.save(h(3), None).unwrap();
        assert_eq!(c, b);
        assert!(s.contains(h(1)) && s.contains(h(3)) && !s.contains(h(2)));
        assert_eq!(s.take_use(h(3)), Some(b));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn a_decode_boundary_replaces_the_same_sequences_previous_one() {
        let mut s = Snapshots::new(0, 3);
        let prompt = s.save(h(1), None).unwrap();
        let first = s.save(h(2), None).unwrap();
        // The next boundary takes the previous one's slot, leaving the free one and the
        // prompt's state alone.
        assert_eq!(s.save(h(3), Some(h(2))), Some(first));
        assert!(!s.contains(h(2)) && s.contains(h(1)) && s.contains(h(3)));
        // A replaced state already evicted: a free slot.
        let other = s.save(h(4), Some(h(99))).unwrap();
        assert!(other != prompt && other != first);
    }

    #[test]
    fn no_slots_saves_nothing() {
        let mut s = Snapshots::new(4, 0);
        assert!(!s.enabled());
        assert_eq!(s.save(h(1), None), None);
        assert!(!s.contains(h(1)));
    }
}
