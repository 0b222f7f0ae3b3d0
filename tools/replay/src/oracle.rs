//! `oracle`: the best hit rates any placement could reach on a trace, computed
//! offline with the mock's own prompt hashing and prefix cache, so a replay's
//! measured `token_hit_rate` can be read against them:
//!
//! - the oracle is one unlimited cache shared by every request in arrival
//!   order: every distinct prefix is computed once, the upper bound for any
//!   routing over any number of ranks;
//! - the session oracle is one unlimited cache per routing key (a request
//!   without a key stands alone): what perfect key affinity can reach when
//!   nothing is shared across keys (e.g. a tenant's system prompt).

use std::collections::HashMap;

use mock_rank::cache::PrefixCache;
use mock_rank::prompt::prompt_blocks;
use serde_json::{json, Value};

use crate::trace::{self, BodyOptions, Request};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub trace: String,
    pub block_tokens: u32,
    pub blocks_as_chat: bool,
    pub model: String,
    pub limit: Option<usize>,
}

/// Token totals of the oracles.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Oracle {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub session_cached_tokens: u64,
    pub keys: u64,
}

/// Cached tokens for a match of `matched` leading blocks, as the mock counts
/// them: whole blocks, never more than the prompt.
fn cached(matched: usize, block_tokens: u32, prompt_tokens: u64) -> u64 {
    (matched as u64)
        .saturating_mul(u64::from(block_tokens))
        .min(prompt_tokens)
}

pub fn compute(
    requests: &[Request],
    block_tokens: u32,
    blocks_as_chat: bool,
    model: &str,
) -> Oracle {
    // The body `run` sends, minus `stream` and the key, which do not change
    // the prompt the mock hashes.
    let opts = BodyOptions {
        model: model.to_string(),
        block_tokens,
        stream: false,
        key_in_body: false,
        blocks_as_chat,
    };
    let mut shared = PrefixCache::new(0);
    let mut per_key: HashMap<&str, PrefixCache> = HashMap::new();
    let mut oracle = Oracle::default();
    for req in requests {
        let (path, body) = req.body(&opts);
        let blocks = prompt_blocks(path, &body, block_tokens);
        let tokens = blocks.prompt_tokens;
        oracle.requests += 1;
        oracle.prompt_tokens += tokens;
        oracle.cached_tokens += cached(shared.lookup_insert(&blocks.hashes), block_tokens, tokens);
        let session_matched = match &req.key {
            Some(key) => per_key
                .entry(key.as_str())
                .or_insert_with(|| PrefixCache::new(0))
                .lookup_insert(&blocks.hashes),
            None => PrefixCache::new(0).lookup_insert(&blocks.hashes),
        };
        oracle.session_cached_tokens += cached(session_matched, block_tokens, tokens);
    }
    oracle.keys = per_key.len() as u64;
    oracle
}

impl Oracle {
    pub fn to_json(self, block_tokens: u32) -> Value {
        let rate = |cached: u64| {
            (self.prompt_tokens > 0).then(|| cached as f64 / self.prompt_tokens as f64)
        };
        json!({
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "oracle_cached_tokens": self.cached_tokens,
            "oracle_hit_rate": rate(self.cached_tokens),
            "session_oracle_cached_tokens": self.session_cached_tokens,
            "session_oracle_hit_rate": rate(self.session_cached_tokens),
            "keys": self.keys,
            "block_tokens": block_tokens,
        })
    }
}

/// The `oracle` subcommand: JSON on stdout.
pub fn main(cfg: &Config) -> Result<(), String> {
    let mut requests = trace::read_file(&cfg.trace)?;
    if let Some(limit) = cfg.limit {
        requests.truncate(limit);
    }
    let oracle = compute(&requests, cfg.block_tokens, cfg.blocks_as_chat, &cfg.model);
    let text = serde_json::to_string_pretty(&oracle.to_json(cfg.block_tokens))
        .map_err(|e| format!("cannot encode the result: {e}"))?;
    crate::print_stdout(&text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;

    fn parse(lines: &[&str]) -> Vec<Request> {
        trace::read(lines.join("\n").as_bytes()).expect("trace")
    }

    #[test]
    fn shared_prefixes_are_counted_once() {
        // 4-token blocks: ids [1,2] then [1,2,3] under another key, then [1,2,3,4]
        // under the first key, then a keyless [1].
        let reqs = parse(&[
            r#"{"t_ms": 0, "key": "a", "blocks": [1, 2]}"#,
            r#"{"t_ms": 1, "key": "b", "blocks": [1, 2, 3]}"#,
            r#"{"t_ms": 2, "key": "a", "blocks": [1, 2, 3, 4]}"#,
            r#"{"t_ms": 3, "blocks": [1]}"#,
        ]);
        let o = compute(&reqs, 4, false, "m");
        assert_eq!(o.requests, 4);
        assert_eq!(o.prompt_tokens, 4 * (2 + 3 + 4 + 1));
        // Shared cache: 0 + 2 + 3 + 1 blocks.
        assert_eq!(o.cached_tokens, 4 * 6);
        // Per key: a gets 2 blocks on its second request; b and the keyless none.
        assert_eq!(o.session_cached_tokens, 4 * 2);
        assert_eq!(o.keys, 2);
        let json = o.to_json(4);
        assert_eq!(json["oracle_hit_rate"], 24.0 / 40.0);
        assert_eq!(json["session_oracle_hit_rate"], 8.0 / 40.0);
    }

    #[test]
    fn input_length_cut_loses_the_partial_block() {
        // 7 tokens of two 4-token blocks: only the first block is whole.
        let reqs = parse(&[
            r#"{"t_ms": 0, "hash_ids": [1, 2], "input_length": 7}"#,
            r#"{"t_ms": 1, "hash_ids": [1, 2], "input_length": 7}"#,
        ]);
        let o = compute(&reqs, 4, false, "m");
        assert_eq!(o.prompt_tokens, 14);
        assert_eq!(o.cached_tokens, 4);
    }

    #[test]
    fn synthetic_sessions_hit_their_history() {
        let cfg = synth::Config {
            sessions: 20,
            system_tokens: 64,
            ..synth::Config::default()
        };
        let mut out = Vec::new();
        synth::generate(&cfg).write(&mut out).expect("write");
        let reqs = trace::read(out.as_slice()).expect("trace");
        let o = compute(&reqs, 16, false, "mock-model");
        assert!(
            o.session_cached_tokens > 0,
            "later turns reuse earlier ones"
        );
        // Sharing across sessions adds the tenants' system prompts.
        assert!(o.cached_tokens > o.session_cached_tokens, "{o:?}");
        assert!(o.cached_tokens < o.prompt_tokens);
    }
}
