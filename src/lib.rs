//! dp-affinity: an Envoy HTTP filter (proxy-wasm) that routes LLM inference requests to
//! data-parallel ranks with prefix-cache affinity.
//!
//! The routing core (every module but `host`) is plain Rust, tested natively. Only `host` touches
//! the proxy-wasm SDK, and it is compiled for the wasm target alone. The modules import each
//! other without a cycle (`module_graph`, a unit test, checks); README's repository layout lists
//! them in an order where each imports only those before it.

pub mod assign;
pub mod body_rewrite;
pub mod chain;
pub mod clock;
pub mod config;
pub mod config_sections;
pub mod decide;
pub mod extract;
pub mod failure;
pub mod hash;
pub mod json_scan;
pub mod metrics;
pub mod placement;
pub mod prefix_index;
pub mod prompt;
pub mod ranks;
pub mod table;
pub mod target;

#[cfg(target_arch = "wasm32")]
mod host;

#[cfg(test)]
mod module_graph;
