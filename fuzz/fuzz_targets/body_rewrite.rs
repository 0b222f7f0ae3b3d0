//! The body rewrite on arbitrary bytes: no panic, and whatever serde_json accepts as an object is
//! rewritten into an object serde reads as the edit says (the rank member set or inserted, the
//! removed members gone, every other member as it was).
//!
//! The first byte picks the edit (bits 0–1: which rank member to set, if any; bits 2–5: which of
//! the body members to remove), the next two the rank; the rest is the body.

#![no_main]

use dp_affinity::body_rewrite::{rewrite, RankEdit};
use libfuzzer_sys::fuzz_target;
use serde_json::Value as J;

const SETTABLE: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];
const REMOVABLE: [&str; 4] = [
    "routed_dp_rank",
    "data_parallel_rank",
    "user",
    "routing_key",
];

fuzz_target!(|data: &[u8]| {
    let [pick, hi, lo, body @ ..] = data else {
        return;
    };
    let rank = u32::from(u16::from_be_bytes([*hi, *lo]));
    let set = SETTABLE.get(usize::from(pick & 3)).map(|n| (*n, rank));
    let remove: Vec<String> = REMOVABLE
        .iter()
        .enumerate()
        .filter(|(i, _)| pick >> (2 + i) & 1 == 1)
        .map(|(_, n)| n.to_string())
        .collect();
    let result = rewrite(
        body,
        RankEdit {
            set,
            remove: &remove,
        },
    );
    let Ok(J::Object(before)) = serde_json::from_slice::<J>(body) else {
        return;
    };
    let set_name = set.map(|(n, _)| n);
    let mut want = before.clone();
    want.retain(|k, _| set_name == Some(k.as_str()) || !remove.iter().any(|r| r == k));
    if let Some((name, rank)) = set {
        want.insert(name.to_string(), J::from(rank));
    }
    match result {
        Ok(None) => assert_eq!(
            want, before,
            "nothing rewritten, but the edit changes the body"
        ),
        Ok(Some(r)) => {
            let after: serde_json::Map<String, J> =
                serde_json::from_slice(&r.body).expect("the rewrite wrote a JSON object");
            assert_eq!(after, want);
        }
        Err(e) => panic!("serde reads an object, the rewrite refused it: {e:?}"),
    }
});
