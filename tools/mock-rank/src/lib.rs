//! mock-rank's engine model, shared with the load generator (`tools/replay`)
//! so both sides count prompt tokens and cached blocks the same way:
//!
//! - `prompt`: a request's prompt tokens and chained KV-block hashes;
//! - `cache`: the per-rank LRU prefix cache over those hashes;
//! - `fnv`: the FNV-1a 64 hash both use.
//!
//! The HTTP server itself is the `mock-rank` binary (src/main.rs).

pub mod cache;
pub mod fnv;
pub mod prompt;
