//! The state of one simulated (possibly internal) rank: its counters, its
//! prefix cache and its concurrency slots. In engine mode every internal rank
//! has its own, as every DP rank of a real engine has its own KV cache and
//! scheduler.

use std::sync::{Mutex, MutexGuard, PoisonError};

use mock_rank::cache::PrefixCache;
use mock_rank::prompt::PromptBlocks;

use crate::slots::Slots;
use crate::stats::RankStats;

#[derive(Debug)]
pub struct RankState {
    pub stats: RankStats,
    pub slots: Slots,
    cache: Mutex<PrefixCache>,
}

/// The prefix cache's gauges for GET /mock/stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSnapshot {
    pub blocks: usize,
    /// 0 = unlimited.
    pub capacity: usize,
    pub evictions: u64,
}

impl RankState {
    pub fn new(cache_blocks: usize, max_concurrency: usize) -> Self {
        RankState {
            stats: RankStats::default(),
            slots: Slots::new(max_concurrency),
            cache: Mutex::new(PrefixCache::new(cache_blocks)),
        }
    }

    /// Prompt tokens of `prompt` already in this rank's cache, which then
    /// holds (and has refreshed) every full block of it. A partial last block
    /// is never cached, so a prompt is never entirely cached unless it ends on
    /// a block boundary.
    pub fn cached_tokens(&self, prompt: &PromptBlocks, block_tokens: u32) -> u64 {
        let matched = self.cache().lookup_insert(&prompt.hashes) as u64;
        matched
            .saturating_mul(u64::from(block_tokens))
            .min(prompt.prompt_tokens)
    }

    pub fn cache_snapshot(&self) -> CacheSnapshot {
        let cache = self.cache();
        CacheSnapshot {
            blocks: cache.len(),
            capacity: cache.capacity(),
            evictions: cache.evictions(),
        }
    }

    /// Zeroes the counters and empties the cache (POST /mock/reset-stats).
    pub fn reset(&self) {
        self.stats.reset();
        self.cache().clear();
    }

    /// The cache stays consistent even if a holder panicked (each call is
    /// one `PrefixCache` method), so a poisoned lock is still usable.
    fn cache(&self) -> MutexGuard<'_, PrefixCache> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(prompt_tokens: u64, hashes: &[u64]) -> PromptBlocks {
        PromptBlocks {
            prompt_tokens,
            hashes: hashes.to_vec(),
        }
    }

    #[test]
    fn cached_tokens_count_whole_matched_blocks() {
        let rank = RankState::new(0, 0);
        assert_eq!(rank.cached_tokens(&prompt(40, &[1, 2]), 16), 0);
        assert_eq!(rank.cached_tokens(&prompt(40, &[1, 2]), 16), 32);
        assert_eq!(rank.cached_tokens(&prompt(70, &[1, 2, 3, 4]), 16), 32);
        assert_eq!(rank.cached_tokens(&prompt(64, &[1, 2, 3, 4]), 16), 64);
        assert_eq!(rank.cached_tokens(&prompt(0, &[]), 16), 0);
        assert_eq!(
            rank.cache_snapshot(),
            CacheSnapshot {
                blocks: 4,
                capacity: 0,
                evictions: 0
            }
        );
    }

    #[test]
    fn reset_empties_the_cache() {
        let rank = RankState::new(1, 0);
        rank.cached_tokens(&prompt(16, &[1]), 16);
        rank.cached_tokens(&prompt(16, &[2]), 16);
        rank.stats.record_service(16, 0, 0);
        assert_eq!(rank.cache_snapshot().evictions, 1);
        rank.reset();
        assert_eq!(
            rank.cache_snapshot(),
            CacheSnapshot {
                blocks: 0,
                capacity: 1,
                evictions: 0
            }
        );
        assert_eq!(rank.stats.snapshot().prompt_tokens, 0);
        assert_eq!(rank.cached_tokens(&prompt(16, &[2]), 16), 0);
    }
}
