//! Bad input gets bounded answers, end to end: the compiled filter in a real Envoy in front of 4
//! mock ranks. An explicit rank of megabytes (body) or tens of kilobytes (header) is answered by
//! the filter's 400 in a few hundred bytes, quoting only the start of the value; a plugin
//! configuration that gives one request header two roles is refused by `envoy --mode validate`
//! with a log line naming both fields; an empty hash seed is accepted with a warning.
//!
//! Run after building the artifacts (`make build`):
//! `cargo test --test bad_input -- --test-threads 2`.

mod support;

use serde_json::{json, Value};

use support::envoy::{self, EnvoyConfig};
use support::fnv::fnv1a64_hex;
use support::http::{self, Request, Response};
use support::paths;
use support::requests::{default_config, keyed, plugin_config, RANK_HEADER};
use support::stack::{mock_info, served_rank, Stack, StackOptions};
use support::tempdir::TestDir;

const CHAT: &str = "/v1/chat/completions";

/// What the README promises for the 400 of any explicit rank, however large.
const MAX_ERROR_BYTES: usize = 300;

/// 4,000,000: under the default `body.max_bytes` (8 MiB) and the test Envoy's buffer limit
/// (10 MiB, as shipped), so the filter reads and scans the whole body.
const BIG: usize = 4_000_000;

fn start(name: &str, overrides: Value) -> Stack {
    Stack::start(name, StackOptions::new(plugin_config(overrides)))
}

fn json_body(body: Vec<u8>) -> Request {
    Request::post(CHAT).body("application/json", body)
}

/// `{"model":"m","<field>":<value>}` without building the value as a `serde_json::Value`.
fn body_with(field: &str, value: &[u8]) -> Vec<u8> {
    let mut body = format!(r#"{{"model":"m","{field}":"#).into_bytes();
    body.extend_from_slice(value);
    body.push(b'}');
    body
}

/// Asserts `response` is the filter's bounded 400 naming `param`; returns its message.
fn assert_bounded_400(response: &Response, param: &str, label: &str) -> String {
    assert_eq!(
        response.status,
        400,
        "{label}: status {}, body {:?}",
        response.status,
        response.text().chars().take(300).collect::<String>()
    );
    assert!(
        response.body.len() <= MAX_ERROR_BYTES,
        "{label}: a 400 of {} bytes: {:?}",
        response.body.len(),
        response.text().chars().take(600).collect::<String>()
    );
    let content_type = response.header("content-type").unwrap_or("");
    assert!(
        content_type.starts_with("application/json"),
        "{label}: content-type {content_type:?}"
    );
    let error = response.json();
    assert_eq!(error["error"]["param"], json!(param), "{label}: {error}");
    assert_eq!(
        error["error"]["code"],
        json!("invalid_data_parallel_rank"),
        "{label}: {error}"
    );
    let message = error["error"]["message"].as_str().unwrap_or("").to_string();
    assert!(message.contains(param), "{label}: {message}");
    eprintln!(
        "{label}: {} bytes: {}",
        response.body.len(),
        response.text()
    );
    message
}

/// The VMs survived: no panic or failed callback in Envoy's log, and a keyed request still
/// routes and sticks.
fn assert_still_routing(stack: &Stack, name: &str) {
    let log = stack.envoy.log();
    let failures: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("panicked") || l.contains("Function: proxy_on_"))
        .collect();
    assert!(failures.is_empty(), "[{name}] VM failures:\n{failures:?}");
    let key = format!("after-{name}");
    let ranks: Vec<u32> = (0..4)
        .map(|_| served_rank(&stack.send(&keyed(&key))))
        .collect();
    assert!(
        ranks.iter().all(|r| *r == ranks[0]),
        "[{name}] key moved: {ranks:?}"
    );
}

/// Megabyte rank fields in the body, with the default configuration (`body.max_bytes` 8 MiB, so
/// the 4 MB bodies are read): 4,000,000 digits, a 4 MB string, a 4 MB array. Each gets a 400 of
/// at most 300 bytes that names the field and quotes at most 32 bytes of the value.
#[test]
fn megabyte_body_ranks_get_a_bounded_400() {
    let name = "megabyte_body_ranks";
    let s = start(name, json!({}));
    let digits = vec![b'7'; BIG];
    let mut string = vec![b'"'];
    string.extend(std::iter::repeat_n(b'A', BIG));
    string.push(b'"');
    let mut array = b"[".to_vec();
    array.extend(std::iter::repeat_n(&b"1,"[..], BIG / 2).flatten());
    array.extend_from_slice(b"1]");

    let cases: [(&str, &[u8], String); 3] = [
        (
            "routed_dp_rank",
            &digits,
            format!("got {}... (truncated, {BIG} bytes)", "7".repeat(32)),
        ),
        (
            "data_parallel_rank",
            &string,
            format!(
                r#"got the string "{}"... (truncated, {BIG} bytes)"#,
                "A".repeat(32)
            ),
        ),
        ("routed_dp_rank", &array, "got an array".to_string()),
    ];
    for (field, value, says) in &cases {
        let label = format!("{field} of {} bytes", value.len());
        let response = s.send(&json_body(body_with(field, value)));
        let message = assert_bounded_400(&response, field, &label);
        assert!(message.contains(says.as_str()), "{label}: {message}");
    }
    let counters = s.settled();
    counters.assert_eq("invalid_rank", cases.len() as u64);
    counters.assert_eq("body_too_large", 0);
    assert_still_routing(&s, name);
}

/// The same 4,000,000-digit rank in a body over `body.max_bytes` (1 MiB here): the filter does
/// not read the body at all (`body_too_large`), so there is no 400; Envoy balances the request and
/// the upstream receives the body byte for byte.
#[test]
fn over_body_max_bytes_the_rank_is_not_read() {
    let name = "over_body_max_bytes";
    let s = start(name, json!({ "body": { "max_bytes": 1 << 20 } }));
    let body = body_with("routed_dp_rank", &vec![b'7'; BIG]);
    let response = s.send(&json_body(body.clone()));
    served_rank(&response);
    let info = mock_info(&response);
    assert_eq!(info["body_len"], json!(body.len()), "body length changed");
    assert_eq!(
        info["body_fnv1a64"].as_str().map(str::to_ascii_lowercase),
        Some(fnv1a64_hex(&body)),
        "body bytes changed"
    );
    let counters = s.settled();
    counters.assert_eq("body_too_large", 1);
    counters.assert_eq("invalid_rank", 0);
    assert_still_routing(&s, name);

    // With the defaults (prompt prefix on, so a keyed chat's body is read too) a routing-key
    // header routes such a body, and the unread body is still counted.
    let name = "over_body_max_bytes_keyed";
    let keyed = Stack::start(
        name,
        StackOptions::new(default_config(json!({ "body": { "max_bytes": 1 << 20 } }))),
    );
    let response = keyed.send(&json_body(body).header("x-routing-key", "session-1"));
    served_rank(&response);
    let counters = keyed.settled();
    counters.assert_eq("body_too_large", 1);
    counters.assert_eq("affinity_miss", 1);
    assert_still_routing(&keyed, name);
}

/// A 50 KB explicit-rank header (under Envoy's default 60 KiB of request headers, so the filter
/// sees it): digits, letters, and bytes that are not UTF-8 (sent on a raw socket). Each gets a
/// 400 of at most 300 bytes quoting at most 32 bytes of the value.
#[test]
fn long_rank_header_gets_a_bounded_400() {
    let name = "long_rank_header";
    let s = start(name, json!({}));
    const LEN: usize = 50_000;
    let digits = "9".repeat(LEN);
    let response = s.send(&json_body(b"{}".to_vec()).header(RANK_HEADER, &digits));
    let message = assert_bounded_400(&response, RANK_HEADER, "50 KB of digits");
    assert!(
        message.contains(&format!(
            r#"got "{}"... (truncated, {LEN} bytes)"#,
            "9".repeat(32)
        )),
        "{message}"
    );

    let letters = "x".repeat(LEN);
    let response = s.send(&json_body(b"{}".to_vec()).header(RANK_HEADER, &letters));
    let message = assert_bounded_400(&response, RANK_HEADER, "50 KB of letters");
    assert!(!message.contains(&"x".repeat(33)), "{message}");

    let high: Vec<u8> = (0x80..=0xffu8).cycle().take(LEN).collect();
    let outcome = http::send_raw(
        s.addr(),
        http::raw_request(CHAT, &[(RANK_HEADER, &high)], b"{}"),
        "POST",
    );
    let response = outcome.response.unwrap_or_else(|| {
        panic!(
            "no response to a non-UTF-8 header: {:?}",
            outcome.read_error
        )
    });
    let message = assert_bounded_400(&response, RANK_HEADER, "50 KB not UTF-8");
    assert!(
        message.contains('\u{fffd}') && message.contains(&format!("(truncated, {LEN} bytes)")),
        "{message}"
    );
    s.assert_counter("invalid_rank", 3);
    assert_still_routing(&s, name);
}

/// `envoy --mode validate` runs the filter's `on_configure`: a configuration whose explicit-rank
/// header is also the cluster header is refused, with one log line naming both fields. A good
/// configuration with an empty `routing_key.hash_seed` validates, with the seed warning; with a
/// seed, no warning.
#[test]
fn shared_header_config_is_refused_and_empty_seed_warned() {
    let dir = TestDir::new("shared_header_config");
    let validate = |name: &str, overrides: Value| {
        let config = EnvoyConfig::new(
            vec![1, 2, 3, 4],
            Some(paths::wasm_path()),
            plugin_config(overrides),
        );
        envoy::validate(&config, dir.path(), name)
    };

    let shared = validate(
        "shared",
        json!({ "explicit_rank": { "header": "X-DP-Affinity-Cluster" } }),
    );
    assert!(
        !shared.success,
        "a shared header validated:\n{}",
        shared.output
    );
    let line = shared
        .output
        .lines()
        .find(|l| l.contains("invalid plugin configuration"))
        .unwrap_or_else(|| panic!("no configuration error logged:\n{}", shared.output));
    assert!(
        line.contains("target.cluster_header")
            && line.contains("explicit_rank.header")
            && line.contains("\"x-dp-affinity-cluster\""),
        "{line}"
    );
    eprintln!("refused: {line}");

    const SEED_WARNING: &str = "routing_key.hash_seed is empty";
    let unseeded = validate("unseeded", json!({}));
    assert!(unseeded.success, "{}", unseeded.output);
    let warning = unseeded
        .output
        .lines()
        .find(|l| l.contains(SEED_WARNING))
        .unwrap_or_else(|| panic!("no seed warning:\n{}", unseeded.output));
    assert!(warning.contains("[warning]"), "{warning}");
    eprintln!("warned: {warning}");

    let seeded = validate(
        "seeded",
        json!({ "routing_key": { "hash_seed": "not-a-real-secret" } }),
    );
    assert!(seeded.success, "{}", seeded.output);
    assert!(!seeded.output.contains(SEED_WARNING), "{}", seeded.output);
}

/// A plugin configuration naming a member twice (an overlay merged into it, say) is refused by
/// `envoy --mode validate`, naming the member: JSON parsers keep the last copy without a word,
/// here a second `dp_size` that would have shrunk the ranks from 8 to 4 unnoticed.
#[test]
fn a_member_named_twice_is_refused() {
    let dir = TestDir::new("member_twice");
    let config = EnvoyConfig::new(
        vec![1, 2, 3, 4],
        Some(paths::wasm_path()),
        plugin_config(json!({ "dp_size": 8 })),
    );
    let rendered = envoy::render_config(envoy::free_port(), envoy::free_port(), &config);
    // The plugin JSON is embedded as a string in the bootstrap, its quotes escaped.
    let once = r#"\"dp_size\":8"#;
    assert_eq!(rendered.matches(once).count(), 1, "{rendered}");
    let twice = rendered.replacen(once, r#"\"dp_size\":8,\"dp_size\":4"#, 1);
    let path = dir.path().join("twice.yaml");
    std::fs::write(&path, twice).expect("write the config");
    let refused = envoy::validate_file(&path);
    assert!(!refused.success, "validated:\n{}", refused.output);
    let line = refused
        .output
        .lines()
        .find(|l| l.contains("invalid plugin configuration"))
        .unwrap_or_else(|| panic!("no configuration error logged:\n{}", refused.output));
    assert!(line.contains(r#"member "dp_size" appears twice"#), "{line}");
    eprintln!("refused: {line}");
}
