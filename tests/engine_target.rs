//! End-to-end: one engine with internal data parallelism behind Envoy, told the rank the way
//! that engine honours it on each path (`target.mode: engine` with the `sglang` and `vllm`
//! presets). The upstream is `mock-rank --engine --engine-kind sglang|vllm`, which serves a
//! request on the rank the engine itself would honour (SGLang ignores the header on
//! `/generate`), so the rank reported here is the rank the engine used, not the one the filter
//! meant (`cargo test --test engine_target -- --nocapture` prints what each scenario saw).

mod support;

use std::collections::BTreeSet;

use serde_json::{json, Value};

use support::fnv::fnv1a64_hex;
use support::http::{Request, Response};
use support::requests::{plugin_config, KEY_HEADER, RANK_HEADER};
use support::stack::{echoed_rank, mock_info, upstream_headers, Stack, StackOptions};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const GENERATE: &str = "/generate";
const RESPONSES: &str = "/v1/responses";
const MESSAGES: &str = "/v1/messages";
const TRUST_HEADER: &str = "x-router-token";
const SECRET: &str = "engine-e2e-secret";

/// One engine-mode mock of `kind` behind Envoy, the filter configured with `config`.
fn engine_stack(name: &str, kind: &str, config: Value, extra: &[&str]) -> Stack {
    let mut args = vec!["--engine-kind", kind];
    args.extend_from_slice(extra);
    Stack::start(name, StackOptions::new(config).engine().mock_args(&args))
}

/// Hash placement (prefix placement off: the scenarios are about the target) with `target`.
fn with_target(target: Value, extra: Value) -> Value {
    let mut config = plugin_config(json!({
        "assign": { "mode": "hash", "seed": "engine-e2e" },
        "target": target,
    }));
    support::requests::merge(&mut config, extra);
    config
}

fn preset(engine: &str) -> Value {
    json!({ "mode": "engine", "engine": engine })
}

/// A body for `path` whose prompt is `text`.
fn body_for(path: &str, text: &str) -> String {
    match path {
        CHAT => json!({"model": "m", "messages": [{"role": "user", "content": text}]}),
        COMPLETIONS => json!({"model": "m", "prompt": text}),
        RESPONSES => json!({"model": "m", "input": text, "max_output_tokens": 2}),
        MESSAGES => {
            json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": text}]})
        }
        _ => json!({"text": text, "sampling_params": {"max_new_tokens": 2}}),
    }
    .to_string()
}

fn post(path: &str, body: &str) -> Request {
    Request::post(path).body("application/json", body.as_bytes().to_vec())
}

/// The internal rank the engine served on (its `mock.rank`), from a 200.
fn engine_rank(response: &Response) -> u32 {
    assert_eq!(response.status, 200, "{}", response.text());
    let rank = mock_info(response)["rank"]
        .as_u64()
        .unwrap_or_else(|| panic!("mock.rank missing: {}", response.text()));
    u32::try_from(rank).expect("a small rank")
}

/// `sent` with `"routed_dp_rank":rank,` inserted after its `{`: the only change the filter may
/// make to a body without a rank field.
fn with_rank_inserted(sent: &str, rank: u32) -> String {
    format!("{{\"routed_dp_rank\":{rank},{}", &sent[1..])
}

/// Asserts the engine read exactly `expected` (the mock reports the length and FNV-1a of the
/// bytes it read).
fn assert_upstream_body(response: &Response, expected: &str) {
    let info = mock_info(response);
    assert_eq!(
        (info["body_len"].as_u64(), info["body_fnv1a64"].as_str()),
        (
            Some(expected.len() as u64),
            Some(fnv1a64_hex(expected.as_bytes()).as_str())
        ),
        "the engine did not receive {expected}"
    );
}

/// Sends `turns` turns of `keys` conversations on `path`; returns per key the engine's rank of
/// each turn, checking each answer's echo against the rank the engine served on.
fn conversations(stack: &Stack, path: &str, keys: usize, turns: usize) -> Vec<Vec<u32>> {
    (0..keys)
        .map(|i| {
            let key = format!("{path}-conversation-{i}");
            (0..turns)
                .map(|turn| {
                    let sent = body_for(path, &format!("conversation {i}, turn {turn}"));
                    let response = stack.send(&post(path, &sent).header(KEY_HEADER, &key));
                    let rank = engine_rank(&response);
                    assert_eq!(echoed_rank(&response), rank, "echo vs engine on {path}");
                    if path == GENERATE {
                        assert_upstream_body(&response, &with_rank_inserted(&sent, rank));
                        assert!(!upstream_headers(&response).contains_key(RANK_HEADER));
                    } else {
                        let seen = &upstream_headers(&response)[RANK_HEADER];
                        assert_eq!(seen, &json!(rank.to_string()));
                    }
                    rank
                })
                .collect()
        })
        .collect()
}

/// Asserts every conversation stayed on its first turn's rank and the keys spread.
fn assert_sticky_and_spread(path: &str, ranks: &[Vec<u32>]) {
    let firsts: BTreeSet<u32> = ranks.iter().map(|turns| turns[0]).collect();
    println!("{path}: first turns on ranks {firsts:?}, every later turn on its first rank");
    for turns in ranks {
        assert!(turns.iter().all(|r| *r == turns[0]), "{path}: {turns:?}");
    }
    assert!(firsts.len() >= 3, "{path}: keys not spread: {firsts:?}");
}

#[test]
fn sglang_preset_keeps_conversations_on_every_path() {
    let stack = engine_stack(
        "sglang_preset",
        "sglang",
        with_target(preset("sglang"), json!({})),
        &[],
    );
    for path in [CHAT, COMPLETIONS, GENERATE, RESPONSES, MESSAGES] {
        let ranks = conversations(&stack, path, 16, 5);
        assert_sticky_and_spread(path, &ranks);
    }
    let counters = stack.settled();
    counters.assert_eq("target_body_rewritten", 16 * 5);
    counters.assert_eq("affinity_hit", 5 * 16 * 4);
    counters.assert_zero(&[
        "untargeted",
        "target_body_unwritable",
        "target_body_stripped",
    ]);
}

/// The shipped one-engine configs used to set only the header: SGLang ignores it on
/// `/generate` and balances, so a conversation's turns land anywhere.
#[test]
fn engine_header_misses_on_sglang_generate_and_the_preset_does_not() {
    let old = engine_stack(
        "sglang_engine_header",
        "sglang",
        with_target(json!({ "mode": "engine_header" }), json!({})),
        &[],
    );
    let mut moved = 0;
    let mut turns_total = 0;
    for i in 0..8 {
        let key = format!("old-config-{i}");
        let mut first = None;
        for turn in 0..4 {
            let sent = body_for(GENERATE, &format!("{key} turn {turn}"));
            let response = old.send(&post(GENERATE, &sent).header(KEY_HEADER, &key));
            let rank = engine_rank(&response);
            if turn > 0 {
                turns_total += 1;
                moved += usize::from(Some(rank) != first);
            }
            first = first.or(Some(rank));
        }
    }
    println!("engine_header on /generate: {moved} of {turns_total} later turns left their rank");
    assert!(
        moved * 2 >= turns_total,
        "the header was honoured on /generate?"
    );
    // The same config keeps chat conversations: SGLang honours the header there.
    assert_sticky_and_spread(CHAT, &conversations(&old, CHAT, 8, 3));
    drop(old);

    let fixed = engine_stack(
        "sglang_preset_generate",
        "sglang",
        with_target(preset("sglang"), json!({})),
        &[],
    );
    assert_sticky_and_spread(GENERATE, &conversations(&fixed, GENERATE, 8, 4));
}

#[test]
fn vllm_preset_keeps_conversations_and_leaves_other_paths_alone() {
    let stack = engine_stack(
        "vllm_preset",
        "vllm",
        with_target(preset("vllm"), json!({})),
        &[],
    );
    for path in [CHAT, COMPLETIONS, RESPONSES, MESSAGES] {
        assert_sticky_and_spread(path, &conversations(&stack, path, 12, 4));
    }
    // vLLM has no /generate: the request reaches it untouched and gets its 404.
    let sent = body_for(GENERATE, "no such path");
    let response = stack.send(&post(GENERATE, &sent).header(KEY_HEADER, "k"));
    assert_eq!(response.status, 404, "{}", response.text());
    assert_upstream_body(&response, &sent);
    let counters = stack.settled();
    counters.assert_eq("untargeted", 1);
    counters.assert_zero(&["target_body_rewritten", "target_body_stripped"]);
}

fn trusted_config(target: Value) -> Value {
    with_target(
        target,
        json!({ "explicit_rank": { "trusted_header": TRUST_HEADER, "trusted_secret": SECRET } }),
    )
}

#[test]
fn a_clients_own_rank_reaches_the_engine_only_when_trusted() {
    let stack = engine_stack(
        "client_rank_copies",
        "sglang",
        trusted_config(preset("sglang")),
        &[],
    );
    // Untrusted: its body rank fields are replaced or removed, whatever the content type says.
    let mut ranks = BTreeSet::new();
    for i in 0..8 {
        let sent =
            format!(r#"{{"text":"untrusted {i}","routed_dp_rank":3,"data_parallel_rank":3}}"#);
        for request in [
            post(GENERATE, &sent),
            // No content type: the engine still parses it as JSON.
            Request {
                headers: Vec::new(),
                ..post(GENERATE, &sent)
            },
        ] {
            let response = stack.send(&request);
            let rank = engine_rank(&response);
            assert_eq!(echoed_rank(&response), rank);
            // Byte-exact: the value replaced in place, the alias removed with its comma.
            let want = sent
                .replace(
                    "\"routed_dp_rank\":3",
                    &format!("\"routed_dp_rank\":{rank}"),
                )
                .replace(",\"data_parallel_rank\":3", "");
            assert_upstream_body(&response, &want);
            ranks.insert(rank);
        }
    }
    println!("untrusted /generate asking for rank 3 served on {ranks:?}");
    assert!(ranks.iter().any(|r| *r != 3), "{ranks:?}");

    // Trusted: the body's rank and an explicit header on /generate are honoured.
    let sent = json!({"text": "trusted", "routed_dp_rank": 3}).to_string();
    let response = stack.send(&post(GENERATE, &sent).header(TRUST_HEADER, SECRET));
    assert_eq!((engine_rank(&response), echoed_rank(&response)), (3, 3));
    // Also without a content type (the engine parses the body as JSON all the same): the filter
    // reads the rank it would otherwise have replaced unread.
    let untyped = Request {
        headers: Vec::new(),
        ..post(GENERATE, &sent)
    };
    let response = stack.send(&untyped.header(TRUST_HEADER, SECRET));
    assert_eq!((engine_rank(&response), echoed_rank(&response)), (3, 3));
    assert_upstream_body(&response, &sent);
    let sent = body_for(GENERATE, "trusted header");
    let response = stack.send(
        &post(GENERATE, &sent)
            .header(TRUST_HEADER, SECRET)
            .header(RANK_HEADER, "2"),
    );
    assert_eq!(
        engine_rank(&response),
        2,
        "the header on /generate reached the body"
    );
    assert_upstream_body(&response, &with_rank_inserted(&sent, 2));

    let counters = stack.settled();
    counters.assert_eq("target_body_stripped", 16);
    counters.assert_eq("explicit", 3);
}

/// The engine's HTTP layer (FastAPI) reads the content type as Latin-1 and strips Python's
/// whitespace from it, which includes `\xa0` and `\x85`: a body sent as `application/json\xa0`
/// is parsed as JSON there, so the filter must edit it as well, or an untrusted client's rank
/// field reaches the engine.
#[test]
fn a_content_type_padded_with_python_whitespace_does_not_carry_a_clients_rank_past() {
    let stack = engine_stack(
        "client_rank_padded_type",
        "sglang",
        trusted_config(preset("sglang")),
        &[],
    );
    let mut ranks = Vec::new();
    let padded = [
        &b"application/json\xa0"[..],
        b"\x85application/json",
        b"Application/JSON\xa0; charset=utf-8",
    ];
    for (i, content_type) in padded.iter().cycle().take(6).enumerate() {
        let sent = format!(r#"{{"text":"padded {i}","routed_dp_rank":3}}"#);
        let raw = support::http::raw_request_typed(GENERATE, content_type, &[], sent.as_bytes());
        let outcome = support::http::send_raw(stack.addr(), raw, "POST");
        let response = outcome.response.unwrap_or_else(|| {
            panic!(
                "{content_type:?}: no response ({:?})",
                String::from_utf8_lossy(&outcome.received)
            )
        });
        let rank = engine_rank(&response);
        assert_eq!(echoed_rank(&response), rank, "{content_type:?}");
        let want = sent.replace(
            "\"routed_dp_rank\":3",
            &format!("\"routed_dp_rank\":{rank}"),
        );
        assert_upstream_body(&response, &want);
        ranks.push(rank);
    }
    println!("padded content types asking for rank 3 served on {ranks:?}");
    assert!(ranks.iter().any(|&r| r != 3), "{ranks:?}");
    // A body already naming the filter's rank needs no edit.
    let rewritten = ranks.iter().filter(|&&r| r != 3).count() as u64;
    stack.assert_counter("target_body_rewritten", rewritten);
}

#[test]
fn with_no_rank_chosen_a_clients_copies_are_still_removed() {
    // Envoy mode: keyless requests are balanced by the engine; the filter chooses no rank, so
    // only the removal is left to do. The override is off: nobody may choose.
    let stack = engine_stack(
        "client_copies_balanced",
        "sglang",
        plugin_config(json!({
            "target": preset("sglang"),
            "explicit_rank": { "enabled": false },
        })),
        &[],
    );
    let mut ranks = Vec::new();
    for (path, sent) in [
        (GENERATE, r#"{"text":"a","routed_dp_rank":1}"#),
        (CHAT, r#"{"routed_dp_rank":1,"model":"m","messages":[]}"#),
        (GENERATE, r#"{"data_parallel_rank":1, "text":"b"}"#),
        (
            COMPLETIONS,
            r#"{"prompt":"c","data_parallel_rank":1,"routed_dp_rank":1}"#,
        ),
    ] {
        // SGLang's override header (honoured on every path when the server enables header
        // overrides) goes too.
        let request = post(path, sent)
            .header(RANK_HEADER, "1")
            .header("x-override-routed-dp-rank", "1");
        let response = stack.send(&request);
        ranks.push(engine_rank(&response));
        let want = sent
            .replace(",\"routed_dp_rank\":1", "")
            .replace("\"routed_dp_rank\":1,", "")
            .replace("\"data_parallel_rank\":1, ", "")
            .replace(",\"data_parallel_rank\":1", "");
        assert_upstream_body(&response, &want);
        assert!(!upstream_headers(&response).contains_key(RANK_HEADER));
        assert!(!upstream_headers(&response).contains_key("x-override-routed-dp-rank"));
    }
    println!("balanced by the engine, client asked for 1: {ranks:?}");
    assert!(ranks.iter().any(|r| *r != 1), "{ranks:?}");
    let counters = stack.settled();
    counters.assert_eq("target_body_stripped", 4);
    counters.assert_eq("target_header_stripped", 4);
    counters.assert_zero(&["target_body_rewritten"]);

    // An engine header named apart from the explicit-rank header is stripped too.
    let other = engine_stack(
        "engine_header_other_name",
        "generic",
        plugin_config(json!({
            "target": { "mode": "engine_header", "engine_header": "x-engine-rank" },
            "explicit_rank": { "enabled": false },
        })),
        &[],
    );
    for _ in 0..3 {
        let response = other.send(&post(CHAT, &body_for(CHAT, "x")).header("x-engine-rank", "3"));
        engine_rank(&response);
        assert!(
            !upstream_headers(&response).contains_key("x-engine-rank"),
            "the client's engine header reached the engine"
        );
    }
    other.settled().assert_eq("target_header_stripped", 3);
}

#[test]
fn bodies_the_filter_cannot_edit() {
    let small = json!({ "body": { "max_bytes": 2048 } });
    // Everyone may choose a rank: a too-large body goes as sent and the engine places it.
    let open = engine_stack(
        "unwritable_open",
        "sglang",
        with_target(preset("sglang"), small.clone()),
        &[],
    );
    let big = body_for(GENERATE, &"x".repeat(4096));
    let response = open.send(&post(GENERATE, &big).header(KEY_HEADER, "big"));
    let rank = engine_rank(&response);
    assert_eq!(
        echoed_rank(&response),
        rank,
        "the echo names the engine's own choice"
    );
    assert_upstream_body(&response, &big);
    let counters = open.settled();
    counters.assert_eq("target_body_unwritable", 1);
    counters.assert_eq("learned", 1);
    drop(open);

    // With a trust secret, an untrusted caller's unreadable body is refused.
    let mut config = trusted_config(preset("sglang"));
    support::requests::merge(&mut config, small);
    let closed = engine_stack("unwritable_closed", "sglang", config, &[]);
    let response = closed.send(&post(GENERATE, &big).header(KEY_HEADER, "refused"));
    assert_eq!(response.status, 413, "{}", response.text());
    assert_eq!(response.json()["error"]["code"], "rank_fields_unchecked");
    // The refused request reached no rank: its key is not pinned by it, so the key's next
    // request is placed afresh, not sent where the refused one would have gone.
    let small_body = body_for(GENERATE, "small");
    let response = closed.send(&post(GENERATE, &small_body).header(KEY_HEADER, "refused"));
    engine_rank(&response);
    let counters = closed.settled();
    counters.assert_eq("affinity_miss", 2);
    counters.assert_zero(&["affinity_hit"]);
    let response = closed.send(&post(GENERATE, "{\"text\":"));
    assert_eq!(response.status, 400, "{}", response.text());
    let response = closed.send(&post(GENERATE, &big).header(TRUST_HEADER, SECRET));
    engine_rank(&response);
    let served: u64 = closed.mocks[0].stats()["per_rank"]
        .as_array()
        .expect("per_rank")
        .iter()
        .map(|r| r["requests"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(
        served, 2,
        "only the trusted request and the small one reached the engine"
    );
    closed.settled().assert_eq("target_body_unwritable", 3);
}

/// SGLang prefill/decode disaggregation: the prefill leg placed by the room rule needs
/// nothing on the decode leg; a prefill leg pinned to another rank needs
/// `disagg_prefill_dp_rank` on the decode leg, which the caller takes from `x-dp-rank`.
#[test]
fn pd_legs_agree_on_the_prefill_rank() {
    let prefill = engine_stack(
        "pd_prefill",
        "sglang",
        plugin_config(
            json!({ "assign": { "mode": "bootstrap_room" }, "target": preset("sglang") }),
        ),
        &[],
    );
    let decode = engine_stack(
        "pd_decode",
        "sglang",
        with_target(preset("sglang"), json!({})),
        &["--prefill-dp-size", "4"],
    );
    let assumed = |response: &Response| {
        assert_eq!(response.status, 200, "{}", response.text());
        mock_info(response)["pd"]["prefill_dp_rank"]
            .as_u64()
            .unwrap_or_else(|| panic!("mock.pd missing: {}", response.text()))
    };
    for room in [7u64, 1_000_003, 42, 9_007_199_254_740_000] {
        let leg = json!({"text": format!("pd {room}"), "bootstrap_room": room}).to_string();
        // The room rule: both sides compute room % 4.
        let p = prefill.send(&post(GENERATE, &leg));
        let p_rank = engine_rank(&p);
        assert_eq!((p_rank as u64, echoed_rank(&p)), (room % 4, p_rank));
        assert_eq!(assumed(&decode.send(&post(GENERATE, &leg))), room % 4);

        // Pinned elsewhere (an explicit rank): the decode leg must be told.
        let pinned = ((room + 1) % 4) as u32;
        let p = prefill.send(&post(GENERATE, &leg).header(RANK_HEADER, &pinned.to_string()));
        assert_eq!(
            engine_rank(&p),
            pinned,
            "the prefill engine honoured the pin"
        );
        let echoed = echoed_rank(&p);
        assert_ne!(
            assumed(&decode.send(&post(GENERATE, &leg))),
            u64::from(echoed)
        );
        let told = json!({"text": format!("pd {room}"), "bootstrap_room": room,
                          "disagg_prefill_dp_rank": echoed})
        .to_string();
        let d = decode.send(&post(GENERATE, &told));
        assert_eq!(
            assumed(&d),
            u64::from(echoed),
            "the decode leg fetches from the prefill rank"
        );
        println!(
            "room {room}: room rule on {}, pinned prefill {echoed}, decode told {echoed}",
            room % 4
        );
    }
    // A batched leg has a room per item: one rank for the request would send some items' KV
    // cache where their decode legs do not look, so the filter sets none (the engine places
    // each item by its own room).
    let batch = json!({"text": ["pd a", "pd b"], "bootstrap_room": [5, 6]}).to_string();
    let p = prefill.send(&post(GENERATE, &batch));
    assert_eq!(p.status, 200, "{}", p.text());
    assert_upstream_body(&p, &batch);
    let counters = prefill.settled();
    counters.assert_eq("bootstrap_room", 4);
    counters.assert_eq("bootstrap_room_unplaced", 1);
    counters.assert_eq("explicit", 4);
    counters.assert_eq("target_body_rewritten", 8);
}
