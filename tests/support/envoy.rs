//! A real Envoy child process running a generated config that follows the
//! topology in notes/interfaces.md, plus the `--mode validate` runner.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::http::{self, Request, Response};
use super::paths;

const READY_TIMEOUT: Duration = Duration::from_secs(20);
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);
/// Ports are picked by binding :0 and releasing them, so another process can take
/// one before Envoy binds it; a fresh pick on a failed start makes that harmless.
const START_ATTEMPTS: u32 = 3;
/// The filter chain and cluster names the routes refer to.
pub const CLUSTER_HEADER: &str = "x-dp-affinity-cluster";
pub const ALL_RANKS_CLUSTER: &str = "dp-all";
/// The only cluster of the single-engine topology.
pub const ENGINE_CLUSTER: &str = "engine";
/// Envoy's worker threads (`--concurrency`).
pub const CONCURRENCY: u32 = 2;
/// The filter's VMs in one Envoy: one per worker, plus the one on the main thread (it too runs
/// the tick that flushes counters).
pub const FILTER_VMS: u64 = CONCURRENCY as u64 + 1;

/// How the upstreams are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// One cluster per rank (`dp-rank-{r}`, reached through the cluster-header
    /// route) plus `dp-all` holding every rank (the default).
    PerRankClusters,
    /// One engine with internal data parallelism: a single cluster `engine` and a
    /// single route to it, no cluster-header route (`target.mode: engine_header`).
    /// `rank_ports` must hold exactly the engine's port.
    SingleEngine,
}

/// What varies between the test Envoys. Ports are chosen at start.
#[derive(Clone, Debug)]
pub struct EnvoyConfig {
    pub rank_ports: Vec<u16>,
    /// `None` runs the same topology without the filter (harness self-tests).
    pub wasm: Option<PathBuf>,
    /// The filter's plugin configuration (sent as a JSON string).
    pub plugin_config: Value,
    pub allow_on_headers_stop_iteration: bool,
    /// Let the all-ranks route retry connect failures on another host, so a dead
    /// rank only fails requests the filter pinned to it (killed-rank scenario).
    pub fallback_retries: bool,
    /// Both routes' `retry_policy.per_try_idle_timeout`: how long a rank may stay silent before
    /// Envoy answers 504 (the shipped configs' value unless a test shortens it).
    pub upstream_idle_timeout: String,
    /// The routes' `timeout` ("0s" as shipped: none; a test may bound a hung rank with it).
    pub route_timeout: String,
    /// Envoy access log (cluster, upstream host, flags): evidence when a test fails.
    pub access_log: Option<PathBuf>,
    pub topology: Topology,
    /// The listener's `per_connection_buffer_limit_bytes` (also the limit of a
    /// stream's request buffer): Envoy answers 413 to a body it must buffer past it.
    pub buffer_limit_bytes: u32,
    /// The HTTP connection manager's `max_request_headers_kb`; `None` keeps
    /// Envoy's default (60 KiB), past which it answers 431.
    pub max_request_headers_kb: Option<u32>,
    /// Serve the listener through file-based LDS (`dynamic_resources.lds_config` on a path)
    /// instead of `static_resources`, so a test can replace it while Envoy runs.
    pub lds: bool,
    /// The connection manager's `http_protocol_options.enable_trailers`: without it Envoy's
    /// HTTP/1 codec drops the trailers of a chunked request, so filters never see them.
    pub http1_trailers: bool,
    /// The per-rank clusters' circuit breaker (`max_requests`); `None` keeps Envoy's default (1024).
    pub rank_max_requests: Option<u32>,
    /// Envoy's level for the `wasm` logger at start (`debug`: the filter's debug lines).
    pub wasm_log_level: &'static str,
}

/// The routes' `per_try_idle_timeout` in the shipped configs.
pub const SHIPPED_UPSTREAM_IDLE_TIMEOUT: &str = "290s";

/// The listener buffer limit of the shipped configs: lets Envoy buffer the
/// filter's default 8 MiB body limit.
pub const DEFAULT_BUFFER_LIMIT_BYTES: u32 = 10_485_760;

impl EnvoyConfig {
    pub fn new(rank_ports: Vec<u16>, wasm: Option<PathBuf>, plugin_config: Value) -> EnvoyConfig {
        EnvoyConfig {
            rank_ports,
            wasm,
            plugin_config,
            allow_on_headers_stop_iteration: true,
            fallback_retries: true,
            upstream_idle_timeout: SHIPPED_UPSTREAM_IDLE_TIMEOUT.to_string(),
            route_timeout: "0s".to_string(),
            access_log: None,
            topology: Topology::PerRankClusters,
            buffer_limit_bytes: DEFAULT_BUFFER_LIMIT_BYTES,
            max_request_headers_kb: None,
            lds: false,
            http1_trailers: false,
            rank_max_requests: None,
            wasm_log_level: "debug",
        }
    }
}

/// The Envoy bootstrap for `config` as YAML. JSON is a subset of YAML, and building
/// it with `json!` keeps quoting of the embedded plugin JSON correct by construction.
pub fn render_config(listen_port: u16, admin_port: u16, config: &EnvoyConfig) -> String {
    render_bootstrap(listen_port, admin_port, config, None)
}

/// The bootstrap; with `lds_path`, the listener comes from that file (see [`render_lds`]).
fn render_bootstrap(
    listen_port: u16,
    admin_port: u16,
    config: &EnvoyConfig,
    lds_path: Option<&Path>,
) -> String {
    let mut bootstrap = json!({
        "admin": { "address": socket_address(admin_port) },
        "static_resources": {
            "listeners": [listener(listen_port, config)],
            "clusters": clusters(config),
        }
    });
    if let Some(path) = lds_path {
        bootstrap["static_resources"]["listeners"] = json!([]);
        // Dynamic resources require a node identity.
        bootstrap["node"] = json!({ "id": "dp-affinity-test", "cluster": "dp-affinity-test" });
        bootstrap["dynamic_resources"] = json!({
            "lds_config": {
                "path_config_source": { "path": path.display().to_string() },
                "resource_api_version": "V3"
            }
        });
    }
    serde_json::to_string_pretty(&bootstrap).expect("serialize bootstrap")
}

/// The file-based LDS document holding the one listener of `config`.
pub fn render_lds(listen_port: u16, config: &EnvoyConfig) -> String {
    let mut listener = listener(listen_port, config);
    listener["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
    serde_json::to_string_pretty(&json!({ "resources": [listener] })).expect("serialize lds")
}

fn socket_address(port: u16) -> Value {
    json!({ "socket_address": { "address": "127.0.0.1", "port_value": port } })
}

fn listener(port: u16, config: &EnvoyConfig) -> Value {
    let mut http_filters = Vec::new();
    if let Some(wasm) = &config.wasm {
        http_filters.push(wasm_filter(wasm, config));
    }
    http_filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        }
    }));
    let mut hcm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress_http",
        "codec_type": "AUTO",
        "route_config": match config.topology {
            Topology::PerRankClusters => {
                route_config(config)
            }
            Topology::SingleEngine => engine_route_config(),
        },
        "http_filters": http_filters,
    });
    if let Some(path) = &config.access_log {
        hcm["access_log"] = access_log(path);
    }
    if let Some(kb) = config.max_request_headers_kb {
        hcm["max_request_headers_kb"] = json!(kb);
    }
    if config.http1_trailers {
        hcm["http_protocol_options"] = json!({ "enable_trailers": true });
    }
    json!({
        "name": "main",
        "address": socket_address(port),
        // The default lets Envoy buffer the filter's 8 MiB body limit.
        "per_connection_buffer_limit_bytes": config.buffer_limit_bytes,
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": hcm,
            }]
        }]
    })
}

fn wasm_filter(wasm: &Path, config: &EnvoyConfig) -> Value {
    json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "dp_affinity",
                "root_id": "dp_affinity",
                "allow_on_headers_stop_iteration": config.allow_on_headers_stop_iteration,
                // As shipped: a failed VM fails its requests and is replaced by a fresh one.
                "failure_policy": "FAIL_RELOAD",
                "reload_config": { "backoff": { "base_interval": "0.2s", "max_interval": "5s" } },
                "vm_config": {
                    "vm_id": "dp_affinity",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": { "local": { "filename": wasm.display().to_string() } }
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": config.plugin_config.to_string()
                }
            }
        }
    })
}

fn route_config(config: &EnvoyConfig) -> Value {
    let (idle_timeout, route_timeout) = (&config.upstream_idle_timeout, &config.route_timeout);
    let mut fallback_route = json!({
        "cluster": ALL_RANKS_CLUSTER,
        "timeout": route_timeout,
        "retry_policy": { "per_try_idle_timeout": idle_timeout }
    });
    if config.fallback_retries {
        fallback_route["retry_policy"] = json!({
            "per_try_idle_timeout": idle_timeout,
            "retry_on": "connect-failure,refused-stream",
            "num_retries": 3,
            "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                }
            }],
            "host_selection_retry_max_attempts": 10
        });
    }
    json!({
        "name": "dp_routes",
        "virtual_hosts": [{
            "name": "all",
            "domains": ["*"],
            "routes": [
                {
                    // The filter names the rank's cluster in this header.
                    "match": {
                        "prefix": "/",
                        "headers": [{ "name": CLUSTER_HEADER, "present_match": true }]
                    },
                    "route": {
                        "cluster_header": CLUSTER_HEADER,
                        "timeout": route_timeout,
                        "retry_policy": { "per_try_idle_timeout": idle_timeout }
                    },
                    "request_headers_to_remove": [CLUSTER_HEADER]
                },
                { "match": { "prefix": "/" }, "route": fallback_route }
            ]
        }]
    })
}

/// The single-engine topology's routes: everything to the engine cluster. The
/// filter names the rank in a request header the engine reads, not in a route.
fn engine_route_config() -> Value {
    json!({
        "name": "engine_routes",
        "virtual_hosts": [{
            "name": "all",
            "domains": ["*"],
            "routes": [
                { "match": { "prefix": "/" }, "route": { "cluster": ENGINE_CLUSTER, "timeout": "0s" } }
            ]
        }]
    })
}

fn clusters(config: &EnvoyConfig) -> Vec<Value> {
    let rank_ports = &config.rank_ports;
    if config.topology == Topology::SingleEngine {
        assert_eq!(
            rank_ports.len(),
            1,
            "the single-engine topology has exactly one upstream"
        );
        return vec![static_cluster(ENGINE_CLUSTER, rank_ports, "ROUND_ROBIN")];
    }
    let mut clusters: Vec<Value> = rank_ports
        .iter()
        .enumerate()
        .map(|(rank, port)| {
            let mut cluster = static_cluster(&format!("dp-rank-{rank}"), &[*port], "ROUND_ROBIN");
            if let Some(max) = config.rank_max_requests {
                cluster["circuit_breakers"] =
                    json!({ "thresholds": [{ "priority": "DEFAULT", "max_requests": max }] });
            }
            cluster
        })
        .collect();
    let mut all = static_cluster(ALL_RANKS_CLUSTER, rank_ports, "LEAST_REQUEST");
    all["circuit_breakers"] =
        json!({ "thresholds": [{ "priority": "DEFAULT", "max_retries": 1024 }] });
    all["outlier_detection"] = json!({
        "split_external_local_origin_errors": true,
        "consecutive_local_origin_failure": 2,
        "enforcing_consecutive_local_origin_failure": 100,
        "interval": "1s",
        "base_ejection_time": "10s",
        "max_ejection_percent": 50
    });
    clusters.push(all);
    clusters
}

fn static_cluster(name: &str, ports: &[u16], lb_policy: &str) -> Value {
    let endpoints: Vec<Value> = ports
        .iter()
        .map(|port| json!({ "endpoint": { "address": socket_address(*port) } }))
        .collect();
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": lb_policy,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{ "lb_endpoints": endpoints }]
        }
    })
}

fn access_log(path: &Path) -> Value {
    json!([{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path.display().to_string(),
            "log_format": { "text_format_source": { "inline_string":
                "[%START_TIME%] %REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% %RESPONSE_FLAGS% cluster=%UPSTREAM_CLUSTER% host=%UPSTREAM_HOST% rank=%RESP(X-DP-RANK)% key=%REQ(X-SMG-ROUTING-KEY)%\n"
            } }
        }
    }])
}

/// Why a start attempt failed; the report carries Envoy's log excerpt.
enum StartError {
    Exited(String),
    NotReady(String),
}

enum Startup {
    Exited(std::process::ExitStatus),
    TimedOut,
}

/// A running Envoy. Stopped (and its log shown, if the test is failing) on drop.
pub struct Envoy {
    child: Child,
    base_id: u32,
    listen_port: u16,
    admin_port: u16,
    /// The LDS file when the listener is served by file-based LDS.
    lds_path: Option<PathBuf>,
    log_path: PathBuf,
    stderr_path: PathBuf,
    access_log: Option<PathBuf>,
}

/// Replaces `path` in one rename, as an operator's deploy would: Envoy's file watcher sees the
/// move and never reads a half-written file.
fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
}

impl Envoy {
    /// Pushes a new listener (same port) through the LDS file; Envoy applies it if valid.
    pub fn update_listener(&self, config: &EnvoyConfig) {
        let path = self
            .lds_path
            .as_ref()
            .expect("update_listener needs an Envoy started with `lds: true`");
        write_atomically(path, &render_lds(self.listen_port, config));
    }

    /// Starts Envoy with `config` in `dir` and waits until it serves.
    pub fn start(config: &EnvoyConfig, dir: &Path) -> Envoy {
        let mut attempt = 1;
        loop {
            match Envoy::try_start(config, dir, attempt) {
                Ok(envoy) => return envoy,
                // An early exit is usually a port taken meanwhile: retry on new ports.
                Err(StartError::Exited(_)) if attempt < START_ATTEMPTS => attempt += 1,
                Err(StartError::Exited(report) | StartError::NotReady(report)) => {
                    panic!("Envoy did not start (attempt {attempt}):\n{report}")
                }
            }
        }
    }

    fn try_start(config: &EnvoyConfig, dir: &Path, attempt: u32) -> Result<Envoy, StartError> {
        let (listen_port, admin_port) = (free_port(), free_port());
        let config_path = dir.join(format!("envoy-{attempt}.yaml"));
        let lds_path = config.lds.then(|| dir.join(format!("lds-{attempt}.json")));
        if let Some(path) = &lds_path {
            write_atomically(path, &render_lds(listen_port, config));
        }
        let bootstrap = render_bootstrap(listen_port, admin_port, config, lds_path.as_deref());
        std::fs::write(&config_path, bootstrap)
            .unwrap_or_else(|e| panic!("write {}: {e}", config_path.display()));
        let log_path = dir.join(format!("envoy-{attempt}.log"));
        let stderr_path = dir.join(format!("envoy-{attempt}.stderr"));
        let stderr = File::create(&stderr_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", stderr_path.display()));
        let base_id = unique_base_id();
        let child = Command::new(paths::envoy_bin())
            .arg("-c")
            .arg(&config_path)
            .args(["--concurrency", &CONCURRENCY.to_string()])
            .args(["--base-id", &base_id.to_string()])
            .args(["--log-level", "info"])
            .args([
                "--component-log-level",
                &format!("wasm:{}", config.wasm_log_level),
            ])
            .arg("--log-path")
            .arg(&log_path)
            // The log and access log are flushed every 10 s by default: too late to
            // read them while a test runs.
            .args(["--file-flush-interval-msec", "100"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn envoy: {e}"));
        let mut envoy = Envoy {
            child,
            base_id,
            listen_port,
            admin_port,
            lds_path,
            log_path,
            stderr_path,
            access_log: config.access_log.clone(),
        };
        let outcome = envoy.wait_ready();
        if outcome.is_ok() {
            return Ok(envoy);
        }
        // Stop first so the log is flushed before it is read; not panicking yet,
        // so dropping afterwards prints nothing.
        envoy.stop();
        let report = |reason: &str| format!("{reason}\n{}", envoy.log_excerpt());
        Err(match outcome {
            Err(Startup::Exited(status)) => StartError::Exited(report(&format!(
                "envoy exited during startup with {status}"
            ))),
            _ => StartError::NotReady(report(&format!("envoy not ready within {READY_TIMEOUT:?}"))),
        })
    }

    /// Ready = admin `/ready` answers 200 "LIVE" and the listener accepts.
    fn wait_ready(&mut self) -> Result<(), Startup> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(Startup::Exited(status));
            }
            if self.is_live() && TcpStream::connect(self.listen_addr()).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(Startup::TimedOut)
    }

    /// Whether the admin port accepts connections (`http::send` panics if not).
    pub fn admin_reachable(&self) -> bool {
        TcpStream::connect(self.admin_addr()).is_ok()
    }

    /// Probes admin `/ready` without panicking: during startup the admin socket
    /// may accept before Envoy serves it, and a failing start closes it mid-read.
    fn is_live(&self) -> bool {
        let probe = || -> std::io::Result<String> {
            let mut stream = TcpStream::connect(self.admin_addr())?;
            stream.set_read_timeout(Some(Duration::from_secs(1)))?;
            stream.write_all(
                b"GET /ready HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n",
            )?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer)?;
            Ok(answer)
        };
        // The admin answers chunked: look for LIVE anywhere in the body.
        probe().is_ok_and(|answer| {
            answer.starts_with("HTTP/1.1 200")
                && answer
                    .split_once("\r\n\r\n")
                    .is_some_and(|(_, body)| body.contains("LIVE"))
        })
    }

    pub fn listen_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.listen_port))
    }

    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.admin_port))
    }

    /// Sends one request to the listener on a fresh connection.
    pub fn send(&self, request: &Request) -> Response {
        http::send(self.listen_addr(), request)
    }

    pub fn admin_get(&self, path: &str) -> Response {
        http::send(self.admin_addr(), &Request::get(path))
    }

    /// Sets one log component's level while Envoy runs (admin `POST /logging?<component>=<level>`),
    /// e.g. `http` at `debug` to see what the connection manager decoded.
    pub fn set_log_level(&self, component: &str, level: &str) {
        let path = format!("/logging?{component}={level}");
        let response = http::send(self.admin_addr(), &Request::post(&path));
        assert_eq!(response.status, 200, "admin {path}: {}", response.text());
    }

    /// Integer stats whose names match the admin `filter` regex (plain `/stats`
    /// output, `name: value` per line; histograms are skipped).
    pub fn stats(&self, filter: &str) -> BTreeMap<String, u64> {
        let response = self.admin_get(&format!("/stats?filter={filter}"));
        assert_eq!(response.status, 200, "admin /stats: {}", response.text());
        parse_stats(&response.text())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn access_log(&self) -> String {
        self.access_log
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Stops Envoy and reaps it: SIGTERM first so it flushes its logs, SIGKILL if
    /// it has not exited shortly after.
    pub fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            terminate(&mut self.child, SHUTDOWN_GRACE);
        }
        // Envoy never unlinks its hot-restart segment (not even on SIGTERM); remove
        // ours so test runs do not pile them up in /dev/shm.
        let segment = format!(
            "/dev/shm/envoy_shared_memory_{}",
            u64::from(self.base_id) * 10
        );
        let _ = std::fs::remove_file(segment);
    }

    /// What to show for a failing test: stderr, the warnings and errors, and the
    /// tail of the log (which includes the filter's debug lines).
    fn log_excerpt(&self) -> String {
        let stderr = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let log = self.log();
        let problems: Vec<&str> = log
            .lines()
            .filter(|l| {
                l.contains("[warning]") || l.contains("[error]") || l.contains("[critical]")
            })
            .take(60)
            .collect();
        format!(
            "--- envoy stderr ({}) ---\n{}\n--- envoy warnings/errors ---\n{}\n--- envoy log tail ({}) ---\n{}\n--- access log tail ---\n{}",
            self.stderr_path.display(),
            tail(&stderr, 40),
            problems.join("\n"),
            self.log_path.display(),
            tail(&without_startup_chatter(&log), 150),
            tail(&self.access_log(), 40),
        )
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("{}", self.log_excerpt());
        }
    }
}

/// Sends SIGTERM (std only offers SIGKILL, hence `kill(1)`), waits up to `grace`,
/// then kills. Always reaps the child.
fn terminate(child: &mut Child, grace: Duration) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .stderr(Stdio::null())
        .status();
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `name: value` lines → map; non-integer values (histograms) are skipped.
pub fn parse_stats(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|line| {
            let (name, value) = line.rsplit_once(": ")?;
            Some((name.trim().to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// Result of `envoy --mode validate`.
#[derive(Debug)]
pub struct Validation {
    pub success: bool,
    /// stdout and stderr together (Envoy logs to stderr).
    pub output: String,
}

/// Runs `envoy --mode validate` on `config` (written into `dir`). Validation loads
/// the wasm and runs the filter's `on_configure`, so a refused config fails it.
pub fn validate(config: &EnvoyConfig, dir: &Path, name: &str) -> Validation {
    let config_path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &config_path,
        render_config(free_port(), free_port(), config),
    )
    .unwrap_or_else(|e| panic!("write {}: {e}", config_path.display()));
    validate_file(&config_path)
}

/// Validates a config file. Runs in the repo root, where relative paths in the
/// shipped configs (the wasm file) are meant to resolve.
pub fn validate_file(config_path: &Path) -> Validation {
    let output = Command::new(paths::envoy_bin())
        .current_dir(paths::repo_root())
        .args(["--mode", "validate", "-c"])
        .arg(config_path)
        .args(["--base-id", &unique_base_id().to_string()])
        .args(["--log-level", "info"])
        .args(["--component-log-level", "wasm:debug"])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run envoy --mode validate: {e}"));
    Validation {
        success: output.status.success(),
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Base ids keep concurrent Envoys (test threads, other test runs, a developer's
/// Envoy on the default id 0) from sharing hot-restart shared memory. Distinct per
/// process (pid) and per call (counter); the time term spreads reused pids.
fn unique_base_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static PER_PROCESS: OnceLock<u32> = OnceLock::new();
    let per_process = *PER_PROCESS.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        (std::process::id() ^ (nanos >> 10)) % 100_000
    });
    // Envoy derives socket and memory names from base_id * 10 + epoch: stay well
    // inside u32 after that multiplication.
    1_000_000 + per_process * 100 + NEXT.fetch_add(1, Ordering::Relaxed) % 100
}

/// Drops Envoy's startup inventory (hundreds of long `[info][main]` lines listing
/// extensions) and shortens very long lines, so the filter's lines stay visible.
fn without_startup_chatter(log: &str) -> String {
    log.lines()
        .filter(|line| !line.contains("][info][main]"))
        .map(|line| match line.char_indices().nth(400) {
            Some((cut, _)) => format!("{}...", &line[..cut]),
            None => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
