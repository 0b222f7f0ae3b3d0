//! Shared by the fuzz targets: a handful of configurations that exercise different code paths.

#![allow(dead_code)] // each target uses a different part

use std::sync::OnceLock;

use dp_affinity::config::Config;
use dp_affinity::decide::Decision;

/// Configurations the request-path targets run every input through.
pub fn configs() -> &'static [Config] {
    static CONFIGS: OnceLock<Vec<Config>> = OnceLock::new();
    CONFIGS.get_or_init(|| {
        [
            r#"{"dp_size":4}"#,
            r#"{"dp_size":4,"explicit_rank":{"trusted_header":"X-Router-Token","trusted_secret":"s3cret"}}"#,
            r#"{"dp_size":1,"explicit_rank":{"on_invalid":"ignore"}}"#,
            r#"{"dp_size":8,"assign":{"mode":"bootstrap_room"},
                "routing_key":{"headers":["X-Session-ID","x-routing-key"],"body_fields":["user"]}}"#,
            r#"{"dp_size":4096,"explicit_rank":{"enabled":false},"target":{"mode":"engine_header"},
                "echo_header":"x-data-parallel-rank","learn":{"response_header":"x-data-parallel-rank"}}"#,
            r#"{"dp_size":3,"body":{"max_bytes":64,"content_types":["application/json","text/plain"]},
                "routing_key":{"body_fields":["routing_key","prompt_cache_key","user","data"],"max_bytes":4},
                "explicit_rank":{"body_fields":["rank"]}}"#,
        ]
        .iter()
        .map(|json| Config::from_json(json.as_bytes()).expect("fuzz config is valid"))
        .collect()
    })
}

/// What every decision must satisfy: ranks in range, rejections are 400 with a JSON body.
pub fn check_decision(cfg: &Config, d: &Decision) {
    match d {
        Decision::Rank(r) | Decision::Room(r) => {
            assert!(*r < cfg.dp_size, "rank {r} >= dp_size {}", cfg.dp_size)
        }
        Decision::Reject(rej) => {
            assert_eq!(rej.status, 400);
            let v: serde_json::Value =
                serde_json::from_str(&rej.body).expect("rejection body is JSON");
            assert!(v["error"]["param"].is_string());
        }
        Decision::Key { .. } | Decision::Fallback(_) => {}
    }
}
