//! Configuration reload through a file-based dynamic listener (LDS from a path), as an operator
//! would roll out a new plugin configuration: a valid one takes effect without dropping the
//! requests in flight; an invalid one is refused with a log line naming the field, and the old
//! configuration keeps serving.

mod support;

use std::thread;
use std::time::{Duration, Instant};

use serde_json::json;

use support::envoy::{Envoy, EnvoyConfig};
use support::http::{self, Response};
use support::mock::MockRank;
use support::paths;
use support::requests::{chat, keyed, plugin_config};
use support::tempdir::TestDir;

/// Polls until `check` holds for a fresh request's response (a listener update is applied
/// asynchronously), or fails after 10 s.
fn eventually(envoy: &Envoy, what: &str, check: impl Fn(&Response) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let response = envoy.send(&keyed("reload-probe"));
        if check(&response) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: last response {response:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn listener_reload_applies_valid_and_refuses_invalid_config() {
    let dir = TestDir::new("reload");
    let mocks: Vec<MockRank> = (0..4)
        .map(|rank| MockRank::start(rank, &["--stream-interval-ms", "300"], dir.path()))
        .collect();
    let ports = mocks.iter().map(MockRank::port).collect();
    let mut config = EnvoyConfig::new(
        ports,
        Some(paths::wasm_path()),
        plugin_config(json!({ "echo_header": "x-served-a" })),
    );
    config.lds = true;
    let envoy = Envoy::start(&config, dir.path());
    eventually(&envoy, "config A serves", |r| {
        r.header("x-served-a").is_some()
    });

    // A streamed answer (5 events, 300 ms apart) is in flight while the new config lands.
    let addr = envoy.listen_addr();
    let streaming = thread::spawn(move || {
        http::stream(
            addr,
            &chat(json!({ "stream": true })).header("x-smg-routing-key", "live"),
        )
    });
    thread::sleep(Duration::from_millis(400));
    config.plugin_config = plugin_config(json!({ "echo_header": "x-served-b" }));
    envoy.update_listener(&config);
    eventually(&envoy, "config B takes effect", |r| {
        r.status == 200 && r.header("x-served-b").is_some() && r.header("x-served-a").is_none()
    });
    let stream = streaming.join().expect("streaming client panicked");
    let body = String::from_utf8_lossy(&stream.body()).into_owned();
    assert_eq!(stream.status, 200);
    assert!(
        stream.header("x-served-a").is_some() && stream.header("x-served-b").is_none(),
        "the stream did not start under config A (the reload came first): {:?}",
        stream.headers
    );
    assert!(
        body.contains("data: [DONE]"),
        "the in-flight stream was cut by the reload: {body:?}"
    );
    assert_eq!(body.matches("data: {").count(), 5, "events lost: {body:?}");

    // An invalid configuration is refused; B keeps serving.
    let mut bad = config.clone();
    bad.plugin_config = json!({ "dp_size": 0, "echo_header": "x-served-c" });
    envoy.update_listener(&bad);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !envoy
        .log()
        .contains("invalid plugin configuration: dp_size")
    {
        assert!(
            Instant::now() < deadline,
            "no log line naming dp_size:\n{}",
            envoy.log()
        );
        thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..10 {
        let response = envoy.send(&keyed("after-bad-config"));
        assert_eq!(response.status, 200);
        assert!(response.header("x-served-b").is_some(), "{response:?}");
        assert!(response.header("x-served-c").is_none());
    }
    let rejected = envoy.stats("lds.update_rejected");
    println!("reload: B applied with a stream in flight (5/5 events); invalid config refused, {rejected:?}");
    assert!(
        rejected.values().any(|&n| n >= 1),
        "Envoy did not count the rejected update: {rejected:?}"
    );
}
