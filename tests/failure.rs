//! What a VM failure does (the shipped `failure_policy: FAIL_RELOAD`), with a test-only build of
//! the filter whose VM panics on a marked request (`make wasm-fault`, feature `fault-injection`).
//! The request that kills the VM fails; Envoy replaces the VM when the next request reaches its
//! worker once the reload backoff since the VM's last load has passed (until then that worker
//! answers 503: see `vm_health_check_sees_a_real_panic` in tests/hostile.rs); later requests are
//! routed again and still find the pins made before the failure (the table lives in shared data).

mod support;

use std::thread;
use std::time::{Duration, Instant};

use serde_json::json;

use support::paths;
use support::requests::{keyed, plugin_config};
use support::stack::{served_rank, Stack, StackOptions};

const PANIC_HEADER: &str = "x-dp-affinity-test-panic";

#[test]
fn vm_failure_fails_one_request_then_reloads_with_pins_intact() {
    let stack = Stack::start(
        "vm_failure",
        StackOptions::new(plugin_config(json!({}))).wasm(paths::fault_wasm_path()),
    );
    let pinned: Vec<(String, u32)> = (0..8)
        .map(|i| {
            let key = format!("before-failure-{i}");
            let rank = served_rank(&stack.send(&keyed(&key)));
            (key, rank)
        })
        .collect();
    for (key, rank) in &pinned {
        assert_eq!(
            served_rank(&stack.send(&keyed(key))),
            *rank,
            "{key} not pinned"
        );
    }

    let killer = keyed("before-failure-0").header(PANIC_HEADER, "1");
    let failed = stack.send(&killer);
    assert_eq!(
        failed.status,
        503,
        "the request whose VM failed: {}",
        failed.text()
    );

    // Past the reload backoff (0.2 s base, at most 0.3 s with Envoy's jitter) the first request
    // reaching the failed VM's worker gets a fresh VM, and the pins are still there.
    thread::sleep(Duration::from_millis(600));
    // Fresh connections land on either worker: go round the pinned keys until one has reached the
    // failed worker (Envoy counts the reload), every answer served by the key's own rank.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut sent = 0;
    let reloads = loop {
        for (key, rank) in &pinned {
            let response = stack.send(&keyed(key));
            assert_eq!(
                response.status,
                200,
                "{key} after the reload: {}",
                response.text()
            );
            assert_eq!(
                served_rank(&response),
                *rank,
                "{key} lost its pin in the reload"
            );
            sent += 1;
        }
        let stats = stack.envoy.stats("vm_reload");
        let reloads = *stats
            .get("wasm.dp_affinity.vm_reload_success")
            .unwrap_or_else(|| {
                panic!("Envoy shows no wasm.dp_affinity.vm_reload_success: {stats:?}")
            });
        if reloads >= 1 {
            break reloads;
        }
        assert!(
            Instant::now() < deadline,
            "Envoy did not reload the VM ({sent} requests served since the failure): {stats:?}"
        );
    };
    println!(
        "vm failure: 1 request failed (503), vm_reload_success {reloads} within {sent} requests, pins intact"
    );
}
