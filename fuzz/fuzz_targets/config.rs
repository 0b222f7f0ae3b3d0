//! The plugin configuration parser on arbitrary bytes: no panic, and an accepted configuration
//! satisfies the documented bounds and drives the request path.

#![no_main]

use dp_affinity::config::{Config, MAX_DP_SIZE};
use dp_affinity::extract::scan_body;
use dp_affinity::table::AffinityTable;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let c = match Config::from_json(data) {
        Ok(c) => c,
        Err(e) => {
            assert!(!e.message.is_empty());
            let _ = e.to_string();
            return;
        }
    };
    assert!((1..=MAX_DP_SIZE).contains(&c.dp_size));
    assert_eq!(c.cluster_names.len(), c.dp_size as usize);
    assert!(c
        .cluster_names
        .iter()
        .all(|n| !n.is_empty() && n.bytes().all(|b| (0x21..0x7f).contains(&b))));
    assert!((1..=1 << 24).contains(&c.table.buckets));
    assert!((1..=64).contains(&c.table.ways));
    assert!(c.table.ttl_seconds >= 1 && c.table.cas_retries <= 100);
    assert!(c.key.max_bytes >= 1 && c.body.max_bytes >= 1);
    assert!(c.learn.upstream_addresses.values().all(|&r| r < c.dp_size));
    let table = AffinityTable::new(c.table.clone());
    for h in [0, u64::MAX] {
        assert!(table.bucket_of(h) < c.table.buckets);
        let _ = table.bucket_key(table.bucket_of(h));
    }
    let _ = scan_body(
        &c,
        br#"{"routed_dp_rank":0,"routing_key":"k","bootstrap_room":1}"#,
    );
});
