//! The configuration sections that modules below the configuration parser are built from: the
//! affinity table's geometry ([`TableConfig`], the prefix index's too), prefix placement
//! ([`PrefixConfig`], with its defaults and range checks) and the error a section's checks report
//! ([`ConfigError`]). Plain data that depends on nothing else in the crate, so the
//! modules that take a section never import `config` (the JSON reader and validator), and `config`
//! depends on this module, never the reverse.

use std::fmt;

#[derive(Debug, Clone)]
pub struct TableConfig {
    pub buckets: u32,
    pub ways: u32,
    pub ttl_seconds: u32,
    pub refresh_seconds: u32,
    pub cas_retries: u32,
    pub namespace: String,
}

/// A configuration error naming the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid plugin configuration: {}: {}",
            self.field, self.message
        )
    }
}

impl std::error::Error for ConfigError {}

// ---------------------------------------------------------------------------------------------
// Prefix placement
// ---------------------------------------------------------------------------------------------

/// Largest accepted `max_blocks`: 4096 blocks of 512 bytes is 2 MiB of prompt.
pub const MAX_BLOCKS_LIMIT: u32 = 4096;
/// Largest accepted `block_bytes`.
pub const MAX_BLOCK_BYTES: u32 = 1 << 16;
/// Largest accepted `shared_slack` (a knob with no effect, still range-checked so that old
/// configurations load exactly as before).
pub const MAX_SHARED_SLACK: u32 = 1 << 16;

/// Largest accepted `block_tokens`.
pub const MAX_BLOCK_TOKENS: u32 = 1 << 14;

/// Prefix placement settings. Defaults are written once, in `Default`.
#[derive(Debug, Clone)]
pub struct PrefixConfig {
    /// Whether the filter looks at prompt prefixes at all.
    pub enabled: bool,
    /// Block size of text prompts, in bytes of (raw JSON) prompt text.
    pub block_bytes: u32,
    /// Block size of token-id prompts, in ids.
    pub block_tokens: u32,
    /// Only the first `max_blocks` blocks are hashed and indexed.
    pub max_blocks: u32,
    /// A match shorter than this many blocks does not count (no position below it is indexed).
    pub min_match_blocks: u32,
    /// A match at least this deep keeps its rank under the looser bound of a pinned key
    /// (`assign.pinned_load_factor`); shallower matches get the bound of a new key.
    pub sticky_blocks: u32,
    /// No effect: accepted (and range-checked) so configurations written for the rule it tuned
    /// still load; `load_blocks` and `home_blocks` weigh shared prefixes now.
    pub shared_slack: u32,
    /// Prompt blocks one more request in flight on a rank is worth, when a match there is weighed
    /// against the request's home (`assign.mode` other than `envoy`).
    pub load_blocks: u32,
    /// Prompt blocks going home is worth by itself: the home is where every replica sends the
    /// conversation's later turns.
    pub home_blocks: u32,
    /// Indexed positions have at most this many significant bits (see the `prefix_index` module
    /// doc): more bits, more precise matches, more entries written per chain and one more read
    /// per search.
    pub grid_bits: u32,
    /// The index's geometry and timing.
    pub table: TableConfig,
}

impl Default for PrefixConfig {
    /// - 512-byte blocks (~128 tokens of English) / 64-token blocks: fine enough that a shared
    ///   system prompt of a few KiB is matched, coarse enough that 64 KiB is only 128 blocks.
    /// - `max_blocks` 512 (256 KiB, ~64k tokens): prompts that agree on every hashed block look
    ///   like one conversation, so the hashed part must reach past the longest prefix that
    ///   different conversations share. An agent's instructions and tool definitions are tens of
    ///   KiB: with 128 blocks (64 KiB) every session of an agent behind a 96 KiB prompt matched
    ///   the first session's "history" and followed it to one rank (`scripts/bench-affinity.py
    ///   --suite kv`, agent workload: 3.06 × the mean load there, against 1.04 with 512). The
    ///   rest of a longer body is walked anyway; hashing it too costs ~25 % more walk time.
    /// - `min_match_blocks` 1: every full block is ~128 tokens of prefill saved, and what keeps a
    ///   popular shared prefix from piling requests onto one rank is the load bound applied to
    ///   the matched rank, not this threshold; a higher one would mostly delay the stickiness of
    ///   short keyless conversations by a turn.
    /// - `sticky_blocks` 1: every match that is not on a branched position (a shared prefix, see
    ///   the `prefix_index` module doc) is taken for a conversation's own history, whose loss
    ///   costs its whole prefill: it stays like a key's pin, until the looser pinned bound.
    ///   Shared prefixes are told apart by the branched flag, not by depth; a higher value makes
    ///   shallow matches yield at the new-key bound too (for deployments whose conversations are
    ///   known to be long and whose short prefixes are all shared).
    /// - `load_blocks` 2, `home_blocks` 8 (see `placement::prefix_choice_at`): chosen on the
    ///   KV-cache-trace benchmark at 80 % load (`scripts/bench-affinity.py --suite kv`): with 8
    ///   per request in flight keyless conversations left their cached history over the load
    ///   differences a busy cluster always has (4 ranks: 0.95 × oracle, TTFB p90 745 ms); with 2,
    ///   0.99 × and 713 ms; with 0 no load difference could ever move a shared document. A
    ///   conversation's own history then stays until the pinned bound, and a shared system prompt
    ///   of 8 blocks (4 KiB) or less never pulls a new conversation away from its home.
    /// - Index: 65,536 buckets × 16 ways (16 MiB, the affinity table's geometry): a bucket read
    ///   copies 256 bytes, and 16 ways keep the per-bucket LRU close to a global one. At most 18
    ///   entries per chain: room for ~58,000 long prompts, more short ones.
    fn default() -> Self {
        PrefixConfig {
            enabled: true,
            block_bytes: 512,
            block_tokens: 64,
            max_blocks: 512,
            min_match_blocks: 1,
            sticky_blocks: 1,
            shared_slack: 0,
            load_blocks: 2,
            home_blocks: 8,
            grid_bits: 2,
            table: TableConfig {
                buckets: 65_536,
                ways: 16,
                ttl_seconds: 3600,
                refresh_seconds: 1,
                cas_retries: 8,
                namespace: "dp_affinity_prefix".into(),
            },
        }
    }
}

impl PrefixConfig {
    /// Checks the prefix-specific fields (`table` is checked like the affinity table's).
    /// The code never panics on values outside these ranges; it clamps them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, message: &str| {
            Err(ConfigError {
                field: format!("prefix.{field}"),
                message: message.into(),
            })
        };
        if !(16..=MAX_BLOCK_BYTES).contains(&self.block_bytes) {
            return bad("block_bytes", "must be in 16..=65536");
        }
        if !(1..=MAX_BLOCK_TOKENS).contains(&self.block_tokens) {
            return bad("block_tokens", "must be in 1..=16384");
        }
        if !(1..=MAX_BLOCKS_LIMIT).contains(&self.max_blocks) {
            return bad("max_blocks", "must be in 1..=4096");
        }
        if !(1..=self.max_blocks).contains(&self.min_match_blocks) {
            return bad("min_match_blocks", "must be in 1..=max_blocks");
        }
        if !(1..=MAX_BLOCKS_LIMIT).contains(&self.sticky_blocks) {
            return bad("sticky_blocks", "must be in 1..=4096");
        }
        if self.shared_slack > MAX_SHARED_SLACK {
            return bad("shared_slack", "must be in 0..=65536");
        }
        if self.load_blocks > MAX_BLOCKS_LIMIT {
            return bad("load_blocks", "must be in 0..=4096");
        }
        if self.home_blocks > MAX_BLOCKS_LIMIT {
            return bad("home_blocks", "must be in 0..=4096");
        }
        if !(1..=8).contains(&self.grid_bits) {
            return bad("grid_bits", "must be in 1..=8");
        }
        Ok(())
    }

    pub(crate) fn max_blocks(&self) -> usize {
        self.max_blocks.min(MAX_BLOCKS_LIMIT) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_config_defaults_and_validation() {
        let d = PrefixConfig::default();
        assert!(d.enabled);
        assert_eq!(
            (
                d.block_bytes,
                d.block_tokens,
                d.max_blocks,
                d.min_match_blocks
            ),
            (512, 64, 512, 1)
        );
        assert_eq!(d.table.namespace, "dp_affinity_prefix");
        assert!(d.validate().is_ok());
        for (bad, field) in [
            (
                PrefixConfig {
                    block_bytes: 8,
                    ..d.clone()
                },
                "prefix.block_bytes",
            ),
            (
                PrefixConfig {
                    block_tokens: 0,
                    ..d.clone()
                },
                "prefix.block_tokens",
            ),
            (
                PrefixConfig {
                    max_blocks: 5000,
                    ..d.clone()
                },
                "prefix.max_blocks",
            ),
            (
                PrefixConfig {
                    min_match_blocks: 513,
                    ..d.clone()
                },
                "prefix.min_match_blocks",
            ),
            (
                PrefixConfig {
                    grid_bits: 0,
                    ..d.clone()
                },
                "prefix.grid_bits",
            ),
        ] {
            assert_eq!(bad.validate().unwrap_err().field, field);
        }
    }
}
