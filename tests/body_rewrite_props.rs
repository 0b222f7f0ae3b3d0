//! Property tests of `body_rewrite::rewrite` on random JSON objects, laid out with random
//! whitespace and member order: the output always parses, holds the rank in the set member,
//! has none of the removed members, and every other member is unchanged; when the set member
//! was already there, only its values' text changes (the length moves by exactly that, and
//! everything before it is the input's).

use dp_affinity::body_rewrite::{rewrite, RankEdit};
use proptest::prelude::*;
use serde_json::{Map, Value};

const SET: &str = "routed_dp_rank";
const ALIAS: &str = "data_parallel_rank";

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-z \"\\\\é\u{1F600}]{0,12}".prop_map(Value::String),
    ]
}

fn nested() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((name(), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Member names, the rank fields among them often.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => Just(SET.to_string()),
        2 => Just(ALIAS.to_string()),
        4 => "[a-z_]{1,8}",
    ]
}

/// A JSON object's text with duplicate names possible (so not via serde_json's map), random
/// whitespace around every token; plus the members in order.
fn object() -> impl Strategy<Value = (String, Vec<(String, Value)>)> {
    let ws = prop::sample::select(vec!["", " ", "\n", "\t ", "  \r\n"]);
    prop::collection::vec((name(), nested(), ws.clone(), ws.clone()), 0..6).prop_flat_map(
        move |members| {
            (Just(members), ws.clone(), ws.clone()).prop_map(|(members, lead, tail)| {
                let parts: Vec<String> = members
                    .iter()
                    .map(|(n, v, a, b)| format!("{a}{}{b}:{a}{v}{b}", Value::from(n.as_str())))
                    .collect();
                let text = format!("{lead}{{{}}}{tail}", parts.join(","));
                let pairs = members.into_iter().map(|(n, v, _, _)| (n, v)).collect();
                (text, pairs)
            })
        },
    )
}

/// What the engine's `dict` holds: the last value of each name.
fn as_dict(pairs: &[(String, Value)]) -> Map<String, Value> {
    pairs.iter().cloned().collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn only_the_rank_members_change((text, pairs) in object(), rank in 0u32..5000, strip in any::<bool>(), set in any::<bool>()) {
        let remove: Vec<String> = if strip { vec![SET.into(), ALIAS.into()] } else { vec![] };
        let edit = RankEdit { set: set.then_some((SET, rank)), remove: &remove };
        let out = rewrite(text.as_bytes(), edit).expect("a JSON object");
        let bytes = out.as_ref().map_or(text.as_bytes().to_vec(), |r| r.body.clone());
        let got: Map<String, Value> = serde_json::from_slice::<Value>(&bytes)
            .expect("the output parses")
            .as_object()
            .cloned()
            .expect("an object");
        let mut want = as_dict(&pairs);
        if set {
            want.insert(SET.into(), Value::from(rank));
        }
        if strip {
            want.remove(ALIAS);
            if !set {
                want.remove(SET);
            }
        }
        prop_assert_eq!(&got, &want, "{} -> {}", text, String::from_utf8_lossy(&bytes));
        let copies = pairs.iter().filter(|(n, _)| n == SET).count();
        let removed = pairs.iter().filter(|(n, _)| remove.contains(n) && !(set && n == SET)).count();
        if let Some(r) = &out {
            prop_assert_eq!(r.removed, removed);
        }
        // Replaced in place: outside the set member's values, the bytes are the input's.
        if set && copies > 0 && removed == 0 {
            let delta: i64 = pairs
                .iter()
                .filter(|(n, _)| n == SET)
                .map(|(_, v)| rank.to_string().len() as i64 - v.to_string().len() as i64)
                .sum();
            prop_assert_eq!(bytes.len() as i64, text.len() as i64 + delta);
            let first = text.find(&format!("\"{SET}\"")).expect("the member");
            prop_assert_eq!(&bytes[..first], &text.as_bytes()[..first], "prefix untouched");
        }
    }
}
