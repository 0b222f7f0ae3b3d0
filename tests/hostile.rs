//! Hostile inputs, end to end: the compiled filter in a real Envoy (2 workers) in
//! front of 4 mock ranks, fed bodies and headers a careless or malicious client
//! could send. Each scenario checks the status, which rank served (if any), that
//! the body reached the upstream byte for byte where it should, the filter's
//! counters, and at the end that the wasm VM is still healthy: no panic or failed
//! callback in Envoy's log, no VM reload or failure in Envoy's `wasm.*` stats, and a
//! keyed request that still sticks to one rank across both workers.
//!
//! Run after building the artifacts (`make build`):
//! `cargo test --test hostile -- --test-threads 2`.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use support::fnv::fnv1a64_hex;
use support::h2;
use support::http::{self, Client, RawOutcome, Request, Response};
use support::paths;
use support::requests::{chat, keyed, plugin_config, KEY_HEADER, RANK_HEADER};
use support::stack::{echoed_rank, mock_info, served_rank, Stack, StackOptions};

// ---------------------------------------------------------------- scenario set-up

/// A stack plus what its VM-health stats looked like once it served.
struct Scenario {
    stack: Stack,
    name: String,
    /// Envoy's own `wasm.*` stats right after start (VM counts, reloads).
    wasm_baseline: BTreeMap<String, u64>,
}

impl Scenario {
    fn start(name: &str, overrides: Value) -> Scenario {
        Scenario::with_options(name, StackOptions::new(plugin_config(overrides)))
    }

    fn with_options(name: &str, options: StackOptions) -> Scenario {
        let stack = Stack::start(name, options);
        let wasm_baseline = wasm_stats(&stack);
        Scenario {
            stack,
            name: name.to_string(),
            wasm_baseline,
        }
    }

    /// The last step of every scenario: the VMs survived what was thrown at them.
    fn assert_vm_healthy(&self) {
        assert_vm_healthy(&self.stack, &self.name, &self.wasm_baseline);
    }
}

impl std::ops::Deref for Scenario {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.stack
    }
}

/// Envoy's stats about the wasm VMs themselves (not the filter's `wasmcustom.*`).
/// Observed on Envoy 1.40.0:
/// `wasm.dp_affinity.vm_reload{,_backoff,_failure,_success}` (the plugin's VM
/// lifecycle), `wasm.envoy.wasm.runtime.v8.{active,created}` and
/// `wasm.wasm_vm_count` (live VMs), plus `wasm.remote_load_*`.
fn wasm_stats(stack: &Stack) -> BTreeMap<String, u64> {
    stack.envoy.stats("^wasm\\.")
}

/// Lines of Envoy's log that mean a VM failed: a Rust panic (the SDK's hook logs
/// `panicked at`), a callback that trapped (`Function: proxy_on_... failed`), or
/// any critical/error line of the wasm component.
fn vm_failure_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| {
            l.contains("panicked")
                || l.contains("Function: proxy_on_")
                || l.contains("wasm_vm failed")
                || ((l.contains("[critical]") || l.contains("[error]")) && l.contains("wasm"))
        })
        .map(|l| l.chars().take(400).collect())
        .collect()
}

/// What shows that a VM failed since `baseline`: failure lines in Envoy's log, and Envoy's
/// `wasm.*` stats of the VMs' lifecycle (a reload, a reload backoff, a failure, a VM lost or
/// recreated). Empty when the VMs are healthy.
fn vm_failure_signs(stack: &Stack, baseline: &BTreeMap<String, u64>) -> Vec<String> {
    let mut signs: Vec<String> = vm_failure_lines(&stack.envoy.log())
        .into_iter()
        .map(|line| format!("log: {line}"))
        .collect();
    let now = wasm_stats(stack);
    for (stat, value) in &now {
        if (stat.contains("vm_reload") || stat.contains("fail")) && *value != 0 {
            signs.push(format!("stat {stat} = {value}: the VM failed or reloaded"));
        }
    }
    for stat in [
        "wasm.envoy.wasm.runtime.v8.active",
        "wasm.envoy.wasm.runtime.v8.created",
        "wasm.wasm_vm_count",
    ] {
        assert!(now.contains_key(stat), "no stat {stat}: {now:#?}");
        if now.get(stat) != baseline.get(stat) {
            signs.push(format!(
                "stat {stat} {:?} -> {:?}: a VM was lost or recreated",
                baseline.get(stat),
                now.get(stat)
            ));
        }
    }
    signs
}

fn assert_vm_healthy(stack: &Stack, name: &str, baseline: &BTreeMap<String, u64>) {
    let log = stack.envoy.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("[warning]") && l.contains("wasm"))
        .collect();
    if !warnings.is_empty() {
        eprintln!(
            "[{name}] {} wasm warning line(s), first: {}",
            warnings.len(),
            warnings[0].chars().take(300).collect::<String>()
        );
    }
    let signs = vm_failure_signs(stack, baseline);
    assert!(
        signs.is_empty(),
        "[{name}] the wasm VM failed:\n{}",
        signs.join("\n")
    );
    // The VM still routes: a fresh key, on fresh connections spread over both
    // workers, sticks to the rank it learned (a failed VM fails closed: 503).
    let key = format!("sanity-{name}");
    let ranks: Vec<u32> = (0..8)
        .map(|_| served_rank(&stack.send(&keyed(&key))))
        .collect();
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "[{name}] sanity key moved between ranks after the scenario: {ranks:?}"
    );
}

// ---------------------------------------------------------------- helpers

const CHAT: &str = "/v1/chat/completions";

/// A raw body (not necessarily valid JSON) sent as `content_type`.
fn raw(content_type: &str, body: impl Into<Vec<u8>>) -> Request {
    Request::post(CHAT).body(content_type, body.into())
}

fn json_raw(body: impl Into<Vec<u8>>) -> Request {
    raw("application/json", body)
}

/// Asserts the upstream received exactly `body`.
fn assert_body_reached(response: &Response, body: &[u8], label: &str) {
    assert_eq!(
        response.status,
        200,
        "{label}: status {} {:?}",
        response.status,
        response.text()
    );
    let info = mock_info(response);
    assert_eq!(
        info["body_len"],
        json!(body.len()),
        "{label}: body length changed on the way upstream"
    );
    assert_eq!(
        info["body_fnv1a64"].as_str().map(str::to_ascii_lowercase),
        Some(fnv1a64_hex(body)),
        "{label}: body bytes changed on the way upstream"
    );
}

/// Sends `request` `turns` times on fresh connections; asserts one rank served
/// them all and the body arrived intact each time. Returns the rank.
fn assert_sticky(stack: &Stack, label: &str, request: &Request, turns: usize) -> u32 {
    let ranks: Vec<u32> = (0..turns)
        .map(|_| {
            let response = stack.send(request);
            assert_body_reached(&response, &request.body, label);
            served_rank(&response)
        })
        .collect();
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "{label}: key moved between ranks: {ranks:?}"
    );
    ranks[0]
}

/// Envoy's connection-manager stat `http.ingress_http.<name>`. Envoy defines these
/// with the connection manager and updates them at once (no flush to wait for), so
/// a name it does not show is a mistake in the test.
fn ingress_stat(stack: &Stack, name: &str) -> u64 {
    let full = format!("http.ingress_http.{name}");
    let stats = stack.envoy.stats(name);
    stats
        .get(&full)
        .copied()
        .unwrap_or_else(|| panic!("Envoy shows no {full}; matching stats: {stats:#?}"))
}

/// Asserts `response` is the filter's 400 for an invalid explicit rank in `param`.
fn assert_invalid_rank(response: &Response, param: &str, label: &str) -> Value {
    assert_eq!(
        response.status,
        400,
        "{label}: expected 400, got {} {:?}",
        response.status,
        response.text()
    );
    let content_type = response.header("content-type").unwrap_or("");
    assert!(
        content_type.starts_with("application/json"),
        "{label}: content-type {content_type:?}"
    );
    let body = response.json();
    assert_eq!(body["error"]["param"], json!(param), "{label}: {body}");
    assert_eq!(
        body["error"]["code"],
        json!("invalid_data_parallel_rank"),
        "{label}: {body}"
    );
    assert_eq!(
        body["error"]["type"],
        json!("invalid_request_error"),
        "{label}: {body}"
    );
    body
}

/// The response of a raw exchange, which must have completed.
fn complete(outcome: RawOutcome, label: &str) -> Response {
    let RawOutcome {
        response,
        received,
        write_error,
        read_error,
    } = outcome;
    response.unwrap_or_else(|| {
        panic!(
            "{label}: no complete response (write error {write_error:?}, read error {read_error:?}); received {:?}",
            String::from_utf8_lossy(&received)
        )
    })
}

/// A JSON body of `total` bytes: `{"routing_key":..., "model":"m", "messages":[...]}`
/// with the key first and the prompt padded to size.
fn padded_body(key: &str, total: usize) -> Vec<u8> {
    let head =
        format!(r#"{{"routing_key":"{key}","model":"m","messages":[{{"role":"user","content":""#);
    let tail = r#""}]}"#;
    let pad = total - head.len() - tail.len();
    let mut body = head.into_bytes();
    body.extend(std::iter::repeat_n(b'x', pad));
    body.extend_from_slice(tail.as_bytes());
    assert_eq!(body.len(), total);
    body
}

// ---------------------------------------------------------------- 1. over the filter's limit

/// `body.max_bytes` 4096 and a 100 KiB body whose very first field is the key:
/// the filter does not buffer past its limit, so the key is not read (no pin),
/// and the whole body still reaches the upstream intact. Content-length bodies
/// are skipped at the headers; chunked ones (no length) when they outgrow it.
#[test]
fn body_over_filter_limit_passes_through() {
    let s = Scenario::start(
        "body_over_filter_limit",
        json!({ "body": { "max_bytes": 4096 } }),
    );
    let body = padded_body("too-big-key", 100 * 1024);
    let request = json_raw(body.clone());

    // With content-length, on fresh connections.
    for turn in 0..2 {
        let response = s.send(&request);
        assert_body_reached(&response, &body, &format!("content-length #{turn}"));
        served_rank(&response);
    }
    // Chunked (no content-length), 8 KiB chunks, with and without pauses
    // between chunks so the filter sees the body grow in several callbacks.
    let splits: Vec<usize> = (1..13).map(|i| i * 8192).collect();
    let mut client = Client::new(s.addr());
    for gap in [Duration::ZERO, Duration::from_millis(20)] {
        let pieces = request.chunked_pieces(&splits, false);
        let response = client.send_pieces(&pieces, gap, "POST");
        assert_body_reached(&response, &body, &format!("chunked, gap {gap:?}"));
        served_rank(&response);
    }
    let counters = s.settled();
    counters.assert_eq("body_too_large", 4);
    // Not read, so not pinned: no key decision was made at all.
    counters.assert_zero(&["affinity_miss", "affinity_hit", "learned", "no_key"]);
    // The same key in a small body is new to the table.
    let small = json_raw(r#"{"routing_key":"too-big-key","model":"m"}"#);
    assert_sticky(&s, "small body, same key", &small, 3);
    s.assert_counter("affinity_miss", 1);
    s.assert_counter("affinity_hit", 2);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 2. over Envoy's limit

/// Envoy's buffer limit (listener `per_connection_buffer_limit_bytes` 64 KiB)
/// below the filter's `body.max_bytes` (1 MiB), a misconfiguration the README
/// warns about: the filter pauses to read a 512 KiB JSON body, Envoy's buffer
/// overflows and Envoy itself answers. Observed on Envoy 1.40.0, with
/// content-length and chunked alike: `HTTP/1.1 413 Payload Too Large`, body
/// `Payload Too Large`, then Envoy resets the connection (the client reads the
/// whole answer, then ECONNRESET); Envoy counts
/// `http.ingress_http.downstream_rq_too_large` and logs the request with the
/// all-ranks cluster (the route matched before the filter chose) and no upstream
/// host. No upstream sees it, the filter counts nothing for it (its decision was
/// still pending) and the VM is unaffected. Bodies under 64 KiB still route.
#[test]
fn body_over_envoy_buffer_limit_is_413() {
    const ENVOY_LIMIT: u32 = 64 * 1024;
    let s = Scenario::with_options(
        "body_over_envoy_limit",
        StackOptions::new(plugin_config(json!({ "body": { "max_bytes": 1 << 20 } })))
            .buffer_limit(ENVOY_LIMIT),
    );
    let body = padded_body("envoy-limit-key", 512 * 1024);
    let request = json_raw(body.clone());

    let with_length = http::send_raw(s.addr(), request.encode(true), "POST");
    let status_line = with_length.status_line();
    eprintln!(
        "content-length 512 KiB over a 64 KiB buffer: {status_line:?} (write error {:?}, read error {:?}) body {:?}",
        with_length.write_error,
        with_length.read_error,
        with_length.response.as_ref().map(Response::text)
    );
    let response = complete(with_length, "content-length over Envoy's limit");
    assert_eq!(
        response.status,
        413,
        "{status_line:?} {:?}",
        response.text()
    );
    assert_eq!(response.text(), "Payload Too Large");

    let mut chunked_bytes = Vec::new();
    let splits: Vec<usize> = (1..64).map(|i| i * 8192).collect();
    for piece in request.chunked_pieces(&splits, true) {
        chunked_bytes.extend(piece);
    }
    let chunked = http::send_raw(s.addr(), chunked_bytes, "POST");
    let status_line = chunked.status_line();
    eprintln!(
        "chunked 512 KiB over a 64 KiB buffer: {status_line:?} (write error {:?}, read error {:?}) body {:?}",
        chunked.write_error,
        chunked.read_error,
        chunked.response.as_ref().map(Response::text)
    );
    let response = complete(chunked, "chunked over Envoy's limit");
    assert_eq!(
        response.status,
        413,
        "{status_line:?} {:?}",
        response.text()
    );

    // No upstream saw either request, and the filter decided nothing for them.
    for rank in 0..4 {
        let stats = s.stack.mocks[rank].stats();
        let requests = stats["per_rank"][0]["requests"]
            .as_u64()
            .unwrap_or_else(|| panic!("mock stats without requests: {stats}"));
        assert_eq!(
            requests, 0,
            "rank {rank} received an over-limit request: {stats}"
        );
    }
    s.settled().assert_zero(&[
        "affinity_miss",
        "no_key",
        "body_too_large",
        "body_malformed",
    ]);
    let access_log = s.envoy.access_log();
    let refused: Vec<&str> = access_log.lines().filter(|l| l.contains(" 413 ")).collect();
    eprintln!("access log of the 413s:\n{}", refused.join("\n"));
    // Envoy counts them as its own refusals; the route had matched (all-ranks
    // cluster, since the filter had not chosen one yet) but no upstream host.
    assert_eq!(refused.len(), 2, "access log: {access_log}");
    assert!(refused.iter().all(|l| l.contains("host=-")), "{refused:?}");
    assert_eq!(
        ingress_stat(&s, "downstream_rq_too_large"),
        2,
        "Envoy's buffer-overflow counter"
    );
    // Under Envoy's limit the body is read and the key routes.
    let fits = json_raw(padded_body("fits-key", 48 * 1024));
    assert_sticky(&s, "48 KiB body under the buffer limit", &fits, 3);
    s.assert_counter("affinity_miss", 1);
    s.assert_counter("affinity_hit", 2);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 3. malformed JSON

/// Bodies labelled JSON that are not a JSON object: served through Envoy's
/// balancer, counted in `body_malformed`, passed upstream byte for byte. Most
/// carry a key early, so a scanner that acted on a prefix would pin it.
#[test]
fn malformed_json_falls_back() {
    let s = Scenario::start("malformed_json", json!({}));
    let cases: &[(&str, &[u8])] = &[
        (
            "truncated mid-string",
            br#"{"model":"m","routing_key":"conv-trunc"#,
        ),
        (
            "truncated mid-key",
            br#"{"routing_key":"k1","model":"m","rout"#,
        ),
        ("truncated after colon", br#"{"routing_key":"k2","model":"#),
        (
            "trailing garbage",
            br#"{"routing_key":"k3","model":"m"} xyz"#,
        ),
        (
            "second object",
            br#"{"routing_key":"k4"}{"routing_key":"k5"}"#,
        ),
        ("extra closing brace", br#"{"routing_key":"k6"}}"#),
        ("missing value", br#"{"routing_key":}"#),
        ("missing colon", br#"{"routing_key" "k7"}"#),
        ("trailing comma", br#"{"routing_key":"k8",}"#),
        ("single quotes", br#"{'routing_key':'k9'}"#),
        ("bad escape", br#"{"routing_key":"k\x10"}"#),
        (
            "bad number",
            br#"{"routed_dp_rank":01,"routing_key":"k10"}"#,
        ),
        ("bare array", br#"["routing_key","k11"]"#),
        ("bare string", br#""routing_key""#),
        ("bare number", b"42"),
        ("lone brace", b"{"),
        ("whitespace only", b" \r\n\t "),
        ("binary", b"\x00\xff\xfe{\"routing_key\":\"k12\"}"),
        ("NUL after object", b"{\"routing_key\":\"k13\"}\x00"),
    ];
    let mut client = Client::new(s.addr());
    for (label, body) in cases {
        let response = client.send(&json_raw(body.to_vec()));
        assert_body_reached(&response, body, label);
        served_rank(&response);
    }
    // Chunked uploads of the same bodies reach the filter the other way.
    for (label, body) in cases.iter().take(4) {
        let pieces = json_raw(body.to_vec()).chunked_pieces(&[body.len() / 2], false);
        let response = client.send_pieces(&pieces, Duration::ZERO, "POST");
        assert_body_reached(&response, body, &format!("{label}, chunked"));
    }
    let malformed = (cases.len() + 4) as u64;
    let counters = s.settled();
    counters.assert_eq("body_malformed", malformed);
    counters.assert_zero(&["affinity_miss", "learned", "invalid_rank", "no_key"]);

    // An empty body labelled JSON: with `content-length: 0` Envoy ends the stream
    // at the headers, so there is no body to read (counted `no_key`, not
    // malformed). A chunked upload with no data chunk does reach the body
    // callback with zero bytes: that is not a JSON object, so it is malformed.
    let empty = json_raw(Vec::new());
    let response = client.send(&empty);
    assert_body_reached(&response, b"", "empty, content-length 0");
    s.assert_counter("no_key", 1);
    let response = client.send_pieces(&empty.chunked_pieces(&[], false), Duration::ZERO, "POST");
    assert_body_reached(&response, b"", "empty, chunked");
    let counters = s.settled();
    counters.assert_eq("body_malformed", malformed + 1);
    counters.assert_eq("no_key", 1);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 4. deep nesting

/// 100,000 nested brackets in a field before the key: the scanner skips them
/// without recursion and routes by the key after them (sticky). The same depth
/// left unclosed is malformed.
#[test]
fn deep_nesting() {
    const DEPTH: usize = 100_000;
    let s = Scenario::start("deep_nesting", json!({}));
    let mut arrays = br#"{"model":"m","junk":"#.to_vec();
    arrays.extend(std::iter::repeat_n(b'[', DEPTH));
    arrays.extend(std::iter::repeat_n(b']', DEPTH));
    arrays.extend_from_slice(br#","routing_key":"deep-arrays"}"#);
    let arrays = json_raw(arrays);
    assert_sticky(&s, "100k nested arrays", &arrays, 3);

    // Alternating objects and arrays: {"a":[{"a":[ ... ]}]}
    let mut mixed = br#"{"model":"m","junk":"#.to_vec();
    for _ in 0..DEPTH / 2 {
        mixed.extend_from_slice(br#"{"a":["#);
    }
    for _ in 0..DEPTH / 2 {
        mixed.extend_from_slice(b"]}");
    }
    mixed.extend_from_slice(br#","routing_key":"deep-mixed"}"#);
    let mixed = json_raw(mixed);
    assert_sticky(&s, "100k nested objects/arrays", &mixed, 3);

    s.assert_counter("affinity_miss", 2);
    s.assert_counter("learned", 2);
    s.assert_counter("affinity_hit", 4);

    let mut unclosed = br#"{"routing_key":"never","junk":"#.to_vec();
    unclosed.extend(std::iter::repeat_n(b'[', DEPTH));
    let response = s.send(&json_raw(unclosed.clone()));
    assert_body_reached(&response, &unclosed, "100k unclosed brackets");
    // Closed one level short, then the key: still malformed.
    let mut short = br#"{"model":"m","junk":"#.to_vec();
    short.extend(std::iter::repeat_n(b'[', DEPTH));
    short.extend(std::iter::repeat_n(b']', DEPTH - 1));
    short.extend_from_slice(br#","routing_key":"short"}"#);
    let response = s.send(&json_raw(short.clone()));
    assert_body_reached(&response, &short, "one bracket unclosed");
    let counters = s.settled();
    counters.assert_eq("body_malformed", 2);
    counters.assert_eq("affinity_miss", 2);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 5. JSON types

/// Every JSON type in the key and rank fields. Keys come only from non-empty
/// strings (anything else is as if absent, and the next key field is tried);
/// ranks route only as integers in range, JSON null is absent, everything else
/// is a 400 naming the field.
#[test]
fn field_value_types() {
    let s = Scenario::start("field_value_types", json!({}));
    let long = format!("\"{}\"", "L".repeat(100 * 1024));
    let not_keys = [
        "null",
        "true",
        "false",
        "0",
        "1",
        "1.5",
        "-1",
        "1e3",
        "[]",
        "[\"k\"]",
        "{}",
        "{\"k\":\"v\"}",
        "\"\"",
    ];
    for value in not_keys {
        let body = format!(r#"{{"model":"m","routing_key":{value}}}"#);
        let response = s.send(&json_raw(body.clone()));
        assert_body_reached(&response, body.as_bytes(), &format!("routing_key {value}"));
        served_rank(&response);
    }
    let counters = s.settled();
    counters.assert_eq("no_key", not_keys.len() as u64);
    counters.assert_zero(&["affinity_miss"]);

    // A non-string key field yields to the next configured field.
    let next = json_raw(r#"{"routing_key":1,"prompt_cache_key":{},"user":"the-user"}"#);
    let by_user = assert_sticky(&s, "user after non-string fields", &next, 2);
    let user_only = json_raw(r#"{"user":"the-user"}"#);
    assert_eq!(assert_sticky(&s, "user alone", &user_only, 1), by_user);

    let string_key = json_raw(r#"{"model":"m","routing_key":"s"}"#);
    assert_sticky(&s, "routing_key \"s\"", &string_key, 3);
    let long_key = json_raw(format!(r#"{{"model":"m","routing_key":{long}}}"#));
    assert_sticky(&s, "routing_key of 100 KiB", &long_key, 3);
    let counters = s.settled();
    counters.assert_eq("affinity_miss", 3);
    counters.assert_eq("affinity_hit", 1 + 1 + 2 + 2);
    counters.assert_eq("key_too_long", 3);
    counters.assert_eq("no_key", not_keys.len() as u64);

    // Ranks: integers in range route (and do not touch the table).
    for (value, rank) in [("0", 0), ("1", 1), ("3", 3)] {
        for field in ["routed_dp_rank", "data_parallel_rank"] {
            let body = format!(r#"{{"model":"m","{field}":{value}}}"#);
            let response = s.send(&json_raw(body.clone()));
            assert_body_reached(&response, body.as_bytes(), &format!("{field} {value}"));
            assert_eq!(served_rank(&response), rank, "{field} {value}");
        }
    }
    s.assert_counter("explicit", 6);
    // JSON null is absent: the request is routed as if the field were not there.
    let null_rank = json_raw(r#"{"model":"m","routed_dp_rank":null,"routing_key":"s"}"#);
    let s_rank = assert_sticky(&s, "routed_dp_rank null, key s", &null_rank, 1);
    assert_eq!(
        s_rank,
        assert_sticky(&s, "key s", &string_key, 1),
        "a null rank must not change where the key goes"
    );
    let null_only = json_raw(r#"{"model":"m","data_parallel_rank":null}"#);
    served_rank(&s.send(&null_only));
    let counters = s.settled();
    counters.assert_eq("explicit", 6);
    counters.assert_eq("no_key", not_keys.len() as u64 + 1);

    let invalid = [
        "true",
        "false",
        "1.5",
        "1.0",
        "1e0",
        "-1",
        "4",
        "18446744073709551616",
        "\"1\"",
        "\"s\"",
        "\"\"",
        "[]",
        "[1]",
        "{}",
        "{\"rank\":1}",
    ];
    let mut rejected = 0;
    for field in ["routed_dp_rank", "data_parallel_rank"] {
        for value in invalid.iter().copied().chain([long.as_str()]) {
            let label = format!("{field} {}", &value[..value.len().min(24)]);
            let body = format!(r#"{{"model":"m","{field}":{value}}}"#);
            let response = s.send(&json_raw(body));
            let error = assert_invalid_rank(&response, field, &label);
            // The message quotes the client's value, but never a whole 100 KiB of it.
            assert!(
                response.body.len() < 1024,
                "{label}: error body of {} bytes: {error}",
                response.body.len()
            );
            rejected += 1;
        }
    }
    // `-0` is JSON's other spelling of 0: Python reads the int 0, and so does the filter.
    let minus_zero = json_raw(r#"{"model":"m","routed_dp_rank":-0}"#);
    assert_eq!(served_rank(&s.send(&minus_zero)), 0);
    let counters = s.settled();
    counters.assert_eq("invalid_rank", rejected);
    counters.assert_eq("explicit", 7);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 6. header bytes and sizes

/// Header values that are not UTF-8 (raw 0x80..=0xFF), sent on a raw socket:
/// Envoy passes them (obs-text), the filter hashes a key's bytes as they are and
/// answers an undecodable rank with its 400. Oversized headers: Envoy's own
/// `max_request_headers_kb` (default 60 KiB) answers `431 Request Header Fields
/// Too Large` before the filter runs; a 32 KiB key header is under it, so it is
/// used (sticky) and counted `key_too_long`.
#[test]
fn header_bytes_and_sizes() {
    let s = Scenario::start("header_bytes_and_sizes", json!({}));
    let high: Vec<u8> = (0x80..=0xFFu8).collect();
    let body = br#"{"model":"m"}"#;

    let mut key = b"bin-".to_vec();
    key.extend_from_slice(&high);
    let keyed_raw = http::raw_request(CHAT, &[(KEY_HEADER, &key)], body);
    let mut ranks = Vec::new();
    for turn in 0..3 {
        let outcome = http::send_raw(s.addr(), keyed_raw.clone(), "POST");
        let response = complete(outcome, &format!("non-UTF-8 key #{turn}"));
        assert_body_reached(&response, body, "non-UTF-8 key");
        ranks.push(served_rank(&response));
    }
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "non-UTF-8 key moved: {ranks:?}"
    );
    s.assert_counter("affinity_miss", 1);
    s.assert_counter("affinity_hit", 2);

    let rank_raw = http::raw_request(CHAT, &[(RANK_HEADER, &high)], body);
    let response = complete(http::send_raw(s.addr(), rank_raw, "POST"), "non-UTF-8 rank");
    let error = assert_invalid_rank(&response, RANK_HEADER, "non-UTF-8 rank header");
    eprintln!("non-UTF-8 rank header answered: {error}");
    let mut digit_then_high = b"1".to_vec();
    digit_then_high.push(0xFF);
    let rank_raw = http::raw_request(CHAT, &[(RANK_HEADER, &digit_then_high)], body);
    let response = complete(http::send_raw(s.addr(), rank_raw, "POST"), "1\\xff rank");
    assert_invalid_rank(&response, RANK_HEADER, "rank header 1\\xff");
    s.assert_counter("invalid_rank", 2);

    // A 32 KiB key header: accepted by Envoy, used whole, counted too long.
    let big_key = "K".repeat(32 * 1024);
    let big = chat(json!({})).header(KEY_HEADER, &big_key);
    assert_sticky(&s, "32 KiB key header", &big, 3);
    s.assert_counter("affinity_miss", 2);
    s.assert_counter("affinity_hit", 4);
    s.assert_counter("key_too_long", 3);

    // 64 KiB header values: over Envoy's default 60 KiB of request headers.
    let huge = vec![b'H'; 64 * 1024];
    for header in [KEY_HEADER, RANK_HEADER] {
        let outcome = http::send_raw(
            s.addr(),
            http::raw_request(CHAT, &[(header, &huge)], body),
            "POST",
        );
        let status_line = outcome.status_line();
        eprintln!(
            "64 KiB {header}: {status_line:?} (write error {:?}, read error {:?}) body {:?}",
            outcome.write_error,
            outcome.read_error,
            outcome.response.as_ref().map(Response::text)
        );
        let response = complete(outcome, &format!("64 KiB {header}"));
        assert_eq!(response.status, 431, "64 KiB {header}: {status_line:?}");
        assert_eq!(response.text(), "Request Header Fields Too Large");
    }
    // Envoy refused them before any filter ran: no counter moved (once every VM flushed).
    let counters = s.settled();
    let access_log = s.envoy.access_log();
    let refused: Vec<&str> = access_log.lines().filter(|l| l.contains(" 431 ")).collect();
    eprintln!("access log of the 431s:\n{}", refused.join("\n"));
    // A codec-level refusal: no stream, so no access log line and no filter
    // callback; Envoy counts a protocol error per connection.
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(ingress_stat(&s, "downstream_cx_protocol_error"), 2);
    counters.assert_eq("affinity_miss", 2);
    counters.assert_eq("invalid_rank", 2);
    counters.assert_eq("key_too_long", 3);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 7. duplicate headers

/// Repeated headers. Envoy hands the filter every copy as a separate entry (it
/// does not join them). Two rank headers that disagree are a 400; the same
/// value twice routes. Two key headers: the first copy is the key (the second
/// is ignored), so the conversation continues with a request carrying only the
/// first; an empty first copy is skipped. `x-smg-routing-key` outranks
/// `x-routing-key` whatever their order.
#[test]
fn duplicate_and_conflicting_headers() {
    let s = Scenario::start("duplicate_headers", json!({}));
    let conflicting = chat(json!({}))
        .header(RANK_HEADER, "1")
        .header(RANK_HEADER, "2");
    let response = s.send(&conflicting);
    let error = assert_invalid_rank(&response, RANK_HEADER, "rank 1 and rank 2");
    eprintln!("two rank headers 1, 2 answered: {error}");
    // The filter saw two entries, not one value "1,2" joined by Envoy.
    let message = error["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("several times"), "{error}");
    let joined = s.send(&chat(json!({})).header(RANK_HEADER, "1,2"));
    let error = assert_invalid_rank(&joined, RANK_HEADER, "rank \"1,2\"");
    let message = error["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains(r#"got "1,2""#), "{error}");

    let same = chat(json!({}))
        .header(RANK_HEADER, "2")
        .header(RANK_HEADER, "2");
    for _ in 0..3 {
        let response = s.send(&same);
        assert_eq!(served_rank(&response), 2, "rank 2 sent twice");
    }
    s.assert_counter("invalid_rank", 2);
    s.assert_counter("explicit", 3);

    // Find a first key and a second key pinned to different ranks, so which one
    // the filter used is visible in the serving rank.
    let first_rank = assert_sticky(&s, "dup-first", &keyed("dup-first"), 2);
    let mut keys_learned = 1;
    let second = (0..40)
        .map(|i| format!("dup-second-{i}"))
        .find(|key| {
            keys_learned += 1;
            assert_sticky(&s, key, &keyed(key), 2) != first_rank
        })
        .expect("no second key on another rank in 40 tries");
    s.assert_counter("affinity_miss", keys_learned);
    s.assert_counter("affinity_hit", keys_learned);
    let both = chat(json!({}))
        .header(KEY_HEADER, "dup-first")
        .header(KEY_HEADER, &second);
    for _ in 0..4 {
        assert_eq!(
            served_rank(&s.send(&both)),
            first_rank,
            "first key header must win"
        );
    }
    let reversed = chat(json!({}))
        .header(KEY_HEADER, &second)
        .header(KEY_HEADER, "dup-first");
    assert_ne!(
        served_rank(&s.send(&reversed)),
        first_rank,
        "first copy decides"
    );
    let empty_first = chat(json!({}))
        .header(KEY_HEADER, "")
        .header(KEY_HEADER, "dup-first");
    assert_eq!(
        served_rank(&s.send(&empty_first)),
        first_rank,
        "empty copy skipped"
    );
    // Both key header names: x-smg-routing-key (listed first) wins in any order.
    let alt_first = chat(json!({}))
        .header("x-routing-key", &second)
        .header(KEY_HEADER, "dup-first");
    assert_eq!(
        served_rank(&s.send(&alt_first)),
        first_rank,
        "x-smg-routing-key wins"
    );
    // Every one of those was a hit on an existing pin: no new key appeared.
    let counters = s.settled();
    counters.assert_eq("affinity_hit", keys_learned + 4 + 1 + 1 + 1);
    counters.assert_eq("affinity_miss", keys_learned);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 8. lying content types

/// The content type decides whether the body is read, not what the body looks
/// like: JSON-labelled garbage is malformed (passed through), JSON labelled
/// text/plain is not read, and the media type matches case-insensitively with
/// parameters ignored.
#[test]
fn lying_content_type() {
    let s = Scenario::start("lying_content_type", json!({}));
    let garbage = b"routing_key=form-encoded&model=m".to_vec();
    let response = s.send(&raw("application/json", garbage.clone()));
    assert_body_reached(&response, &garbage, "json label, form body");
    s.assert_counter("body_malformed", 1);

    let json_body = br#"{"model":"m","routing_key":"text-plain-key"}"#.to_vec();
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/jsonx",
    ] {
        let response = s.send(&raw(content_type, json_body.clone()));
        assert_body_reached(&response, &json_body, content_type);
    }
    let counters = s.settled();
    counters.assert_eq("no_key", 3);
    counters.assert_zero(&["affinity_miss"]);

    for (i, content_type) in [
        "Application/JSON; charset=utf-8",
        "APPLICATION/JSON",
        "application/json ; charset=\"utf-8\"",
    ]
    .into_iter()
    .enumerate()
    {
        let body = format!(r#"{{"model":"m","routing_key":"content-type-{i}"}}"#);
        assert_sticky(&s, content_type, &raw(content_type, body), 2);
    }
    let counters = s.settled();
    counters.assert_eq("affinity_miss", 3);
    counters.assert_eq("affinity_hit", 3);
    counters.assert_eq("no_key", 3);
    counters.assert_eq("body_malformed", 1);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 9. split chunks

/// The body `{"model":"m","routing_key":"conv-split"}` uploaded as two HTTP
/// chunks, split at every byte offset (one request per offset on a keep-alive
/// connection; once back to back, once with a 15 ms pause between the chunks so
/// they reach the filter in separate callbacks): every one lands on the rank the
/// unsplit request was pinned to.
#[test]
fn chunks_split_at_every_offset() {
    let s = Scenario::start("chunks_split", json!({}));
    let body = br#"{"model":"m","routing_key":"conv-split"}"#.to_vec();
    let request = json_raw(body.clone());
    let rank = assert_sticky(&s, "unsplit", &request, 1);

    let mut client = Client::new(s.addr());
    let mut requests = 0;
    for gap in [Duration::ZERO, Duration::from_millis(15)] {
        for offset in 1..body.len() {
            let pieces = request.chunked_pieces(&[offset], false);
            assert_eq!(pieces.len(), 2);
            let response = client.send_pieces(&pieces, gap, "POST");
            let label = format!(
                "split at {offset} ({:?}|{:?}), gap {gap:?}",
                String::from_utf8_lossy(&body[..offset]),
                String::from_utf8_lossy(&body[offset..])
            );
            assert_body_reached(&response, &body, &label);
            assert_eq!(served_rank(&response), rank, "{label}");
            requests += 1;
        }
    }
    // Many small chunks too: one byte per chunk.
    let every: Vec<usize> = (1..body.len()).collect();
    let response = client.send_pieces(
        &request.chunked_pieces(&every, false),
        Duration::ZERO,
        "POST",
    );
    assert_body_reached(&response, &body, "one byte per chunk");
    assert_eq!(served_rank(&response), rank, "one byte per chunk");
    requests += 1;

    let counters = s.settled();
    counters.assert_eq("affinity_miss", 1);
    counters.assert_eq("affinity_hit", requests);
    counters.assert_zero(&["body_malformed"]);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 10. key flood

/// A flood of distinct keys against a small table (256 buckets × 4 ways = 1,024
/// entries) from 16 keep-alive connections: the table stays bounded (every key
/// past the first 1,024 evicts one), keys sent after it are still pinned, and
/// concurrent writers from both workers do not exhaust their CAS retries.
#[test]
fn flood_of_distinct_keys() {
    // 100,000 keys: about 15-25 s on a 2-core machine running the whole file.
    const KEYS: usize = 100_000;
    const CONNECTIONS: usize = 16;
    const ENTRIES: u64 = 256 * 4;
    // Sent one by one once the flood is over. A key is evicted only by 4 later keys landing in
    // its bucket of 256: never within 8 (the connections' own last keys were checked before,
    // but a connection the scheduler held back sends its last keys hundreds of keys before the
    // end, and 4 of those can share a bucket).
    const LAST: usize = 8;
    let s = Scenario::start(
        "flood_of_distinct_keys",
        json!({ "table": { "buckets": 256, "ways": 4 } }),
    );
    let template = Request::post(CHAT).json(&json!({ "model": "m" }));
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..CONNECTIONS {
            scope.spawn(|| {
                let mut client = Client::new(s.addr());
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= KEYS {
                        return;
                    }
                    let key = format!("flood-{i}");
                    let response = client.send(&template.clone().header(KEY_HEADER, &key));
                    assert_eq!(response.status, 200, "{key}: {:?}", response.text());
                    echoed_rank(&response);
                }
            });
        }
    });
    let elapsed = started.elapsed();
    eprintln!(
        "flood: {KEYS} keys over {CONNECTIONS} connections in {elapsed:?} ({:.0} req/s)",
        KEYS as f64 / elapsed.as_secs_f64()
    );
    let mut client = Client::new(s.addr());
    let recent: Vec<(String, u32)> = (0..LAST)
        .map(|i| {
            let key = format!("flood-last-{i}");
            let response = client.send(&template.clone().header(KEY_HEADER, &key));
            assert_eq!(response.status, 200, "{key}: {:?}", response.text());
            (key, echoed_rank(&response))
        })
        .collect();
    let sent = (KEYS + LAST) as u64;
    // Pins are written when the response arrives, after the miss was counted: both are in by
    // the time every VM has flushed.
    let counters = s.settled();
    counters.assert_eq("affinity_miss", sent);
    counters.assert_zero(&["affinity_hit"]);
    eprintln!(
        "flood: cas_retries {}, cas_exhausted {}",
        counters.get("cas_retries"),
        counters.get("cas_exhausted")
    );
    counters.assert_zero(&["cas_exhausted"]);
    counters.assert_eq("learned", sent);
    // Each bucket received ~390 keys: all full, so every pin past the first
    // 1,024 evicted exactly one live entry.
    counters.assert_eq("evictions", sent - ENTRIES);

    // The keys sent last are still resident, on their rank.
    let moved: Vec<String> = recent
        .iter()
        .filter_map(|(key, rank)| {
            let again = echoed_rank(&client.send(&template.clone().header(KEY_HEADER, key)));
            (again != *rank).then(|| format!("{key}: {rank} -> {again}"))
        })
        .collect();
    assert!(moved.is_empty(), "recent keys lost their pin: {moved:?}");
    let counters = s.settled();
    counters.assert_eq("affinity_hit", recent.len() as u64);
    counters.assert_eq("affinity_miss", sent);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- 11. HTTP/1.1 and HTTP/2

/// The same conversation over HTTP/1.1 and over h2c (curl with prior knowledge)
/// is one conversation: the key lands on one rank whichever protocol carries it
/// (header or body), explicit ranks work over HTTP/2, and an invalid one gets
/// the same 400 JSON (see below for why the header case carries no body).
#[test]
fn http1_and_http2_agree() {
    h2::require_curl_http2();
    let s = Scenario::start("http1_and_http2", json!({}));
    let h2 = |request: &Request| {
        let answer = h2::send_h2c(s.addr(), request, s.dir.path());
        assert_eq!(answer.protocol, "HTTP/2", "curl did not speak HTTP/2");
        answer.response
    };

    // Header key: first turn over HTTP/1.1, next turns over HTTP/2.
    let by_header = keyed("proto-header");
    let rank = assert_sticky(&s, "h1 header key", &by_header, 1);
    for _ in 0..3 {
        let response = h2(&by_header);
        assert_body_reached(&response, &by_header.body, "h2 header key");
        assert_eq!(served_rank(&response), rank, "h2 turn of an h1-learned key");
    }
    // Body key: first turn over HTTP/2 (the body is read from DATA frames).
    let by_body = chat(json!({ "routing_key": "proto-body" }));
    let first = h2(&by_body);
    assert_body_reached(&first, &by_body.body, "h2 body key");
    let rank = served_rank(&first);
    assert_eq!(
        assert_sticky(&s, "h1 body key", &by_body, 3),
        rank,
        "h1 after h2"
    );
    assert_eq!(served_rank(&h2(&by_body)), rank, "h2 again");
    s.assert_counter("affinity_miss", 2);
    s.assert_counter("affinity_hit", 3 + 3 + 1);

    // Explicit ranks over HTTP/2: header and body.
    let response = h2(&chat(json!({})).header(RANK_HEADER, "3"));
    assert_eq!(served_rank(&response), 3, "h2 rank header");
    let response = h2(&chat(json!({ "routed_dp_rank": 1 })));
    assert_eq!(served_rank(&response), 1, "h2 rank field");
    s.assert_counter("explicit", 2);

    // Invalid ranks over HTTP/2: the same 400 JSON as over HTTP/1.1. The header
    // case is sent without a body: a reply given at the headers while the
    // request's DATA is still in flight is followed by Envoy resetting the
    // stream, and curl 7.88 then sometimes fails the transfer ("(92) Stream
    // error in the HTTP/2 framing layer", about 1 in 5-30 tries) without
    // showing the answer. Envoy's own router reply in the same spot (unknown
    // cluster, no filter) does the same, so it is not the filter's doing.
    let h2_error = assert_invalid_rank(
        &h2(&Request::post(CHAT).header(RANK_HEADER, "9")),
        RANK_HEADER,
        "h2 rank header 9 (no body)",
    );
    let h1_error = assert_invalid_rank(
        &s.send(&chat(json!({})).header(RANK_HEADER, "9")),
        RANK_HEADER,
        "h1 rank header 9",
    );
    assert_eq!(h2_error, h1_error, "h1 and h2 errors differ");
    assert_invalid_rank(
        &h2(&chat(json!({ "routed_dp_rank": "two" }))),
        "routed_dp_rank",
        "h2 rank field \"two\"",
    );
    s.assert_counter("invalid_rank", 3);
    s.assert_vm_healthy();
}

// ---------------------------------------------------------------- the VM-health check itself

/// The failure lines the health check looks for, in the shapes Envoy 1.40 logs
/// them (a trapped callback, a Rust panic through the SDK's hook, a VM that
/// failed), and ordinary filter lines it must not flag.
#[test]
fn vm_failure_lines_are_recognised() {
    let log = "\
[2026-12-02 16:00:00.000][1][error][wasm] [source/extensions/common/wasm/wasm_vm.cc:38] Function: proxy_on_request_headers failed: Uncaught RuntimeError: unreachable
[2026-12-02 16:00:00.000][1][critical][wasm] [source/extensions/common/wasm/context.cc:1157] wasm log dp_affinity dp_affinity: panicked at src/host/mod.rs:1:1: boom
[2026-12-02 16:00:00.000][1][info][wasm] [source/extensions/common/wasm/context.cc:1151] wasm log dp_affinity dp_affinity: dp-affinity configured: dp_size 4
[2026-12-02 16:00:00.000][1][debug][wasm] [source/extensions/common/wasm/context.cc:1151] wasm log dp_affinity dp_affinity: [2] rejected: {}
[2026-12-02 16:00:00.000][1][info][main] [source/server/server.cc:467]   envoy.wasm.runtime: envoy.wasm.runtime.null, envoy.wasm.runtime.v8
";
    let found = vm_failure_lines(log);
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(found[0].contains("Function: proxy_on_request_headers failed"));
    assert!(found[1].contains("panicked at"));
}

/// Proof that the health check sees a real VM failure: the test-only
/// `fault-injection` build (`make wasm-fault`, `DP_AFFINITY_FAULT_WASM`) panics
/// on a marked request. Observed on Envoy 1.40.0 under the `FAIL_RELOAD` policy
/// these tests run (as shipped): that request gets 503 (fail closed) and its
/// worker's VM is failed; Envoy replaces it when the next request reaches that
/// worker (`wasm.dp_affinity.vm_reload_success`), and that request is served.
/// Only within the reload backoff after the VM's last load (0.2-0.3 s here:
/// `reload_config.backoff.base_interval` 0.2 s plus up to half of it in jitter;
/// `max_interval` plays no part) is the failed VM kept: such requests get 503 and
/// count `vm_reload_backoff`. tests/failure.rs shows the pins survive the reload.
/// The check sees both signs: the failure lines in the log and the reload in the
/// stats.
#[test]
fn vm_health_check_sees_a_real_panic() {
    const PANIC_HEADER: &str = "x-dp-affinity-test-panic";
    const RELOADED: &str = "wasm.dp_affinity.vm_reload_success";
    let s = Scenario::with_options(
        "vm_health_check_sees_a_real_panic",
        StackOptions::new(plugin_config(json!({}))).wasm(paths::fault_wasm_path()),
    );
    let signs = vm_failure_signs(&s, &s.wasm_baseline);
    assert!(signs.is_empty(), "failure before the fault: {signs:#?}");
    let response = s.send(&keyed("doomed").header(PANIC_HEADER, "1"));
    assert_eq!(response.status, 503, "fail closed: {:?}", response.text());

    // Fresh connections reach both workers, so one soon lands on the failed VM's
    // worker after the backoff and gets it reloaded.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut statuses = Vec::new();
    loop {
        let stats = wasm_stats(&s);
        let reloads = *stats
            .get(RELOADED)
            .unwrap_or_else(|| panic!("Envoy shows no {RELOADED}: {stats:#?}"));
        if reloads > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the failed VM was not reloaded within 10 s; statuses {statuses:?}, stats {stats:#?}"
        );
        statuses.push(s.send(&keyed("after")).status);
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("after the panic, fresh connections got {statuses:?} until the VM was reloaded");
    assert!(
        statuses.iter().all(|status| [200, 503].contains(status)),
        "a failed VM fails closed (503), a live one serves: {statuses:?}"
    );
    let signs = vm_failure_signs(&s, &s.wasm_baseline);
    eprintln!("failure signs:\n{}", signs.join("\n"));
    for wanted in [
        "panicked at",
        "Function: proxy_on_request_headers failed",
        "vm_reload_success",
    ] {
        assert!(
            signs.iter().any(|sign| sign.contains(wanted)),
            "no sign with {wanted:?}: {signs:#?}"
        );
    }
    // Reloaded, the VM routes again on both workers.
    let ranks: Vec<u32> = (0..8)
        .map(|_| served_rank(&s.send(&keyed("after"))))
        .collect();
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "key moved between ranks after the reload: {ranks:?}"
    );
}
