//! What a VM failure does (the shipped `failure_policy: FAIL_RELOAD`), with a test-only build of
//! the filter whose VM panics on a marked request (`make wasm-fault`, feature `fault-injection`).
//! The request that kills the VM fails; Envoy replaces the VM; later requests are routed again
//! and still find the pins made before the failure (the table lives in shared data).

mod support;

use std::thread;
use std::time::Duration;

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

    // After the reload backoff (0.2 s) a fresh VM serves, and the pins are still there.
    thread::sleep(Duration::from_millis(600));
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
    }
    let stats = stack.envoy.stats("vm_reload");
    let reloads = stats
        .iter()
        .find(|(name, _)| name.ends_with("dp_affinity.vm_reload_success"))
        .map(|(_, v)| *v)
        .unwrap_or(0);
    println!("vm failure: 1 request failed (503), vm_reload_success {reloads}, pins intact");
    assert!(reloads >= 1, "Envoy did not reload the VM: {stats:?}");
}
