//! A per-rank prefix (KV) cache over chained block hashes (see `prompt`),
//! evicting least-recently-used blocks like vLLM's block pool or SGLang's
//! radix cache.
//!
//! A request touches its chain from the last block to the first, so every
//! block is at least as recent as the blocks after it: eviction then takes
//! leaves before the prefixes other requests still share, and a chain longer
//! than the capacity keeps its first blocks, the ones a later turn can reuse.

use std::collections::{BTreeMap, HashMap};

/// An LRU prefix cache over chained block hashes, `capacity_blocks` = 0 means
/// unlimited.
#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    capacity: usize,
    /// Block hash → stamp of its last use.
    stamps: HashMap<u64, u64>,
    /// Stamp of last use → block hash; the first entry is the LRU block.
    by_age: BTreeMap<u64, u64>,
    next_stamp: u64,
    evictions: u64,
}

impl PrefixCache {
    pub fn new(capacity_blocks: usize) -> Self {
        PrefixCache {
            capacity: capacity_blocks,
            ..PrefixCache::default()
        }
    }

    /// Longest prefix of `hashes` present (count of leading blocks found),
    /// then inserts/touches all of `hashes`, evicting least-recently-used
    /// blocks beyond capacity. Returns the matched count.
    pub fn lookup_insert(&mut self, hashes: &[u64]) -> usize {
        let matched = hashes
            .iter()
            .take_while(|h| self.stamps.contains_key(h))
            .count();
        // Blocks past the capacity would be evicted by this very insert (they
        // are the chain's least recent): they are never cached at all.
        let kept = match self.capacity {
            0 => hashes,
            cap => &hashes[..hashes.len().min(cap)],
        };
        for &hash in kept.iter().rev() {
            self.touch(hash);
        }
        self.evict_over_capacity();
        matched
    }

    /// Blocks cached now.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// Blocks evicted since creation or the last `clear`.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The capacity in blocks, 0 for unlimited.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Empties the cache and zeroes the eviction count, keeping the capacity.
    pub fn clear(&mut self) {
        *self = PrefixCache::new(self.capacity);
    }

    /// Makes `hash` the most recently used block, inserting it if absent.
    fn touch(&mut self, hash: u64) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(old) = self.stamps.insert(hash, stamp) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(stamp, hash);
    }

    fn evict_over_capacity(&mut self) {
        if self.capacity == 0 {
            return;
        }
        while self.stamps.len() > self.capacity {
            let Some((_, hash)) = self.by_age.pop_first() else {
                return;
            };
            self.stamps.remove(&hash);
            self.evictions += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks present, in the order given.
    fn present(cache: &PrefixCache, hashes: &[u64]) -> Vec<u64> {
        hashes
            .iter()
            .copied()
            .filter(|h| cache.stamps.contains_key(h))
            .collect()
    }

    #[test]
    fn matches_the_leading_blocks_only() {
        let mut cache = PrefixCache::new(0);
        assert_eq!(cache.lookup_insert(&[1, 2, 3]), 0);
        assert_eq!(cache.lookup_insert(&[1, 2, 3]), 3);
        assert_eq!(cache.lookup_insert(&[1, 2, 9, 3]), 2);
        assert_eq!(
            cache.lookup_insert(&[7, 1, 2]),
            0,
            "a prefix, not any block"
        );
        assert_eq!(cache.lookup_insert(&[]), 0);
        assert_eq!(cache.len(), 5);
    }

    #[test]
    fn evicts_least_recently_used() {
        let mut cache = PrefixCache::new(3);
        cache.lookup_insert(&[1]);
        cache.lookup_insert(&[2]);
        cache.lookup_insert(&[3]);
        cache.lookup_insert(&[1]); // 2 is now the oldest
        cache.lookup_insert(&[4]);
        assert_eq!(present(&cache, &[1, 2, 3, 4]), [1, 3, 4]);
        assert_eq!(cache.evictions(), 1);
        assert_eq!(cache.lookup_insert(&[2]), 0, "evicted");
        assert_eq!(present(&cache, &[1, 2, 3, 4]), [1, 2, 4]);
    }

    #[test]
    fn leaves_go_before_their_prefix() {
        let mut cache = PrefixCache::new(4);
        // One conversation: a shared root and two branches.
        cache.lookup_insert(&[10, 11, 12]);
        cache.lookup_insert(&[10, 21]);
        // Two new blocks: the oldest leaves (12, then 11) go, root 10 stays.
        cache.lookup_insert(&[30, 31]);
        assert_eq!(present(&cache, &[10, 11, 12, 21, 30, 31]), [10, 21, 30, 31]);
        assert_eq!(cache.lookup_insert(&[10, 11]), 1);
    }

    #[test]
    fn long_chain_keeps_its_first_blocks() {
        let mut cache = PrefixCache::new(3);
        cache.lookup_insert(&[1, 2]);
        assert_eq!(cache.lookup_insert(&[5, 6, 7, 8, 9]), 0);
        assert_eq!(present(&cache, &[1, 2, 5, 6, 7, 8, 9]), [5, 6, 7]);
        assert_eq!(cache.len(), 3);
        // Only cached blocks that were pushed out count as evictions.
        assert_eq!(cache.evictions(), 2);
        assert_eq!(cache.lookup_insert(&[5, 6, 7, 8, 9]), 3);
    }

    #[test]
    fn capacity_is_never_exceeded() {
        let mut cache = PrefixCache::new(16);
        for i in 0..200u64 {
            let chain: Vec<u64> = (0..i % 23).map(|j| i * 1000 + j).collect();
            cache.lookup_insert(&chain);
            assert!(cache.len() <= 16);
            assert_eq!(cache.by_age.len(), cache.len());
        }
        assert!(cache.evictions() > 0);
    }

    #[test]
    fn unlimited_keeps_everything() {
        let mut cache = PrefixCache::new(0);
        let chain: Vec<u64> = (0..10_000).collect();
        assert_eq!(cache.lookup_insert(&chain), 0);
        assert_eq!(cache.lookup_insert(&chain), 10_000);
        assert_eq!((cache.len(), cache.evictions()), (10_000, 0));
    }

    #[test]
    fn repeated_hash_in_a_chain_is_one_block() {
        let mut cache = PrefixCache::new(3);
        cache.lookup_insert(&[1, 1, 2]);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.by_age.len(), 2);
    }

    #[test]
    fn clear_empties_and_resets_evictions() {
        let mut cache = PrefixCache::new(1);
        cache.lookup_insert(&[1]);
        cache.lookup_insert(&[2]);
        assert_eq!((cache.len(), cache.evictions()), (1, 1));
        cache.clear();
        assert!(cache.is_empty());
        assert_eq!(cache.evictions(), 0);
        assert_eq!(cache.capacity(), 1);
        assert_eq!(cache.lookup_insert(&[2]), 0);
    }
}
