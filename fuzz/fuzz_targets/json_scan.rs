//! The top-level JSON scanner and the body decision on arbitrary bytes: no panic, ranks in range,
//! and whatever serde_json accepts as an object the scanner accepts with serde's values (serde
//! keeps the last duplicate; so does the scanner's last report).

#![no_main]

mod common;

use dp_affinity::decide::decide_body;
use dp_affinity::extract::scan_body;
use dp_affinity::json_scan::{scan_top_level, Value};
use libfuzzer_sys::fuzz_target;

const WANTED: [&str; 7] = [
    "routing_key",
    "prompt_cache_key",
    "user",
    "routed_dp_rank",
    "data_parallel_rank",
    "bootstrap_room",
    "",
];

fn same(v: &Value<'_>, j: &serde_json::Value) -> bool {
    use serde_json::Value as J;
    match (v, j) {
        (Value::Str(b), J::String(s)) => &**b == s.as_bytes(),
        (Value::Number(raw), J::Number(_)) => {
            serde_json::from_slice::<J>(raw).ok().as_ref() == Some(j)
        }
        (Value::Bool(a), J::Bool(b)) => a == b,
        (Value::Null, J::Null) | (Value::Object, J::Object(_)) | (Value::Array, J::Array(_)) => {
            true
        }
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut last: Vec<Option<Value<'_>>> = vec![None; WANTED.len()];
    let scanned = scan_top_level(data, &WANTED, |i, v| last[i] = Some(v));
    if let Ok(serde_json::Value::Object(obj)) = serde_json::from_slice(data) {
        assert_eq!(
            scanned,
            Ok(()),
            "serde accepts this object, the scanner refused it"
        );
        for (i, name) in WANTED.iter().enumerate() {
            match (obj.get(*name), &last[i]) {
                (None, None) => {}
                (Some(j), Some(v)) if same(v, j) => {}
                (j, v) => panic!("{name:?}: serde {j:?}, scanner {v:?}"),
            }
        }
    }
    for cfg in common::configs() {
        if let Ok(facts) = scan_body(cfg, data) {
            if let Some(Ok(r)) = facts.rank {
                assert!(r < cfg.dp_size);
            }
        }
        for trusted in [true, false] {
            common::check_decision(cfg, &decide_body(cfg, data, None, trusted));
            common::check_decision(cfg, &decide_body(cfg, data, Some(b"header-key"), trusted));
        }
    }
});
