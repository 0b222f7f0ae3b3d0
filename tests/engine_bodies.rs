//! Bodies the engines accept are bodies the filter reads: SGLang and vLLM parse request bodies
//! with Python's `json.loads` (through FastAPI and Starlette), which takes a UTF-8 byte order
//! mark, `NaN` and the infinities, and keeps the last of duplicated members. Through a real Envoy
//! with the real filter, each such body routes by the key in it (a miss on its first turn, a hit
//! on every later one) and none is counted `body_malformed`: a body the filter could not read
//! would go to the fallback with its key ignored, while the engine serves it.
//!
//! Both body readers run: the top-level field scanner (default configuration) and the prompt
//! walker (prefix placement on, `hash` assignment: the shipped configuration).

mod support;

use serde_json::{json, Value};

use support::http::Request;
use support::requests::plugin_config;
use support::stack::{served_rank, Stack, StackOptions};

const TURNS: usize = 4;
const MESSAGES: &str = r#""messages":[{"role":"user","content":"a question long enough to fill a few prefix blocks of the prompt walker, whatever their size"}]"#;

/// A chat request with this exact body, as a client would send it.
fn chat_bytes(body: Vec<u8>) -> Request {
    Request::post("/v1/chat/completions").body("application/json", body)
}

/// The bodies, each carrying its own key (`routing_key` or `prompt_cache_key`), written the way
/// Python's `json.dumps` writes non-finite floats, or with a byte order mark in front.
fn python_bodies() -> Vec<(&'static str, Vec<u8>)> {
    let object = |fields: &str| format!(r#"{{"model":"mock",{fields},{MESSAGES}}}"#);
    vec![
        (
            "byte order mark",
            [
                "\u{FEFF}".as_bytes(),
                object(r#""routing_key":"bom-session""#).as_bytes(),
            ]
            .concat(),
        ),
        (
            "NaN",
            object(r#""temperature":NaN,"routing_key":"nan-session""#).into_bytes(),
        ),
        (
            "infinities",
            object(
                r#""logit_bias":{"7":-Infinity},"top_p":Infinity,"prompt_cache_key":"inf-session""#,
            )
            .into_bytes(),
        ),
        (
            "mark and NaN",
            [
                "\u{FEFF}".as_bytes(),
                object(r#""presence_penalty":NaN,"prompt_cache_key":"bom-nan-session""#).as_bytes(),
            ]
            .concat(),
        ),
    ]
}

fn scenario(name: &str, overrides: Value) {
    let stack = Stack::start(name, StackOptions::new(plugin_config(overrides)));
    let before = stack.settled();
    let bodies = python_bodies();
    for (label, body) in &bodies {
        let request = chat_bytes(body.clone());
        let ranks: Vec<u32> = (0..TURNS)
            .map(|_| served_rank(&stack.send(&request)))
            .collect();
        assert!(
            ranks.iter().all(|r| *r == ranks[0]),
            "{name}, {label}: the key moved between ranks: {ranks:?}"
        );
    }

    // Duplicated members: Python's dict keeps the last one, so `routing_key` is "dup-last" for
    // the engine, and for the filter: later turns naming only "dup-last" hit its pin.
    let duplicated = chat_bytes(
        format!(
            r#"{{"routing_key":"dup-first","model":"mock",{MESSAGES},"routing_key":"dup-last"}}"#
        )
        .into_bytes(),
    );
    let last_only = chat_bytes(
        format!(r#"{{"model":"mock","routing_key":"dup-last",{MESSAGES}}}"#).into_bytes(),
    );
    let first = served_rank(&stack.send(&duplicated));
    for turn in 1..TURNS {
        let rank = served_rank(&stack.send(&last_only));
        assert_eq!(
            rank, first,
            "{name}: turn {turn} of the last duplicate's key moved"
        );
    }

    let keys = bodies.len() as u64 + 1;
    let after = stack.settled();
    let moved = |counter: &str| after.get(counter) - before.get(counter);
    assert_eq!(
        moved("body_malformed"),
        0,
        "{name}: a body Python reads was not read; counters: {}",
        after.nonzero()
    );
    assert_eq!(moved("affinity_miss"), keys, "{name}: {}", after.nonzero());
    assert_eq!(
        moved("affinity_hit"),
        keys * (TURNS as u64 - 1),
        "{name}: {}",
        after.nonzero()
    );
    assert_eq!(moved("no_key"), 0, "{name}: {}", after.nonzero());
}

#[test]
fn python_json_bodies_route_by_their_key() {
    scenario("python_bodies_top_level", json!({}));
    scenario(
        "python_bodies_prompt_walker",
        json!({ "assign": { "mode": "hash" }, "prefix": { "enabled": true } }),
    );
}
