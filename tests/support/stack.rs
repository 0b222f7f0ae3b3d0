//! One test's world: N mock ranks, an Envoy in front of them (with or without the
//! filter), a scratch directory, and helpers to read the filter's counters.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde_json::Value;

use super::counters::{self, Counters};
use super::envoy::{Envoy, EnvoyConfig, Topology, DEFAULT_BUFFER_LIMIT_BYTES};
use super::http::{Request, Response};
use super::mock::MockRank;
use super::paths;
use super::tempdir::TestDir;

#[derive(Clone, Debug)]
pub struct StackOptions {
    /// Plugin configuration; its `dp_size` is also the number of mock ranks.
    pub plugin_config: Value,
    pub mock_args: Vec<String>,
    /// `false` runs the topology without the filter (harness self-tests).
    pub with_filter: bool,
    pub allow_on_headers_stop_iteration: bool,
    pub fallback_retries: bool,
    /// Overrides the routes' `per_try_idle_timeout` (e.g. "2s" for a hung-rank test).
    pub upstream_idle_timeout: Option<String>,
    /// Overrides the routes' `timeout` ("0s" as shipped).
    pub route_timeout: Option<String>,
    /// Another filter build than the shipped one (`None`: `paths::wasm_path()`).
    pub wasm: Option<std::path::PathBuf>,
    /// Extra arguments for one rank only (after `mock_args`), e.g. a slow rank.
    pub rank_args: BTreeMap<u32, Vec<String>>,
    /// One engine-mode mock with `dp_size` internal ranks behind a single cluster
    /// (`Topology::SingleEngine`) instead of one mock per rank.
    pub engine: bool,
    /// The listener's `per_connection_buffer_limit_bytes`.
    pub buffer_limit_bytes: u32,
    /// The connection manager's `max_request_headers_kb` (`None`: Envoy's default).
    pub max_request_headers_kb: Option<u32>,
    /// Let HTTP/1 requests carry trailers to the filter (`EnvoyConfig::http1_trailers`).
    pub http1_trailers: bool,
    /// The per-rank clusters' circuit breaker (`EnvoyConfig::rank_max_requests`).
    pub rank_max_requests: Option<u32>,
    /// Envoy's level for the `wasm` logger at start (`EnvoyConfig::wasm_log_level`).
    pub wasm_log_level: &'static str,
}

impl StackOptions {
    pub fn new(plugin_config: Value) -> StackOptions {
        StackOptions {
            plugin_config,
            mock_args: Vec::new(),
            with_filter: true,
            allow_on_headers_stop_iteration: true,
            fallback_retries: true,
            upstream_idle_timeout: None,
            route_timeout: None,
            wasm: None,
            rank_args: BTreeMap::new(),
            engine: false,
            buffer_limit_bytes: DEFAULT_BUFFER_LIMIT_BYTES,
            max_request_headers_kb: None,
            http1_trailers: false,
            rank_max_requests: None,
            wasm_log_level: "debug",
        }
    }

    /// Starts Envoy with the `wasm` logger at `level` instead of `debug`.
    pub fn wasm_log_level(mut self, level: &'static str) -> StackOptions {
        self.wasm_log_level = level;
        self
    }

    /// Gives each rank's cluster a circuit breaker of `max` requests at once.
    pub fn rank_max_requests(mut self, max: u32) -> StackOptions {
        self.rank_max_requests = Some(max);
        self
    }

    /// Lets HTTP/1 requests carry trailers to the filter.
    pub fn http1_trailers(mut self) -> StackOptions {
        self.http1_trailers = true;
        self
    }

    /// Sets the listener's `per_connection_buffer_limit_bytes`.
    pub fn buffer_limit(mut self, bytes: u32) -> StackOptions {
        self.buffer_limit_bytes = bytes;
        self
    }

    /// Sets the connection manager's `max_request_headers_kb`.
    pub fn max_request_headers_kb(mut self, kb: u32) -> StackOptions {
        self.max_request_headers_kb = Some(kb);
        self
    }

    pub fn rank_args(mut self, rank: u32, args: &[&str]) -> StackOptions {
        self.rank_args
            .entry(rank)
            .or_default()
            .extend(args.iter().map(|s| s.to_string()));
        self
    }

    pub fn engine(mut self) -> StackOptions {
        self.engine = true;
        self
    }

    pub fn mock_args(mut self, args: &[&str]) -> StackOptions {
        self.mock_args = args.iter().map(|s| s.to_string()).collect();
        self
    }

    pub fn without_filter(mut self) -> StackOptions {
        self.with_filter = false;
        self
    }

    /// Loads another build of the filter (e.g. `paths::fault_wasm_path()`).
    pub fn wasm(mut self, path: std::path::PathBuf) -> StackOptions {
        self.wasm = Some(path);
        self
    }

    pub fn upstream_idle_timeout(mut self, timeout: &str) -> StackOptions {
        self.upstream_idle_timeout = Some(timeout.to_string());
        self
    }

    pub fn route_timeout(mut self, timeout: &str) -> StackOptions {
        self.route_timeout = Some(timeout.to_string());
        self
    }

    pub fn fallback_retries(mut self) -> StackOptions {
        self.fallback_retries = true;
        self
    }

    fn dp_size(&self) -> u32 {
        self.plugin_config["dp_size"]
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .expect("plugin_config.dp_size must be a small integer")
    }
}

/// Field order is drop order: Envoy first (prints its log if the test failed),
/// then the mocks, then the directory holding their logs.
pub struct Stack {
    pub envoy: Envoy,
    pub mocks: Vec<MockRank>,
    pub dir: TestDir,
    name: String,
    /// What `envoy` runs, kept to start replicas of it.
    envoy_config: EnvoyConfig,
    replicas: u32,
}

impl Stack {
    pub fn start(name: &str, options: StackOptions) -> Stack {
        let dir = TestDir::new(name);
        let mocks: Vec<MockRank> = if options.engine {
            let args: Vec<&str> = options.mock_args.iter().map(String::as_str).collect();
            vec![MockRank::start_engine(options.dp_size(), &args, dir.path())]
        } else {
            (0..options.dp_size())
                .map(|rank| {
                    let args: Vec<&str> = options
                        .mock_args
                        .iter()
                        .chain(options.rank_args.get(&rank).into_iter().flatten())
                        .map(String::as_str)
                        .collect();
                    MockRank::start(rank, &args, dir.path())
                })
                .collect()
        };
        let mut config = EnvoyConfig::new(
            mocks.iter().map(MockRank::port).collect(),
            options
                .with_filter
                .then(|| options.wasm.clone().unwrap_or_else(paths::wasm_path)),
            options.plugin_config.clone(),
        );
        config.allow_on_headers_stop_iteration = options.allow_on_headers_stop_iteration;
        config.fallback_retries = options.fallback_retries;
        if let Some(timeout) = &options.upstream_idle_timeout {
            config.upstream_idle_timeout = timeout.clone();
        }
        if let Some(timeout) = &options.route_timeout {
            config.route_timeout = timeout.clone();
        }
        config.access_log = Some(dir.join("access.log"));
        config.buffer_limit_bytes = options.buffer_limit_bytes;
        config.max_request_headers_kb = options.max_request_headers_kb;
        config.http1_trailers = options.http1_trailers;
        config.rank_max_requests = options.rank_max_requests;
        config.wasm_log_level = options.wasm_log_level;
        if options.engine {
            config.topology = Topology::SingleEngine;
        }
        let envoy = Envoy::start(&config, dir.path());
        Stack {
            envoy,
            mocks,
            dir,
            name: name.to_string(),
            envoy_config: config,
            replicas: 0,
        }
    }

    /// Starts another Envoy with the same configuration in front of the same
    /// mocks: a second proxy replica, with its own process and so its own shared
    /// data (affinity table and rank loads). Drop it before the stack.
    pub fn replica(&mut self) -> Envoy {
        self.replicas += 1;
        let dir = self.dir.join(&format!("replica-{}", self.replicas));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        let mut config = self.envoy_config.clone();
        config.access_log = Some(dir.join("access.log"));
        Envoy::start(&config, &dir)
    }

    pub fn addr(&self) -> SocketAddr {
        self.envoy.listen_addr()
    }

    /// One request on a fresh connection (spread over Envoy's workers).
    pub fn send(&self, request: &Request) -> Response {
        self.envoy.send(request)
    }

    /// All of the filter's metrics, by their full Envoy name.
    pub fn metrics(&self) -> BTreeMap<String, u64> {
        self.envoy.stats("dp_affinity")
    }

    /// The filter counter `name` (e.g. "affinity_hit") as flushed so far: it may lag the
    /// requests by a flush. Panics if Envoy does not show that counter.
    pub fn counter(&self, name: &str) -> u64 {
        counters::counter_of(&self.envoy, name)
    }

    /// The filter's counters once every VM has flushed after this call (see
    /// [`Envoy::settled_counters`]): what zeros and unchanged values are asserted on.
    pub fn settled(&self) -> Counters {
        self.envoy.settled_counters()
    }

    /// Polls until counter `name` is exactly `expected` (> 0; zeros go through [`Stack::settled`]).
    pub fn assert_counter(&self, name: &str, expected: u64) {
        counters::assert_counter_of(&self.envoy, name, expected);
    }

    pub fn assert_counter_at_least(&self, name: &str, minimum: u64) {
        counters::assert_counter_at_least_of(&self.envoy, name, minimum);
    }

    pub fn mock(&mut self, rank: u32) -> &mut MockRank {
        &mut self.mocks[rank as usize]
    }
}

impl Drop for Stack {
    /// Leaves the final counters in the test's output (shown with `--nocapture`
    /// or on failure) as evidence of what the filter decided.
    fn drop(&mut self) {
        if std::thread::panicking() || !self.envoy.admin_reachable() {
            return;
        }
        let nonzero: Vec<String> = self
            .metrics()
            .into_iter()
            .filter(|(_, value)| *value > 0)
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        eprintln!("[{}] filter counters: {}", self.name, nonzero.join(" "));
    }
}

/// The rank that served a successful mock response. Checks that the echoed
/// `x-dp-rank` header and the mock's own `mock.rank` agree.
pub fn served_rank(response: &Response) -> u32 {
    assert_eq!(
        response.status,
        200,
        "expected 200, got {} with headers {:?} body {:?}",
        response.status,
        response.headers,
        response.text()
    );
    let header = echoed_rank(response);
    let body_rank = mock_info(response)["rank"]
        .as_u64()
        .unwrap_or_else(|| panic!("mock.rank missing: {}", response.text()));
    assert_eq!(
        u64::from(header),
        body_rank,
        "x-dp-rank header disagrees with the rank that answered"
    );
    header
}

/// The `x-dp-rank` response header as a number (must be present exactly once:
/// the filter's echo must not duplicate the upstream's header).
pub fn echoed_rank(response: &Response) -> u32 {
    let values = response.header_all("x-dp-rank");
    assert_eq!(
        values.len(),
        1,
        "expected exactly one x-dp-rank header, got {values:?} (headers {:?})",
        response.headers
    );
    values[0]
        .parse()
        .unwrap_or_else(|e| panic!("x-dp-rank {:?} is not a rank: {e}", values[0]))
}

/// The mock's self-description (`mock` object of its JSON answer).
pub fn mock_info(response: &Response) -> Value {
    let body = response.json();
    assert!(
        body["mock"].is_object(),
        "response has no `mock` object: {body}"
    );
    body["mock"].clone()
}

/// The request headers the mock received (lower-cased names).
pub fn upstream_headers(response: &Response) -> serde_json::Map<String, Value> {
    mock_info(response)["headers"]
        .as_object()
        .cloned()
        .unwrap_or_else(|| panic!("mock.headers missing: {}", response.text()))
}
