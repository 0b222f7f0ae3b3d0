//! The OpenAI Python SDK as the client: chat completions and completions, streamed and not, and
//! the Responses API without a key,
//! through a real Envoy with the real filter in front of mock ranks. The SDK's own arguments
//! carry the routing (`prompt_cache_key=`, `user=`, `extra_headers=` for an explicit rank), so
//! these are the requests applications send, serialised by the SDK, unchanged.
//!
//! Every call is checked for the rank that served it: the `x-dp-rank` header the SDK got back
//! and the rank the mock wrote into the completion (or into every streamed chunk) must agree.
//! The client script is `tests/clients/openai_client.py`; the SDK is pinned and installed by
//! `scripts/install-tools.sh`, and a missing one fails these tests.

mod support;

use std::collections::BTreeMap;

use serde_json::{json, Value};

use support::clients::run_client;
use support::requests::{plugin_config, DP_SIZE, RANK_HEADER};
use support::stack::{Stack, StackOptions};

const TURNS: usize = 4;

fn start(name: &str) -> Stack {
    Stack::start(name, StackOptions::new(plugin_config(json!({}))))
}

/// Runs the SDK client over `plan` against the stack's Envoy.
fn sdk(stack: &Stack, plan: &[Value]) -> Vec<Value> {
    let base_url = format!("http://{}/v1", stack.addr());
    let reports = run_client("openai_client.py", &[&base_url], &json!(plan));
    assert_eq!(
        reports.len(),
        plan.len(),
        "one report per call: {reports:?}"
    );
    reports
}

/// One turn of conversation `conversation`, as the client script reads it.
fn turn(conversation: &str, api: &str, stream: bool, turn: usize, kwargs: Value) -> Value {
    json!({
        "label": format!("{conversation} turn {turn}"),
        "conversation": conversation,
        "api": api,
        "stream": stream,
        "say": format!("question {turn} of {conversation}"),
        "kwargs": kwargs,
    })
}

/// The rank that served one call: the echoed header, which every rank the body reports (the
/// completion's, or each streamed chunk's) must equal; a non-streamed answer's text names it too.
fn served(report: &Value) -> u32 {
    let label = &report["label"];
    assert_eq!(report["status"], json!(200), "{label}: {report}");
    let header: u32 = report["header_rank"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{label}: no numeric x-dp-rank: {report}"));
    let body_ranks = report["body_ranks"]
        .as_array()
        .filter(|ranks| !ranks.is_empty())
        .unwrap_or_else(|| panic!("{label}: no rank in the body: {report}"));
    assert!(
        body_ranks.iter().all(|r| r == &json!(header)),
        "{label}: the body's ranks {body_ranks:?} disagree with x-dp-rank {header}"
    );
    header
}

#[test]
fn sdk_conversations_stick_to_their_rank() {
    let stack = start("openai_sdk_conversations");
    // (conversation, api, streamed, the SDK arguments of turn t)
    type Kwargs = fn(usize) -> Value;
    let conversations: [(&str, &str, bool, Kwargs); 6] = [
        (
            "chat-cache-key",
            "chat",
            false,
            |_| json!({ "prompt_cache_key": "sdk-chat-cache-key" }),
        ),
        (
            "chat-cache-key-streamed",
            "chat",
            true,
            |_| json!({ "prompt_cache_key": "sdk-chat-streamed" }),
        ),
        (
            "chat-user",
            "chat",
            false,
            |_| json!({ "user": "sdk-chat-user" }),
        ),
        // `prompt_cache_key` comes before `user` in `routing_key.body_fields`: a user that
        // changes every turn must not move the conversation (each turn would be a new key).
        (
            "chat-cache-key-over-user",
            "chat",
            true,
            |t| json!({ "prompt_cache_key": "sdk-cache-key-wins", "user": format!("user-of-turn-{t}") }),
        ),
        (
            "completions-user",
            "completions",
            false,
            |_| json!({ "user": "sdk-completions-user" }),
        ),
        (
            "completions-user-streamed",
            "completions",
            true,
            |_| json!({ "user": "sdk-completions-streamed" }),
        ),
    ];
    // Turn by turn across the conversations, as concurrent users would interleave.
    let plan: Vec<Value> = (0..TURNS)
        .flat_map(|t| {
            conversations
                .iter()
                .map(move |(name, api, stream, kwargs)| turn(name, api, *stream, t, kwargs(t)))
        })
        .collect();
    let before = stack.settled();
    let reports = sdk(&stack, &plan);

    let mut ranks: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (step, report) in plan.iter().zip(&reports) {
        let rank = served(report);
        if step["stream"] == json!(false) {
            let text = report["text"].as_str().unwrap_or_default();
            assert!(
                text.starts_with(&format!("Hello from DP rank {rank}")),
                "{}: answer {text:?} from rank {rank}",
                report["label"]
            );
        }
        let name = step["conversation"].as_str().unwrap_or_default();
        ranks.entry(name).or_default().push(rank);
    }
    for (name, served) in &ranks {
        assert_eq!(served.len(), TURNS, "{name}");
        assert!(
            served.iter().all(|r| *r == served[0]),
            "{name}: the conversation moved between ranks: {served:?}"
        );
    }

    // Exact: each conversation's key missed once (its first turn, learned from the rank Envoy
    // chose) and hit on every later turn; no call was keyless or unreadable.
    let after = stack.settled();
    let moved = |counter: &str| after.get(counter) - before.get(counter);
    let keys = conversations.len() as u64;
    let report = after.nonzero();
    assert_eq!(moved("affinity_miss"), keys, "{report}");
    assert_eq!(moved("learned"), keys, "{report}");
    assert_eq!(moved("affinity_hit"), keys * (TURNS as u64 - 1), "{report}");
    for counter in ["no_key", "body_malformed", "explicit"] {
        assert_eq!(moved(counter), 0, "{counter}: {report}");
    }
}

/// The Responses API through the SDK, with no routing key and the shipped defaults: each
/// conversation resends its items and the answers' output items as the SDK returned them, and
/// the prompt alone keeps it on its rank turn after turn, the conversations spread.
#[test]
fn sdk_responses_conversations_keep_their_rank_without_a_key() {
    const CONVERSATIONS: usize = 8;
    let stack = Stack::start(
        "openai_sdk_responses",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let instructions = "You are the support agent of a bookshop. Be brief and exact. ".repeat(32);
    let plan: Vec<Value> = (0..TURNS)
        .flat_map(|t| {
            let instructions = instructions.clone();
            // A different order every turn: a placement that ignores the prompt cannot keep
            // them on their ranks by cycling through the ranks in step with them.
            (0..CONVERSATIONS).map(move |i| {
                let c = (i * 3 + t) % CONVERSATIONS;
                let name = format!("responses-{c}");
                let mut step = turn(&name, "responses", false, t, json!({}));
                let repeat = if t == 0 { 64 } else { 8 };
                step["say"] =
                    json!(format!("Customer {c}, question {t}: order {c}-{t}? ").repeat(repeat));
                step["instructions"] = json!(instructions);
                step
            })
        })
        .collect();
    let reports = sdk(&stack, &plan);
    let mut ranks: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (step, report) in plan.iter().zip(&reports) {
        let rank = served(report);
        let text = report["text"].as_str().unwrap_or_default();
        assert!(
            text.starts_with(&format!("Hello from DP rank {rank}")),
            "{}: answer {text:?} from rank {rank}",
            report["label"]
        );
        let name = step["conversation"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        ranks.entry(name).or_default().push(rank);
    }
    let firsts: std::collections::BTreeSet<u32> = ranks.values().map(|r| r[0]).collect();
    println!("Responses API through the SDK: {ranks:?}");
    for (name, served) in &ranks {
        assert_eq!(served.len(), TURNS, "{name}");
        assert!(
            served.iter().all(|r| *r == served[0]),
            "{name}: the conversation moved between ranks: {served:?}"
        );
    }
    assert!(firsts.len() >= 2, "conversations not spread: {firsts:?}");
    let counters = stack.settled();
    assert!(counters.get("prefix_hit") >= (CONVERSATIONS * (TURNS - 1)) as u64);
}

#[test]
fn sdk_explicit_rank_through_extra_headers() {
    let stack = start("openai_sdk_explicit_rank");
    let with_rank = |mut step: Value, rank: u32| {
        step["extra_headers"] = json!({ RANK_HEADER: rank.to_string() });
        step
    };
    let mut plan: Vec<Value> = Vec::new();
    let mut wanted: Vec<Option<u32>> = Vec::new();
    // Every rank, on each API, streamed and not: the explicit rank serves.
    for rank in 0..DP_SIZE {
        for (api, stream) in [("chat", false), ("chat", true), ("completions", false)] {
            let name = format!("explicit-{api}-{stream}-{rank}");
            plan.push(with_rank(turn(&name, api, stream, 0, json!({})), rank));
            wanted.push(Some(rank));
        }
    }
    // A keyed conversation: its pin is untouched by explicit turns on every rank in between,
    // so its last turn is back on the rank of its first.
    let pinned = |t| {
        turn(
            "pinned",
            "chat",
            false,
            t,
            json!({ "prompt_cache_key": "sdk-pinned" }),
        )
    };
    plan.push(pinned(0));
    wanted.push(None);
    for rank in 0..DP_SIZE {
        plan.push(with_rank(pinned(1 + rank as usize), rank));
        wanted.push(Some(rank));
    }
    plan.push(pinned(1 + DP_SIZE as usize));
    wanted.push(None);

    let before = stack.settled();
    let reports = sdk(&stack, &plan);
    let ranks: Vec<u32> = reports.iter().map(served).collect();
    for ((report, rank), want) in reports.iter().zip(&ranks).zip(&wanted) {
        if let Some(want) = want {
            assert_eq!(
                rank, want,
                "{}: explicit rank not honoured",
                report["label"]
            );
        }
    }
    let (first, last) = (
        ranks[ranks.len() - DP_SIZE as usize - 2],
        ranks[ranks.len() - 1],
    );
    assert_eq!(
        first, last,
        "the pinned conversation moved after explicit turns: {ranks:?}"
    );

    let after = stack.settled();
    let moved = |counter: &str| after.get(counter) - before.get(counter);
    let explicit = wanted.iter().filter(|w| w.is_some()).count() as u64;
    let report = after.nonzero();
    assert_eq!(moved("explicit"), explicit, "{report}");
    assert_eq!(moved("affinity_miss"), 1, "{report}");
    assert_eq!(moved("affinity_hit"), 1, "{report}");
    assert_eq!(moved("invalid_rank"), 0, "{report}");
}
