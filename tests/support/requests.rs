//! Building blocks shared by the scenario files: plugin configurations and the requests they send.

use serde_json::{json, Value};

use super::http::Request;

/// Ranks behind every test Envoy.
pub const DP_SIZE: u32 = 4;
pub const KEY_HEADER: &str = "x-smg-routing-key";
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// The learning filter — `{"dp_size": 4}` with `assign.mode: envoy` (Envoy balances new keys,
/// the filter learns their rank) and prefix placement off — deep-merged with `overrides`. Most
/// scenarios are about keys, pins and bad input, and read clearest against Envoy's balancer;
/// the ones about the shipped defaults (`hash`, prefix on) start from [`default_config`].
pub fn plugin_config(overrides: Value) -> Value {
    let mut config = json!({
        "dp_size": DP_SIZE,
        "assign": { "mode": "envoy" },
        "prefix": { "enabled": false },
    });
    merge(&mut config, overrides);
    config
}

/// The filter's own defaults (`{"dp_size": 4}` and nothing else) deep-merged with `overrides`.
pub fn default_config(overrides: Value) -> Value {
    let mut config = json!({ "dp_size": DP_SIZE });
    merge(&mut config, overrides);
    config
}

/// Deep-merges `overrides` into `base` (objects key by key, anything else replaced).
pub fn merge(base: &mut Value, overrides: Value) {
    match (base, overrides) {
        (Value::Object(base), Value::Object(overrides)) => {
            for (key, value) in overrides {
                merge(base.entry(key).or_insert(Value::Null), value);
            }
        }
        (base, overrides) => *base = overrides,
    }
}

/// A chat completion request; `extra` adds top-level body fields.
pub fn chat(extra: Value) -> Request {
    let mut body = json!({ "model": "mock", "messages": [{ "role": "user", "content": "hello" }] });
    merge(&mut body, extra);
    Request::post("/v1/chat/completions").json(&body)
}

/// A chat request carrying `key` in the routing-key header.
pub fn keyed(key: &str) -> Request {
    chat(json!({})).header(KEY_HEADER, key)
}
