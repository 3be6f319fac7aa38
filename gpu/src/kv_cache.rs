//! The paged KV cache's bookkeeping: which block holds which tokens, who shares it, and which
//! full blocks can be found again by the hash of their contents (prefix caching).
//!
//! The backend owns the memory; this module hands out block ids. A block whose last user left
//! keeps its contents and its hash, so a later request with the same prefix finds it, until
//! an allocation needs the space: blocks are reused least-recently-freed first.

use std::collections::{BTreeMap, HashMap};

/// Index of a block in the backend's KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Hash of a full block's tokens chained with the hash of all blocks before it, so equal
/// hashes mean equal prefixes. Stable across processes: a router can compute the same values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl BlockHash {
    pub fn chain(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = mix(parent.map_or(0x6b76_6d65_7368_0001, |p| p.0));
        for &t in tokens {
            h = mix(h ^ (t as u64).wrapping_add(0x9e37_79b9_7f4a_7c15));
        }
        BlockHash(h)
    }
}

/// Hashes of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for chunk in tokens.chunks_exact(block_size) {
        let h = BlockHash::chain(parent, chunk);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[derive(Clone, Debug, Default)]
struct Block {
    refs: u32,
    hash: Option<BlockHash>,
    /// Position in the free order while `refs == 0`.
    freed_at: Option<u64>,
}

/// A change to which prefixes a worker's cache holds, for routers that route by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored(BlockHash),
    Removed(BlockHash),
}

pub struct BlockManager {
    /// Cache changes since the engine last took them.
    events: Vec<KvEvent>,
    block_size: usize,
    blocks: Vec<Block>,
    /// Unreferenced blocks, oldest first; cached ones among them still hold their contents.
    free: BTreeMap<u64, BlockId>,
    tick: u64,
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> BlockManager {
        let mut m = BlockManager {
            events: Vec::new(),
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free: BTreeMap::new(),
            tick: 0,
            cached: HashMap::new(),
        };
        for i in 0..num_blocks {
            m.push_free(BlockId(i as u32));
        }
        m
    }

    fn push_free(&mut self, b: BlockId) {
        self.tick += 1;
        self.free.insert(self.tick, b);
        self.blocks[b.0 as usize].freed_at = Some(self.tick);
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks an allocation can take now (free, including evictable cached ones).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Fraction of blocks in use by live sequences.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    /// Takes the least recently freed block, evicting its cached contents.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let (_, b) = self.free.pop_first()?;
        let blk = &mut self.blocks[b.0 as usize];
        blk.freed_at = None;
        blk.refs = 1;
        if let Some(h) = blk.hash.take() {
            if self.cached.get(&h) == Some(&b) {
                self.cached.remove(&h);
                self.events.push(KvEvent::Removed(h));
            }
        }
        Some(b)
    }

    /// The longest run of cached blocks matching `hashes` from the start; each is referenced.
    pub fn take_cached_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.cached.get(h) else { break };
            let blk = &mut self.blocks[b.0 as usize];
            if let Some(t) = blk.freed_at.take() {
                self.free.remove(&t);
            }
            blk.refs += 1;
            out.push(b);
        }
        out
    }

    /// How many leading blocks of `hashes` are cached, without taking them.
    pub fn cached_prefix_len(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Records that `b` is full and holds the prefix hashed as `h`.
    pub fn register(&mut self, b: BlockId, h: BlockHash) {
        let blk = &mut self.blocks[b.0 as usize];
        if blk.hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(h) {
            blk.hash = Some(h);
            e.insert(b);
            self.events.push(KvEvent::Stored(h));
        }
    }

    /// The prefixes stored and evicted since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Drops a sequence's blocks; the last blocks go first when space is needed again, so a
    /// shared prefix outlives the tails that hang off it.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let blk = &mut self.blocks[b.0 as usize];
            debug_assert!(blk.refs > 0, "double free of {b:?}");
            blk.refs = blk.refs.saturating_sub(1);
            if blk.refs == 0 {
                self.push_free(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_prefixes() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        let b = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 0], 4);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // Same block contents after a different prefix hash differently.
        let c = block_hashes(&[9, 9, 9, 9, 5, 6, 7, 8], 4);
        assert_ne!(a[1], c[1]);
    }

    #[test]
    fn freed_cached_blocks_are_found_then_evicted_oldest_first() {
        let mut m = BlockManager::new(3, 4);
        let hs = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b0 = m.allocate().unwrap();
        let b1 = m.allocate().unwrap();
        m.register(b0, hs[0]);
        m.register(b1, hs[1]);
        m.release(&[b0, b1]);
        assert_eq!(m.num_free(), 3);
        assert_eq!(m.usage(), 0.0);
        assert_eq!(m.cached_prefix_len(&hs), 2);
        let got = m.take_cached_prefix(&hs);
        assert_eq!(got, vec![b0, b1]);
        assert_eq!(m.num_free(), 1);
        m.release(&got);
        // The tail block was freed first, so it is evicted first; the head survives.
        let _ = m.allocate().unwrap();
        let _ = m.allocate().unwrap();
        assert_eq!(m.cached_prefix_len(&hs), 1);
        let _ = m.allocate().unwrap();
        assert_eq!(m.cached_prefix_len(&hs), 0);
        assert!(m.allocate().is_none());
    }

    #[test]
    fn stores_and_evictions_are_reported_in_order() {
        let mut m = BlockManager::new(3, 4);
        let hs = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let (a, b, c) = (
            m.allocate().unwrap(),
            m.allocate().unwrap(),
            m.allocate().unwrap(),
        );
        m.register(a, hs[0]);
        m.register(b, hs[1]);
        // Another block with an already cached prefix is not a new store.
        m.register(c, hs[0]);
        m.release(&[c]);
        m.release(&[a, b]);
        // The tail (b) was freed before the head (a), right after c.
        assert_eq!(m.allocate(), Some(c));
        assert_eq!(m.allocate(), Some(b));
        assert_eq!(
            m.take_events(),
            [
                KvEvent::Stored(hs[0]),
                KvEvent::Stored(hs[1]),
                KvEvent::Removed(hs[1])
            ]
        );
        assert!(m.take_events().is_empty());
    }

    #[test]
    fn shared_blocks_stay_until_the_last_user_leaves() {
        let mut m = BlockManager::new(2, 4);
        let hs = block_hashes(&[1, 2, 3, 4], 4);
        let b = m.allocate().unwrap();
        m.register(b, hs[0]);
        let again = m.take_cached_prefix(&hs);
        assert_eq!(again, vec![b]);
        m.release(&[b]);
        assert_eq!(m.num_free(), 1);
        m.release(&again);
        assert_eq!(m.num_free(), 2);
    }
}
