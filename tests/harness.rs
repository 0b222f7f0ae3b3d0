//! Self-tests of the e2e harness: the HTTP client, the mock ranks, the generated
//! Envoy topology (run without the wasm filter), and the reader of the filter's
//! counters. When an e2e scenario fails, these say whether the harness or the
//! filter is at fault.

mod support;

use std::io::{BufReader, Read, Write};
use std::net::TcpListener;
use std::thread;
use std::time::Duration;

use serde_json::json;

use support::counters::PREFIX;
use support::envoy::FILTER_VMS;
use support::envoy::{self, EnvoyConfig};
use support::fnv::fnv1a64_hex;
use support::http::{self, read_response, Request};
use support::mock::MockRank;
use support::paths;
use support::stack::{mock_info, served_rank, upstream_headers, Stack, StackOptions};
use support::tempdir::TestDir;

fn chat(body_extra: serde_json::Value) -> Request {
    let mut body = json!({ "model": "mock", "messages": [{ "role": "user", "content": "hi" }] });
    body.as_object_mut()
        .expect("object")
        .extend(body_extra.as_object().expect("object").clone());
    Request::post("/v1/chat/completions").json(&body)
}

#[test]
fn http_client_reads_chunked_and_length_framed_responses() {
    let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nx-a: 2\r\n\r\n\
                5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n\
                HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nnop";
    let mut reader = BufReader::new(&raw[..]);
    let first = read_response(&mut reader, "GET");
    assert_eq!(first.status, 200);
    assert_eq!(first.body, b"hello world");
    assert_eq!(first.header_all("x-a"), vec!["1", "2"]);
    let second = read_response(&mut reader, "GET");
    assert_eq!(second.status, 404);
    assert_eq!(second.text(), "nop");
}

#[test]
fn http_stream_timestamps_each_chunk() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        let mut request = [0u8; 1024];
        let _ = conn.read(&mut request);
        conn.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
            .expect("write");
        thread::sleep(Duration::from_millis(300));
        conn.write_all(b"3\r\ntwo\r\n0\r\n\r\n").expect("write");
    });
    let streamed = http::stream(addr, &Request::get("/"));
    server.join().expect("server thread");
    assert_eq!(streamed.body(), b"onetwo");
    assert_eq!(streamed.chunks.len(), 2);
    let gap = streamed.chunks[1].0 - streamed.chunks[0].0;
    assert!(
        gap >= Duration::from_millis(250),
        "chunks not timestamped apart: {gap:?}"
    );
}

#[test]
fn fnv_matches_reference_vectors() {
    assert_eq!(fnv1a64_hex(b""), "cbf29ce484222325");
    assert_eq!(fnv1a64_hex(b"a"), "af63dc4c8601ec8c");
    assert_eq!(fnv1a64_hex(b"foobar"), "85944171f73967e8");
}

#[test]
fn mock_rank_answers_kills_and_restarts() {
    let dir = TestDir::new("harness-mock");
    let mut mock = MockRank::start(2, &[], dir.path());
    let request = chat(json!({ "routing_key": "abc" }));
    let response = http::send(mock.addr(), &request);
    assert_eq!(served_rank(&response), 2);
    let info = mock_info(&response);
    assert_eq!(info["body_len"], json!(request.body.len()));
    assert_eq!(info["body_fnv1a64"], json!(fnv1a64_hex(&request.body)));
    assert_eq!(info["path"], json!("/v1/chat/completions"));

    let port = mock.port();
    mock.kill();
    assert!(
        std::net::TcpStream::connect(mock.addr()).is_err(),
        "killed mock still accepts"
    );
    mock.restart();
    assert_eq!(mock.port(), port, "restart must reuse the port Envoy knows");
    assert_eq!(served_rank(&http::send(mock.addr(), &request)), 2);
}

/// The generated topology without the filter: Envoy balances over dp-all, the
/// cluster-header route reaches one rank and strips the header, and teardown frees
/// the ports. (With the filter, a client's header must NOT work: see e2e.)
#[test]
fn envoy_topology_without_filter() {
    let stack = Stack::start(
        "harness-envoy",
        StackOptions::new(json!({ "dp_size": 4 })).without_filter(),
    );
    let ranks: Vec<u32> = (0..20)
        .map(|_| served_rank(&stack.send(&chat(json!({})))))
        .collect();
    let distinct: std::collections::BTreeSet<u32> = ranks.iter().copied().collect();
    assert!(distinct.len() >= 2, "dp-all did not balance: {ranks:?}");

    let pinned = stack.send(&chat(json!({})).header("x-dp-affinity-cluster", "dp-rank-3"));
    assert_eq!(served_rank(&pinned), 3);
    assert!(
        !upstream_headers(&pinned).contains_key("x-dp-affinity-cluster"),
        "route must strip the internal header before the upstream"
    );

    let admin = stack.envoy.admin_addr();
    drop(stack);
    assert!(
        std::net::TcpStream::connect(admin).is_err(),
        "Envoy admin still up after drop"
    );
}

#[test]
fn envoy_stream_is_not_buffered_without_filter() {
    let stack = Stack::start(
        "harness-sse",
        StackOptions::new(json!({ "dp_size": 1 }))
            .without_filter()
            .mock_args(&["--stream-interval-ms", "200"]),
    );
    let streamed = http::stream(stack.addr(), &chat(json!({ "stream": true })));
    assert_eq!(streamed.status, 200);
    let first = streamed.chunks.first().expect("a chunk").0;
    let last = streamed.chunks.last().expect("a chunk").0;
    assert!(
        first * 2 < last,
        "first chunk at {first:?}, last at {last:?}"
    );
}

#[test]
fn envoy_validate_runner_reports_success_and_failure() {
    let dir = TestDir::new("harness-validate");
    let good = EnvoyConfig::new(vec![1, 2], None, json!({ "dp_size": 2 }));
    let outcome = envoy::validate(&good, dir.path(), "good");
    assert!(
        outcome.success,
        "plain topology must validate:\n{}",
        outcome.output
    );

    let bad_path = dir.join("bad.yaml");
    std::fs::write(
        &bad_path,
        "static_resources: { clusters: [ { name: x, type: NOPE } ] }\n",
    )
    .expect("write");
    let outcome = envoy::validate_file(&bad_path);
    assert!(
        !outcome.success,
        "broken config validated:\n{}",
        outcome.output
    );
}

/// The counter names in README's Metrics table (first column, every `name` in it).
fn readme_counters() -> std::collections::BTreeSet<String> {
    let readme =
        std::fs::read_to_string(paths::repo_root().join("README.md")).expect("read README.md");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("Metrics"))
        .expect("README has a Metrics section");
    section
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .flat_map(|row| {
            let cell = row.split(" |").next().unwrap_or("");
            format!("`{cell}")
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `rank_inflight.3` as README names the family of per-rank gauges: `rank_inflight.<r>`.
fn per_rank_pattern(name: &str) -> String {
    match name.rsplit_once('.') {
        Some((family, rank)) if rank.bytes().all(|b| b.is_ascii_digit()) => {
            format!("{family}.<r>")
        }
        _ => name.to_string(),
    }
}

/// The message of a caught panic.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// The reader of the filter's counters: Envoy shows every metric README lists (and no other;
/// per-rank gauges once per rank)
/// under `wasmcustom.dp_affinity.` before any request; a name it does not show fails at once,
/// naming the closest; a poll for 0 is refused; and a settled read has a request's count without
/// polling, once every VM has flushed twice.
#[test]
fn filter_counters_are_strict_and_settle() {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    let stack = Stack::start(
        "harness-counters",
        StackOptions::new(json!({ "dp_size": 4 })),
    );
    let shown: std::collections::BTreeSet<String> = stack
        .metrics()
        .into_keys()
        .filter_map(|name| name.strip_prefix(PREFIX).map(per_rank_pattern))
        .collect();
    assert_eq!(
        shown,
        readme_counters(),
        "the counters Envoy shows under {PREFIX} (left) and README's Metrics table (right)"
    );

    let message = stack
        .envoy
        .counters()
        .try_get("afinity_hit")
        .expect_err("a misspelt counter was read");
    assert!(
        message.contains("closest: affinity_hit"),
        "the report does not name the closest counter: {message}"
    );
    let zero_poll = catch_unwind(AssertUnwindSafe(|| stack.assert_counter("no_key", 0)))
        .expect_err("a poll for 0 was accepted");
    assert!(
        panic_message(zero_poll).contains("settled"),
        "the refusal does not say what to use instead"
    );

    let flushes = stack.counter("stats_flushes");
    served_rank(&stack.send(&chat(json!({}))));
    let counters = stack.settled();
    counters.assert_eq("no_key", 1);
    let grown = counters.get("stats_flushes") - flushes;
    assert!(
        grown >= 2 * FILTER_VMS,
        "settled after {grown} flushes, fewer than 2 per VM ({FILTER_VMS} VMs)"
    );
}
