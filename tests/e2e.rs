//! End-to-end scenarios: the compiled filter in a real Envoy (2 workers) in front
//! of 4 mock ranks, as described in notes/interfaces.md. Each test names one
//! behaviour and checks which rank served, the status, the response headers and
//! the filter's counters. Every test starts its own Envoy and mocks.
//!
//! Run with `make test`, or after building the artifacts:
//! `cargo test --release --test e2e -- --test-threads 2`.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use support::envoy::{self, EnvoyConfig};
use support::fnv::fnv1a64_hex;
use support::http::{self, Client, Request, Response};
use support::paths;
use support::requests::{chat, keyed, plugin_config, KEY_HEADER, RANK_HEADER};
use support::stack::{echoed_rank, mock_info, served_rank, upstream_headers, Stack, StackOptions};
use support::tempdir::TestDir;

const CLUSTER_HEADER: &str = "x-dp-affinity-cluster";

// ---------------------------------------------------------------- helpers

fn start(name: &str, overrides: Value) -> Stack {
    Stack::start(name, StackOptions::new(plugin_config(overrides)))
}

/// A raw body (not necessarily valid JSON) sent as `content_type`.
fn raw(content_type: &str, body: &str) -> Request {
    Request::post("/v1/chat/completions").body(content_type, body.as_bytes().to_vec())
}

fn distinct(ranks: impl IntoIterator<Item = u32>) -> BTreeSet<u32> {
    ranks.into_iter().collect()
}

/// Sends `request` `times` times and returns the serving ranks.
fn ranks_for(stack: &Stack, request: &Request, times: usize) -> Vec<u32> {
    (0..times)
        .map(|_| served_rank(&stack.send(request)))
        .collect()
}

/// Sends `request` (which carries one routing key) `turns` times, asserts one
/// rank served every turn, and returns that rank.
fn assert_sticky(stack: &Stack, label: &str, request: &Request, turns: usize) -> u32 {
    let ranks = ranks_for(stack, request, turns);
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "{label}: key moved between ranks: {ranks:?}"
    );
    ranks[0]
}

/// Asserts that the upstream never saw `header`.
fn assert_not_forwarded(response: &Response, header: &str) {
    let seen = upstream_headers(response);
    assert!(
        !seen.contains_key(header),
        "upstream received {header}: {:?}",
        seen.get(header)
    );
}

/// Asserts the upstream received exactly `request.body`.
fn assert_body_passed_through(response: &Response, request: &Request) {
    let info = mock_info(response);
    assert_eq!(
        info["body_len"],
        json!(request.body.len()),
        "body length changed"
    );
    assert_eq!(
        info["body_fnv1a64"].as_str().map(str::to_ascii_lowercase),
        Some(fnv1a64_hex(&request.body)),
        "body bytes changed on the way upstream"
    );
}

// ---------------------------------------------------------------- 1. no key

#[test]
fn no_key() {
    let stack = start("no_key", json!({}));
    let ranks = ranks_for(&stack, &chat(json!({})), 20);
    assert!(
        distinct(ranks.iter().copied()).len() >= 2,
        "Envoy should balance keyless requests: {ranks:?}"
    );
    // Bodiless requests must not wait for a body that never comes.
    let models = stack.send(&Request::get("/v1/models"));
    assert_eq!(models.status, 200, "GET /v1/models: {}", models.text());
    echoed_rank(&models);
    let counters = stack.settled();
    counters.assert_eq("no_key", 21);
    counters.assert_zero(&["affinity_hit", "affinity_miss", "learned", "explicit"]);
}

// ---------------------------------------------------------------- 2./3. explicit rank

#[test]
fn explicit_rank_header() {
    let stack = start("explicit_rank_header", json!({}));
    // The key rides along to prove the explicit rank does not pin it.
    let request = keyed("explicit-session").header(RANK_HEADER, "2");
    assert_eq!(ranks_for(&stack, &request, 10), vec![2; 10]);
    let counters = stack.settled();
    counters.assert_eq("explicit", 10);
    counters.assert_zero(&["learned", "affinity_miss"]);

    // Table untouched: the same key on its own is a miss, not a hit on rank 2.
    served_rank(&stack.send(&keyed("explicit-session")));
    let counters = stack.settled();
    counters.assert_eq("affinity_miss", 1);
    counters.assert_zero(&["affinity_hit"]);
}

#[test]
fn explicit_rank_body() {
    let stack = start("explicit_rank_body", json!({}));
    let routed = chat(json!({ "routed_dp_rank": 3 }));
    assert_eq!(ranks_for(&stack, &routed, 3), vec![3; 3]);
    let legacy = chat(json!({ "data_parallel_rank": 1 }));
    assert_eq!(ranks_for(&stack, &legacy, 3), vec![1; 3]);
    let both = chat(json!({ "routed_dp_rank": 0 })).header(RANK_HEADER, "2");
    assert_eq!(
        ranks_for(&stack, &both, 3),
        vec![2; 3],
        "header must beat body"
    );
    let counters = stack.settled();
    counters.assert_eq("explicit", 9);
    counters.assert_zero(&["invalid_rank"]);
}

// ---------------------------------------------------------------- 4. invalid ranks

/// One invalid explicit rank: sent as the header value or as a raw JSON body.
struct InvalidCase {
    name: &'static str,
    header: Option<&'static str>,
    body: Option<&'static str>,
    /// Acceptable values of the error's `param`.
    params: &'static [&'static str],
}

const ROUTED_FIELD: &[&str] = &["routed_dp_rank"];
const HEADER_FIELD: &[&str] = &["x-data-parallel-rank"];

fn header_case(name: &'static str, value: &'static str) -> InvalidCase {
    InvalidCase {
        name,
        header: Some(value),
        body: None,
        params: HEADER_FIELD,
    }
}

fn body_case(
    name: &'static str,
    body: &'static str,
    params: &'static [&'static str],
) -> InvalidCase {
    InvalidCase {
        name,
        header: None,
        body: Some(body),
        params,
    }
}

fn invalid_cases() -> Vec<InvalidCase> {
    vec![
        header_case("header -1", "-1"),
        header_case("header 4 (= dp_size)", "4"),
        header_case("header abc", "abc"),
        header_case("header 1.5", "1.5"),
        header_case("header overflow", "99999999999999999999"),
        header_case("header empty", ""),
        body_case(
            "body -1",
            r#"{"model":"m","routed_dp_rank":-1}"#,
            ROUTED_FIELD,
        ),
        body_case(
            "body 4",
            r#"{"model":"m","routed_dp_rank":4}"#,
            ROUTED_FIELD,
        ),
        body_case(
            "body 1.5",
            r#"{"model":"m","routed_dp_rank":1.5}"#,
            ROUTED_FIELD,
        ),
        body_case(
            "body string",
            r#"{"model":"m","routed_dp_rank":"2"}"#,
            ROUTED_FIELD,
        ),
        body_case(
            "body true",
            r#"{"model":"m","routed_dp_rank":true}"#,
            ROUTED_FIELD,
        ),
        body_case(
            "body 1e400",
            r#"{"model":"m","routed_dp_rank":1e400}"#,
            ROUTED_FIELD,
        ),
        body_case(
            "body conflicting fields",
            r#"{"model":"m","routed_dp_rank":1,"data_parallel_rank":2}"#,
            &["routed_dp_rank", "data_parallel_rank"],
        ),
    ]
}

impl InvalidCase {
    fn request(&self) -> Request {
        let mut request = match self.body {
            Some(body) => raw("application/json", body),
            None => chat(json!({})),
        };
        if let Some(value) = self.header {
            request = request.header(RANK_HEADER, value);
        }
        request
    }
}

/// Why `response` is not the filter's 400 for `case`, if it is not.
fn invalid_rank_problem(case: &InvalidCase, response: &Response) -> Option<String> {
    if response.status != 400 {
        return Some(format!(
            "status {} body {:?}",
            response.status,
            response.text()
        ));
    }
    let content_type = response.header("content-type").unwrap_or("");
    if !content_type.starts_with("application/json") {
        return Some(format!("content-type {content_type:?}"));
    }
    let Ok(body) = serde_json::from_slice::<Value>(&response.body) else {
        return Some(format!("body not JSON: {:?}", response.text()));
    };
    let error = &body["error"];
    let param = error["param"].as_str().unwrap_or("");
    let message = error["message"].as_str().unwrap_or("");
    let names_range = message.contains('0') && (message.contains('3') || message.contains('4'));
    let well_formed = case.params.contains(&param)
        && error["code"] == "invalid_data_parallel_rank"
        && error["type"] == "invalid_request_error"
        && names_range;
    (!well_formed).then(|| format!("error body {body}"))
}

#[test]
fn invalid_rank_cases() {
    let cases = invalid_cases();

    let stack = start("invalid_rank_reject", json!({}));
    let problems: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let response = stack.send(&case.request());
            invalid_rank_problem(case, &response).map(|p| format!("{}: {p}", case.name))
        })
        .collect();
    assert!(problems.is_empty(), "reject mode:\n{}", problems.join("\n"));
    let counters = stack.settled();
    counters.assert_eq("invalid_rank", cases.len() as u64);
    counters.assert_zero(&["explicit"]);
    drop(stack);

    // "ignore": the same inputs are treated as if no rank was given.
    let stack = start(
        "invalid_rank_ignore",
        json!({ "explicit_rank": { "on_invalid": "ignore" } }),
    );
    let problems: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let response = stack.send(&case.request());
            // An ignored header rank does not reach the upstream either: an engine honouring
            // the same header would act on it.
            if case.header.is_some() && response.status == 200 {
                assert_not_forwarded(&response, RANK_HEADER);
            }
            (response.status != 200).then(|| {
                format!(
                    "{}: status {} {:?}",
                    case.name,
                    response.status,
                    response.text()
                )
            })
        })
        .collect();
    assert!(problems.is_empty(), "ignore mode:\n{}", problems.join("\n"));
    let counters = stack.settled();
    counters.assert_zero(&["explicit"]);
    counters.assert_eq("no_key", cases.len() as u64);
}

#[test]
fn explicit_rank_disabled() {
    let stack = start(
        "explicit_rank_disabled",
        json!({ "explicit_rank": { "enabled": false } }),
    );
    let by_header = chat(json!({})).header(RANK_HEADER, "2");
    let by_body = chat(json!({ "routed_dp_rank": 2 }));
    let mut ranks = Vec::new();
    for request in [&by_header, &by_body] {
        for _ in 0..8 {
            let response = stack.send(request);
            ranks.push(served_rank(&response));
            assert_not_forwarded(&response, RANK_HEADER);
        }
    }
    assert!(
        distinct(ranks.iter().copied()).len() >= 2,
        "disabled explicit rank still honoured: {ranks:?}"
    );
    let counters = stack.settled();
    counters.assert_zero(&["explicit", "invalid_rank"]);
    counters.assert_eq("no_key", 16);
}

/// With a trust secret configured, only callers presenting it may choose a rank; everyone
/// else's rank (header or body) is ignored and stripped, and the secret never reaches the engine.
#[test]
fn explicit_rank_trusted_callers_only() {
    const TOKEN: &str = "x-router-token";
    let stack = start(
        "explicit_rank_trusted",
        json!({ "explicit_rank": { "trusted_header": TOKEN, "trusted_secret": "s3cret" } }),
    );
    let trusted = chat(json!({}))
        .header(RANK_HEADER, "2")
        .header(TOKEN, "s3cret");
    for _ in 0..5 {
        let response = stack.send(&trusted);
        assert_eq!(served_rank(&response), 2);
        assert_not_forwarded(&response, TOKEN);
    }
    let wrong_secret = chat(json!({}))
        .header(RANK_HEADER, "2")
        .header(TOKEN, "guess");
    let no_secret_body = chat(json!({ "routed_dp_rank": 2 }));
    let no_secret_invalid = chat(json!({})).header(RANK_HEADER, "99");
    let mut ranks = Vec::new();
    for request in [&wrong_secret, &no_secret_body, &no_secret_invalid] {
        for _ in 0..6 {
            let response = stack.send(request);
            assert_eq!(
                response.status, 200,
                "untrusted ranks are ignored, not rejected"
            );
            ranks.push(served_rank(&response));
            assert_not_forwarded(&response, RANK_HEADER);
            assert_not_forwarded(&response, TOKEN);
        }
    }
    assert!(
        distinct(ranks.iter().copied()).len() >= 2,
        "an untrusted rank was honoured: {ranks:?}"
    );
    let counters = stack.settled();
    counters.assert_eq("explicit", 5);
    counters.assert_zero(&["invalid_rank"]);
    counters.assert_eq("untrusted_rank", 12);
}

// ---------------------------------------------------------------- 5./6. routing keys

#[test]
fn key_header_sticky() {
    const KEYS: usize = 32;
    const TURNS: usize = 20;
    let stack = start("key_header_sticky", json!({}));
    let keys: Vec<String> = (0..KEYS).map(|i| format!("session-{i}")).collect();
    let mut pinned: HashMap<&str, u32> = HashMap::new();
    // Interleaved turns, like concurrent conversations.
    for turn in 0..TURNS {
        for key in &keys {
            let rank = served_rank(&stack.send(&keyed(key)));
            let first = *pinned.entry(key).or_insert(rank);
            assert_eq!(rank, first, "{key} moved from rank {first} at turn {turn}");
        }
    }
    let used = distinct(pinned.values().copied());
    assert!(
        used.len() >= 3,
        "keys not spread over the ranks: {pinned:?}"
    );
    // Exact: each key misses and is learned once, every later turn hits.
    let counters = stack.settled();
    counters.assert_eq("affinity_miss", KEYS as u64);
    counters.assert_eq("learned", KEYS as u64);
    counters.assert_eq("affinity_hit", (KEYS * (TURNS - 1)) as u64);
    counters.assert_zero(&["no_key"]);
}

#[test]
fn key_body_fields() {
    let stack = start("key_body_fields", json!({}));
    for field in ["routing_key", "prompt_cache_key", "user"] {
        for i in 0..4 {
            let request = chat(json!({ field: format!("{field}-value-{i}") }));
            assert_sticky(&stack, &format!("body {field} #{i}"), &request, 5);
        }
    }
    for i in 0..4 {
        let request = chat(json!({})).header("x-routing-key", &format!("alt-header-{i}"));
        assert_sticky(&stack, &format!("x-routing-key #{i}"), &request, 5);
    }
    // SGLang's native endpoint carries the key the same way.
    let generate =
        Request::post("/generate").json(&json!({ "text": "hi", "routing_key": "sglang-session" }));
    assert_sticky(&stack, "/generate routing_key", &generate, 5);
    let counters = stack.settled();
    counters.assert_eq("affinity_miss", 17);
    counters.assert_eq("learned", 17);
    counters.assert_eq("affinity_hit", 17 * 4);
    counters.assert_zero(&["no_key"]);
}

/// Keys longer than routing_key.max_bytes (512) are still hashed whole: distinct
/// long keys sharing a 512-byte prefix stay independent, and each is sticky.
#[test]
fn long_key_still_sticky() {
    let stack = start("long_key_still_sticky", json!({}));
    let prefix = "k".repeat(600);
    for i in 0..4 {
        let key = format!("{prefix}-{i}");
        assert_sticky(&stack, &format!("long key #{i}"), &keyed(&key), 4);
    }
    stack.assert_counter("affinity_miss", 4);
    stack.assert_counter("affinity_hit", 12);
    stack.assert_counter_at_least("key_too_long", 4);
}

/// First turns of the same key racing on both workers: whatever rank wins the
/// table, every later turn agrees.
#[test]
fn concurrent_first_turns_converge() {
    const KEYS: usize = 16;
    const RACERS: usize = 4;
    let stack = start("concurrent_first_turns_converge", json!({}));
    let keys: Vec<String> = (0..KEYS).map(|i| format!("race-{i}")).collect();
    std::thread::scope(|scope| {
        for _ in 0..RACERS {
            scope.spawn(|| {
                for key in &keys {
                    served_rank(&stack.send(&keyed(key)));
                }
            });
        }
    });
    for key in &keys {
        assert_sticky(&stack, key, &keyed(key), 4);
    }
    stack.settled().assert_zero(&["cas_exhausted"]);
}

#[test]
fn key_header_beats_body() {
    let stack = start("key_header_beats_body", json!({}));
    let header_rank = assert_sticky(&stack, "header key", &keyed("header-key"), 2);
    // Find a body key pinned elsewhere, so the winner is visible in the rank.
    let body_key = (0..40)
        .map(|i| format!("body-key-{i}"))
        .find(|key| {
            let rank = assert_sticky(&stack, key, &chat(json!({ "routing_key": key })), 2);
            rank != header_rank
        })
        .expect("no body key landed on another rank in 40 tries");
    let both = chat(json!({ "routing_key": body_key })).header(KEY_HEADER, "header-key");
    assert_eq!(
        ranks_for(&stack, &both, 5),
        vec![header_rank; 5],
        "header key must beat body key {body_key}"
    );
}

// ---------------------------------------------------------------- 7. cluster header

#[test]
fn client_cluster_header_ignored() {
    let stack = start("client_cluster_header_ignored", json!({}));
    let forged = chat(json!({})).header(CLUSTER_HEADER, "dp-rank-3");
    let mut ranks = Vec::new();
    for _ in 0..20 {
        let response = stack.send(&forged);
        ranks.push(served_rank(&response));
        assert_not_forwarded(&response, CLUSTER_HEADER);
    }
    assert!(
        distinct(ranks.iter().copied()).len() >= 2,
        "client-chosen cluster honoured: {ranks:?}"
    );

    // A cluster that does not exist would be a 503 if the header were used.
    let bogus = chat(json!({})).header(CLUSTER_HEADER, "no-such-cluster");
    ranks_for(&stack, &bogus, 3);

    let explicit = forged.clone().header(RANK_HEADER, "1");
    for _ in 0..3 {
        let response = stack.send(&explicit);
        assert_eq!(served_rank(&response), 1);
        assert_not_forwarded(&response, CLUSTER_HEADER);
    }
    stack.assert_counter("cluster_header_stripped", 26);
    stack.assert_counter("no_key", 23);
    stack.assert_counter("explicit", 3);
}

// ---------------------------------------------------------------- 8. workers

#[test]
fn workers_share_pins() {
    let stack = start("workers_share_pins", json!({}));
    // Fresh connections are spread over both workers by the kernel.
    let ranks = ranks_for(&stack, &keyed("shared-session"), 40);
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "pin not shared between workers: {ranks:?}"
    );
    let per_worker = connections_per_worker(&stack);
    eprintln!("connections per worker: {per_worker:?}");
    assert!(
        per_worker.len() >= 2 && per_worker.values().all(|n| *n > 0),
        "connections did not reach both workers: {per_worker:?}"
    );
    stack.assert_counter("affinity_miss", 1);
    stack.assert_counter("learned", 1);
    stack.assert_counter("affinity_hit", 39);
}

/// `listener.<addr>.worker_<n>.downstream_cx_total` of the main listener.
fn connections_per_worker(stack: &Stack) -> HashMap<String, u64> {
    let port = stack.addr().port();
    stack
        .envoy
        .stats("downstream_cx_total")
        .into_iter()
        .filter(|(name, _)| name.contains(&format!("_{port}.worker_")))
        .collect()
}

// ---------------------------------------------------------------- 9. dead rank

#[test]
fn killed_rank_unpinned() {
    let options = StackOptions::new(plugin_config(json!({}))).fallback_retries();
    let mut stack = Stack::start("killed_rank_unpinned", options);
    let key = "doomed-session";
    let first = assert_sticky(&stack, "before kill", &keyed(key), 2);

    stack.mock(first).kill();
    let mut failures = Vec::new();
    let mut moved_to = None;
    for _ in 0..3 {
        let response = stack.send(&keyed(key));
        if response.status == 200 {
            moved_to = Some(served_rank(&response));
            break;
        }
        assert!(response.status >= 500, "unexpected {}", response.status);
        failures.push(response.status);
    }
    assert!(
        failures.len() <= 1,
        "a dead pinned rank must fail at most one request: {failures:?}"
    );
    eprintln!("killed rank {first}: failed statuses before recovery {failures:?}");
    let moved_to = moved_to.expect("key never served by a live rank");
    assert_ne!(moved_to, first, "served by the killed rank?");
    assert_sticky(&stack, "after kill", &keyed(key), 5);
    assert_eq!(served_rank(&stack.send(&keyed(key))), moved_to);
    stack.assert_counter_at_least("unpinned", 1);
    stack.assert_counter("learned", 2);

    // The old rank coming back does not steal the key.
    stack.mock(first).restart();
    assert_eq!(ranks_for(&stack, &keyed(key), 3), vec![moved_to; 3]);
}

/// A gRPC request's failure comes back from Envoy as a `200` carrying `grpc-status` (14, unavailable,
/// for a rank it cannot reach): judged by that status, not the `200`, its key is unpinned and
/// the rank cooled down as for any request. Taken as served, the key stayed on the dead rank
/// (6 of 6 later requests failed) and every such answer cancelled a strike.
#[test]
fn a_grpc_request_to_a_dead_rank_is_judged_by_its_grpc_status() {
    // Envoy answers in gRPC's form for any request whose content type is gRPC's; the mock
    // answers this path with a plain 200.
    let grpc = |key: &str| {
        Request::get("/health")
            .header("content-type", "application/grpc")
            .header(KEY_HEADER, key)
    };
    let mut stack = Stack::start(
        "grpc_dead_rank",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let key = "grpc-conversation";
    let served = stack.send(&grpc(key));
    assert_eq!((served.status, served.header("grpc-status")), (200, None));
    let first = echoed_rank(&served);
    assert_eq!(echoed_rank(&stack.send(&grpc(key))), first, "pinned");
    stack.mock(first).kill();
    let mut failed = Vec::new();
    let mut moved_to = None;
    for _ in 0..3 {
        let response = stack.send(&grpc(key));
        assert_eq!(response.status, 200, "{:?}", response.headers);
        match response.header("grpc-status") {
            Some(code) if code != "0" => failed.push(code.to_string()),
            _ => {
                moved_to = Some(echoed_rank(&response));
                break;
            }
        }
    }
    eprintln!(
        "gRPC, rank {first} killed: grpc-status of the failures {failed:?}, then {moved_to:?}"
    );
    assert_eq!(
        failed,
        ["14"],
        "one request fails on the dead rank, no more"
    );
    assert!(moved_to.is_some_and(|r| r != first), "{moved_to:?}");
    let counters = stack.settled();
    counters.assert_eq("unpinned", 1);
    counters.assert_eq("rank_cooldown", 1);
}

/// `dp_size` above the rank clusters Envoy has (6 ranks, 4 clusters): Envoy answers a request
/// routed to a missing cluster with `503` (`cluster_not_found`). That is proof the rank cannot
/// be reached — a client cannot name a cluster, the filter removes its copy of the header — so
/// each missing rank fails one request and cools down, and the keys that would go there are
/// placed on the ranks that exist. (Taken as a proxy error, a third of the keys failed on every
/// request.)
#[test]
fn a_rank_whose_cluster_is_missing_cools_down_after_one_failure() {
    let dir = TestDir::new("missing_cluster");
    let mocks: Vec<support::mock::MockRank> = (0..4)
        .map(|rank| support::mock::MockRank::start(rank, &[], dir.path()))
        .collect();
    let config = EnvoyConfig::new(
        mocks.iter().map(support::mock::MockRank::port).collect(),
        Some(paths::wasm_path()),
        support::requests::default_config(json!({ "dp_size": 6 })),
    );
    let envoy = envoy::Envoy::start(&config, dir.path());
    let mut failed = 0;
    let mut served = BTreeSet::new();
    for turn in 0..2 {
        for key in 0..60 {
            let response = envoy.send(&keyed(&format!("missing-cluster-{key}")));
            match response.status {
                503 => failed += 1,
                _ => {
                    served.insert(served_rank(&response));
                }
            }
        }
        eprintln!("after round {turn}: {failed} failed, served by {served:?}");
    }
    assert!((1..=2).contains(&failed), "{failed} requests failed");
    assert_eq!(served, BTreeSet::from([0, 1, 2, 3]));
    let counters = envoy.settled_counters();
    counters.assert_eq("rank_cooldown", failed);
}

// ---------------------------------------------------------------- 10. bounded table

#[test]
fn tiny_table_bound() {
    const KEYS: usize = 1000;
    const SLOTS: u64 = 4 * 2;
    let stack = start(
        "tiny_table_bound",
        json!({ "table": { "buckets": 4, "ways": 2 } }),
    );
    let mut client = Client::new(stack.addr());
    let mut last_rank = 0;
    for i in 0..KEYS {
        last_rank = served_rank(&client.send(&keyed(&format!("tiny-{i}"))));
    }
    stack.assert_counter("affinity_miss", KEYS as u64);
    stack.assert_counter_at_least("evictions", KEYS as u64 - SLOTS);

    // The newest key is still resident...
    let again = client.send(&keyed(&format!("tiny-{}", KEYS - 1)));
    assert_eq!(served_rank(&again), last_rank, "newest key lost its pin");
    stack.assert_counter("affinity_hit", 1);
    // ...the oldest was evicted long ago.
    served_rank(&client.send(&keyed("tiny-0")));
    stack.assert_counter("affinity_miss", KEYS as u64 + 1);
}

// ---------------------------------------------------------------- 11. streaming

#[test]
fn sse_unbuffered() {
    let stack = Stack::start(
        "sse_unbuffered",
        StackOptions::new(plugin_config(json!({}))).mock_args(&["--stream-interval-ms", "200"]),
    );
    let request = chat(json!({ "stream": true, "routing_key": "streaming-session" }));
    let mut ranks = Vec::new();
    for _ in 0..2 {
        let streamed = http::stream(stack.addr(), &request);
        assert_eq!(streamed.status, 200);
        let content_type = streamed.header("content-type").unwrap_or("");
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type:?}"
        );
        let body = String::from_utf8_lossy(&streamed.body()).into_owned();
        assert!(body.contains("data: [DONE]"), "stream incomplete: {body:?}");
        let first = streamed.chunks.first().expect("chunks").0;
        let last = streamed.chunks.last().expect("chunks").0;
        assert!(
            first * 2 < last,
            "stream buffered: first chunk at {first:?}, last at {last:?} ({} chunks)",
            streamed.chunks.len()
        );
        eprintln!(
            "SSE: {} chunks, first at {first:?}, last at {last:?}",
            streamed.chunks.len()
        );
        let echoed = streamed.header("x-dp-rank").expect("x-dp-rank on SSE");
        ranks.push(echoed.parse::<u32>().expect("numeric x-dp-rank"));
    }
    assert_eq!(
        ranks[0], ranks[1],
        "streamed turns landed on different ranks"
    );
    stack.assert_counter("learned", 1);
    stack.assert_counter("affinity_hit", 1);
}

// ---------------------------------------------------------------- 12. body bytes

#[test]
fn body_passthrough() {
    let stack = start("body_passthrough", json!({}));

    // Valid JSON with a key: miss then hit, bytes unchanged both times.
    let prompt = "Zürich → 東京 \"quoted\" \\ ".repeat(2000);
    let keyed_json = chat(
        json!({ "routing_key": "bytes-session", "messages": [{ "role": "user", "content": prompt }] }),
    );
    for _ in 0..2 {
        assert_body_passed_through(&stack.send(&keyed_json), &keyed_json);
    }

    // 2 MiB, above Envoy's default 1 MiB buffer, key after the prompt.
    let big_prompt = "x".repeat(2 << 20);
    let big = raw(
        "application/json",
        &format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{big_prompt}"}}],"routing_key":"big-session"}}"#
        ),
    );
    for _ in 0..2 {
        assert_body_passed_through(&stack.send(&big), &big);
    }
    stack.assert_counter("learned", 2);
    stack.assert_counter("affinity_hit", 2);

    // Malformed JSON: served via the fallback, bytes intact.
    let malformed = raw(
        "application/json",
        r#"{"routing_key": "broken", "messages": [ {"#,
    );
    assert_body_passed_through(&stack.send(&malformed), &malformed);
    stack.assert_counter("body_malformed", 1);

    // A non-JSON content type is not parsed, even if it looks like JSON: keyless, and no new
    // key. (Every request before was keyed or malformed, neither of which counts `no_key`.)
    let plain = raw("text/plain", r#"{"routing_key":"plain-key"}"#);
    for _ in 0..2 {
        assert_body_passed_through(&stack.send(&plain), &plain);
    }
    let counters = stack.settled();
    counters.assert_eq("no_key", 2);
    counters.assert_eq("affinity_miss", 2);
}

#[test]
fn body_too_large_passthrough() {
    let stack = start("body_too_large", json!({ "body": { "max_bytes": 1024 } }));
    let padding = "p".repeat(4096);
    let large = raw(
        "application/json",
        &format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{padding}"}}],"routing_key":"late-key"}}"#
        ),
    );
    assert_body_passed_through(&stack.send(&large), &large);
    stack.assert_counter("body_too_large", 1);
    // Small bodies still work under the small limit.
    let small = chat(json!({ "routing_key": "small-key" }));
    assert_sticky(&stack, "small body", &small, 3);
}

// ---------------------------------------------------------------- request trailers

/// A body followed by trailers (HTTP/1.1 chunked with a trailer section, let through by the
/// listener's `enable_trailers`): the body callback never sees the end of the stream, so the
/// filter decides when the trailers arrive, and the decision still follows the body. Explicit
/// `routed_dp_rank`s land on their rank; a body `routing_key` is learned on its first turn and
/// sticks. Envoy's own debug log shows it decoded every request's trailers, so the scenario
/// cannot pass through Envoy dropping them (the body would then end the stream as usual).
#[test]
fn body_followed_by_trailers() {
    let stack = Stack::start(
        "body_followed_by_trailers",
        StackOptions::new(plugin_config(json!({}))).http1_trailers(),
    );
    // The connection manager logs each request's decoded trailers at debug.
    stack.envoy.set_log_level("http", "debug");
    let mut tags = Vec::new();
    let mut send = |request: &Request, splits: &[usize]| -> Response {
        let tag = format!("trailer-{}", tags.len());
        let pieces = request.chunked_pieces_with_trailers(splits, false, &[("x-checksum", &tag)]);
        tags.push(tag);
        // A fresh connection per request: both workers take part.
        let response = Client::new(stack.addr()).send_pieces(&pieces, Duration::ZERO, "POST");
        assert_body_passed_through(&response, request);
        response
    };

    // Every rank twice, the body in one chunk and in two.
    for (i, rank) in [2u32, 0, 3, 1, 1, 3, 0, 2].into_iter().enumerate() {
        let request = chat(json!({ "routed_dp_rank": rank }));
        let splits = if i % 2 == 0 {
            vec![]
        } else {
            vec![request.body.len() / 2]
        };
        assert_eq!(
            served_rank(&send(&request, &splits)),
            rank,
            "body rank {rank} followed by trailers"
        );
    }
    let keyed_body = chat(json!({ "routing_key": "trailers-session" }));
    let ranks: Vec<u32> = (0..4)
        .map(|_| served_rank(&send(&keyed_body, &[])))
        .collect();
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "body key followed by trailers moved between ranks: {ranks:?}"
    );

    // Envoy flushes its log every 100 ms (`--file-flush-interval-msec`).
    let deadline = Instant::now() + Duration::from_secs(3);
    let unseen = loop {
        let log = stack.envoy.log();
        let unseen: Vec<&String> = tags
            .iter()
            .filter(|tag| !log.contains(&format!("'x-checksum', '{tag}'")))
            .collect();
        if unseen.is_empty() || Instant::now() >= deadline {
            break unseen;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        unseen.is_empty(),
        "Envoy did not decode these requests' trailers (dropped by its HTTP/1 codec?): {unseen:?}"
    );
    let counters = stack.settled();
    counters.assert_eq("explicit", 8);
    counters.assert_eq("affinity_miss", 1);
    counters.assert_eq("learned", 1);
    counters.assert_eq("affinity_hit", 3);
    counters.assert_zero(&["no_key", "invalid_rank", "body_malformed"]);
}

// ---------------------------------------------------------------- 13. config

/// The filter follows Envoy's level for the `wasm` logger while it runs, as an operator turns
/// debug lines on and off through the admin port (`POST /logging?wasm=debug`): started at
/// `info`, no placement line is written; raised to `debug`, each request writes one, within a
/// tick of the change (a filter that read the level only at start would never log at debug).
#[test]
fn the_filters_log_level_follows_envoys_at_run_time() {
    let stack = Stack::start(
        "log_level_follows_envoy",
        StackOptions::new(plugin_config(json!({}))).wasm_log_level("info"),
    );
    // Requests sent after the level change (and a tick for the filter to read it), each with a
    // key of its own so its line can be found; the lines are in the log within a flush (100 ms).
    let count = || stack.envoy.log().matches("placed: ").count();
    let placed_lines = |label: &str| -> usize {
        std::thread::sleep(Duration::from_millis(1500));
        let before = count();
        for i in 0..8 {
            let response = stack.send(&keyed(&format!("{label}-{i}")));
            assert_eq!(response.status, 200, "{label}-{i}: {}", response.text());
        }
        std::thread::sleep(Duration::from_millis(500));
        count() - before
    };
    stack.envoy.set_log_level("wasm", "info");
    assert_eq!(
        placed_lines("quiet"),
        0,
        "requests at info wrote placement lines"
    );
    stack.envoy.set_log_level("wasm", "debug");
    assert_eq!(
        placed_lines("loud"),
        8,
        "one placement line per request at debug"
    );
    stack.envoy.set_log_level("wasm", "info");
    assert_eq!(
        placed_lines("quiet-again"),
        0,
        "back at info, lines still written"
    );
    // The quiet requests were placed all the same (the lines, not the work, were skipped).
    stack.assert_counter("learned", 24);
}

#[test]
fn bad_plugin_config_refused() {
    let dir = TestDir::new("bad_plugin_config_refused");
    let wasm = paths::wasm_path();
    let validate = |name: &str, plugin: Value| {
        let config = EnvoyConfig::new(vec![1, 2, 3, 4], Some(wasm.clone()), plugin);
        envoy::validate(&config, dir.path(), name)
    };

    let good = validate("good", json!({ "dp_size": 4 }));
    assert!(
        good.success,
        "a good config must validate:\n{}",
        good.output
    );

    let refused = [
        ("dp_size_zero", json!({ "dp_size": 0 }), "dp_size"),
        (
            "unknown_top",
            json!({ "dp_size": 4, "no_such_field": 1 }),
            "no_such_field",
        ),
        (
            "unknown_nested",
            json!({ "dp_size": 4, "table": { "bogus_knob": 1 } }),
            "bogus_knob",
        ),
        ("missing_dp_size", json!({}), "dp_size"),
    ];
    for (name, plugin, field) in refused {
        let outcome = validate(name, plugin);
        assert!(
            !outcome.success,
            "{name}: refused config validated:\n{}",
            outcome.output
        );
        assert!(
            outcome.output.lines().any(|l| l.contains(field)),
            "{name}: no line names {field}:\n{}",
            outcome.output
        );
    }
}

/// The shipped envoy/envoy.yaml must stay loadable with the filter under test. It
/// names the wasm relative to the repo root; point it at the artifact actually
/// tested (which may live under another CARGO_TARGET_DIR), nothing else changed.
#[test]
fn shipped_envoy_yaml_validates() {
    const SHIPPED_WASM: &str = "filename: target/wasm32-wasip1/release/dp_affinity.wasm";
    let dir = TestDir::new("shipped_envoy_yaml_validates");
    let shipped = std::fs::read_to_string(paths::repo_root().join("envoy/envoy.yaml"))
        .expect("read envoy/envoy.yaml");
    assert!(
        shipped.contains(SHIPPED_WASM),
        "envoy/envoy.yaml no longer has `{SHIPPED_WASM}`: update this test"
    );
    let tested = format!("filename: {}", paths::wasm_path().display());
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, shipped.replace(SHIPPED_WASM, &tested)).expect("write copy");
    let outcome = envoy::validate_file(&config);
    assert!(outcome.success, "envoy/envoy.yaml:\n{}", outcome.output);
}

// ---------------------------------------------------------------- without stop-iteration

/// Without `allow_on_headers_stop_iteration` the filter must be configured for
/// headers only (body field lists empty); header keys and ranks must then work
/// and nothing may hang.
#[test]
fn headers_only_without_stop_iteration() {
    let mut options = StackOptions::new(plugin_config(json!({
        "explicit_rank": { "body_fields": [] },
        "routing_key": { "body_fields": [] },
    })));
    options.allow_on_headers_stop_iteration = false;
    let stack = Stack::start("headers_only_without_stop_iteration", options);
    assert_sticky(&stack, "header key", &keyed("headers-only"), 5);
    let explicit = chat(json!({})).header(RANK_HEADER, "3");
    assert_eq!(ranks_for(&stack, &explicit, 3), vec![3; 3]);
    let response = stack.send(&chat(json!({ "routing_key": "ignored" })));
    echoed_rank(&response);
    stack.assert_counter("affinity_hit", 4);
    stack.assert_counter("explicit", 3);
}

// ---------------------------------------------------------------- echo header

/// The echoed rank is the filter's own answer, not the upstream's header passed through: with
/// `echo_header` renamed, the new header carries the serving rank on every path (balanced,
/// learned, pinned, explicit), and with it off no such header appears.
#[test]
fn echo_header_is_written_by_the_filter() {
    let stack = start("echo_header", json!({ "echo_header": "x-served-rank" }));
    let requests = [
        chat(json!({})),
        keyed("echo-key"),
        keyed("echo-key"),
        chat(json!({})).header(RANK_HEADER, "3"),
    ];
    for request in &requests {
        let response = stack.send(request);
        let served = mock_info(&response)["rank"]
            .as_u64()
            .expect("mock.rank")
            .to_string();
        assert_eq!(
            response.header_all("x-served-rank"),
            vec![served.as_str()],
            "echo header must carry the serving rank"
        );
    }
    stack.assert_counter("affinity_hit", 1);
    stack.assert_counter("explicit", 1);

    let off = start("echo_off", json!({ "echo_header": "" }));
    let response = off.send(&keyed("k"));
    assert_eq!(response.status, 200);
    assert!(response.header("x-served-rank").is_none());
    assert_eq!(
        response.header_all("x-dp-rank").len(),
        1,
        "the upstream's own x-dp-rank passes through untouched"
    );
}
