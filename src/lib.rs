//! dp-affinity: an Envoy HTTP filter (proxy-wasm) that routes LLM inference requests to
//! data-parallel ranks with prefix-cache affinity.
//!
//! The routing core (`config`, `extract`, `json_scan`, `decide`, `table`, `hash`, `metrics`) is
//! plain Rust, tested natively. Only `host` touches the proxy-wasm SDK, and it is compiled for the
//! wasm target alone.

pub mod assign;
pub mod chain;
pub mod config;
pub mod config_sections;
pub mod decide;
pub mod extract;
pub mod failure;
pub mod hash;
pub mod json_scan;
pub mod metrics;
pub mod prefix_index;
pub mod prompt;
pub mod ranks;
pub mod table;

#[cfg(target_arch = "wasm32")]
mod host;

#[cfg(test)]
mod module_graph;
