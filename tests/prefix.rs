//! End-to-end scenarios of prefix placement (`prefix.enabled`): the compiled filter in
//! a real Envoy (2 workers) in front of 4 mock ranks. Requests without a routing key that share a
//! prompt prefix land where it was served before; a prefix-matched rank that is full is avoided;
//! a shared prefix yields to an idler rank while conversations stay on theirs; conversations of
//! short turns keep one rank, and so do conversations sent as one growing message through two
//! replicas, and conversations that all send one key (its pin yields to their prompts); a long shared prompt is copied to the homes of new sessions on a
//! quiet cluster instead of pulling them all onto its first holder;
//! agent loops on the Responses and Messages APIs keep their rank;
//! a keyed request records its prefix for keyless followers; a rank that fails forgets the
//! prompt's entries; the index stays at its bound.
//! (`cargo test --test prefix -- --nocapture` prints what each scenario measured.)

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{json, Value};

use support::http::{Client, Request};
use support::requests::{merge, plugin_config, DP_SIZE, KEY_HEADER, RANK_HEADER};
use support::stack::{mock_info, served_rank, Stack, StackOptions};

// ---------------------------------------------------------------- helpers

/// A plugin configuration with prefix placement on (`hash` mode, as by default), deep-merged
/// with `extra`.
fn prefix_config(extra: Value) -> Value {
    let mut overrides = json!({ "assign": { "mode": "hash" }, "prefix": { "enabled": true } });
    merge(&mut overrides, extra);
    plugin_config(overrides)
}

/// A system prompt of exactly 16 KiB, distinct from its first bytes for each `tag`.
fn system_prompt(tag: &str) -> String {
    let mut s = format!("System prompt {tag}. You are a helpful assistant for team {tag}. ");
    while s.len() < 16 * 1024 {
        s.push_str("Follow the policies, cite your sources, and keep answers short. ");
    }
    s.truncate(16 * 1024);
    s
}

/// A keyless chat request: `system` then one user message.
fn chat_with(system: &str, user: &str) -> Request {
    Request::post("/v1/chat/completions").json(&json!({
        "model": "mock",
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": user },
        ],
    }))
}

/// The first prompts of `sessions` agent sessions: one shared prompt of exactly 96 KiB (a coding
/// agent's instructions and tools), then each session's own task (2 KiB).
fn agent_sessions(sessions: usize) -> Vec<String> {
    let mut shared = String::from("You are a coding agent. Tools: ");
    for n in 0.. {
        if shared.len() >= 96 * 1024 {
            break;
        }
        shared.push_str(&format!(
            "tool_{n}(path, pattern) searches the repository; "
        ));
    }
    shared.truncate(96 * 1024);
    (0..sessions)
        .map(|s| {
            format!(
                "{shared}\n{}",
                format!("Task {s}: fix failing test {s}. ").repeat(64)
            )
        })
        .collect()
}

/// From each conversation's ranks turn by turn: its first turns per rank, and the conversations
/// that moved.
fn homes_and_moves(ranks: &[Vec<u32>]) -> (Vec<usize>, Vec<&Vec<u32>>) {
    let moved = ranks
        .iter()
        .filter(|r| r.iter().any(|&x| x != r[0]))
        .collect();
    (per_rank(ranks.iter().map(|r| r[0])), moved)
}

/// `conversations` chats opening with the same `system` and `first` messages, three turns each,
/// every request given the members `extra(c)` too (what sets conversation `c` apart); the rank
/// of each turn, per conversation.
fn three_turns_each(
    stack: &Stack,
    conversations: usize,
    system: &str,
    first: &str,
    extra: impl Fn(usize) -> Value,
) -> Vec<Vec<u32>> {
    let mut histories: Vec<Vec<Value>> = (0..conversations)
        .map(|_| {
            vec![
                json!({ "role": "system", "content": system }),
                json!({ "role": "user", "content": first }),
            ]
        })
        .collect();
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); conversations];
    for turn in 0..3 {
        for (c, history) in histories.iter_mut().enumerate() {
            let mut body = json!({ "model": "mock", "messages": history });
            support::requests::merge(&mut body, extra(c));
            let request = Request::post("/v1/chat/completions").json(&body);
            ranks[c].push(served_rank(&stack.send(&request)));
            let answer = format!("Conversation {c} went on, turn {turn}. ").repeat(8);
            history.push(json!({ "role": "assistant", "content": answer }));
            history.push(json!({ "role": "user", "content": format!("Go on, step {turn}.") }));
        }
    }
    ranks
}

/// No conversation moved between turns (`moved`, from `homes_and_moves`), and their first turns
/// went to 3 ranks at least (`homes`: first turns per rank).
fn assert_kept_and_spread(what: &str, homes: &[usize], moved: &[&Vec<u32>]) {
    assert!(
        moved.is_empty(),
        "{what}: conversations moved between turns: {moved:?}"
    );
    assert!(
        homes.iter().filter(|n| **n > 0).count() >= 3,
        "{what}: conversations not spread over the ranks: {homes:?}"
    );
}

/// A keyless completions request for 8 tokens.
fn completion(prompt: &str) -> Request {
    Request::post("/v1/completions")
        .json(&json!({ "model": "mock", "prompt": prompt, "max_tokens": 8 }))
}

fn per_rank(ranks: impl IntoIterator<Item = u32>) -> Vec<usize> {
    let mut counts = vec![0; DP_SIZE as usize];
    for r in ranks {
        counts[r as usize] += 1;
    }
    counts
}

/// Streams 12 tokens (3 s with `--stream-interval-ms 250`) from `rank`, chosen explicitly so the
/// request counts in flight there: how the scenarios make a rank busy.
fn hold_stream(addr: std::net::SocketAddr, rank: u32) {
    let request = Request::post("/v1/chat/completions")
        .json(&json!({
            "model": "mock",
            "stream": true,
            "max_tokens": 12,
            "messages": [{ "role": "user", "content": "hold" }],
        }))
        .header(RANK_HEADER, &rank.to_string());
    assert_eq!(support::http::stream(addr, &request).status, 200);
}

/// Lets `on_log` of the requests just answered release their in-flight slots.
fn settle() {
    std::thread::sleep(Duration::from_millis(200));
}

// ---------------------------------------------------------------- (a) + (b)

/// Keyless requests sharing a 16 KiB system prompt follow the first one's rank, in
/// `least_inflight` mode (the first placed by load) and in `hash` mode (the first placed at the
/// home of its prompt's anchor); unrelated prompts spread.
#[test]
fn shared_system_prompt_keyless_requests_share_a_rank() {
    const PROMPTS: usize = 6;
    const UNRELATED: usize = 40;
    for mode in ["least_inflight", "hash"] {
        let stack = Stack::start(
            &format!("prefix_shared_system_prompt_{mode}"),
            StackOptions::new(prefix_config(json!({ "assign": { "mode": mode } }))),
        );
        let mut firsts = Vec::new();
        for i in 0..PROMPTS {
            let system = system_prompt(&format!("{mode}-{i}"));
            let first =
                served_rank(&stack.send(&chat_with(&system, "How do I reset my password?")));
            let second = served_rank(&stack.send(&chat_with(&system, "Where is my invoice?")));
            let third = served_rank(&stack.send(&chat_with(&system, "Say hello.")));
            assert_eq!(
                (second, third),
                (first, first),
                "[{mode}] system prompt {i}: requests sharing it went to {first}, {second}, {third}"
            );
            firsts.push(first);
        }
        // 16 KiB = 32 blocks of 512 B, all shared: every follower matched 32 blocks.
        let followers = 2 * PROMPTS as u64;
        stack.assert_counter("prefix_hit", followers);
        stack.assert_counter("prefix_hit_blocks_16_63", followers);
        stack.assert_counter("prefix_miss", PROMPTS as u64);

        // Unrelated prompts (different from their first block): misses, spread over the ranks.
        let ranks: Vec<u32> = (0..UNRELATED)
            .map(|i| {
                let prompt = format!("Unrelated prompt number {i}: ").repeat(40);
                served_rank(&stack.send(&chat_with(&prompt, "?")))
            })
            .collect();
        let spread = per_rank(ranks.iter().copied());
        println!(
            "[{mode}] {PROMPTS} shared system prompts: first requests on {firsts:?}, all followers \
             on the same rank; {UNRELATED} unrelated prompts per rank {spread:?}"
        );
        assert!(
            spread.iter().filter(|n| **n > 0).count() >= 3,
            "[{mode}] unrelated prompts not spread: {spread:?}"
        );
        // No unrelated prompt matched a prefix: `prefix_hit` did not move. No match at all was
        // skipped for a full rank (counters only grow: a 0 now was a 0 after the followers).
        let counters = stack.settled();
        counters.assert_eq("prefix_miss", (PROMPTS + UNRELATED) as u64);
        counters.assert_eq("prefix_hit", followers);
        counters.assert_zero(&["prefix_skipped_full"]);
        // Every first request and every unrelated prompt was recorded (followers matched their
        // whole 32-block prefix and 2-block tail positions may be new: at least the firsts).
        let recorded = counters.get("prefix_recorded");
        assert!(
            recorded >= (PROMPTS + UNRELATED) as u64,
            "[{mode}] prefix_recorded {recorded}: not every first request was recorded"
        );

        // A malformed body on an LLM path is passed through untouched and counted, not a panic.
        let broken = Request::post("/v1/chat/completions").body(
            "application/json",
            br#"{"model":"m","messages":[{"role":"user","content":"x"#.to_vec(),
        );
        let response = stack.send(&broken);
        assert_eq!(response.status, 200, "{}", response.text());
        assert_eq!(
            mock_info(&response)["body_len"],
            json!(broken.body.len()),
            "body changed"
        );
        stack.assert_counter("body_malformed", 1);
        let again = system_prompt(&format!("{mode}-0"));
        assert_eq!(
            served_rank(&stack.send(&chat_with(&again, "Still there?"))),
            firsts[0],
            "[{mode}] the VM forgot its index after a malformed body"
        );
    }
}

// ---------------------------------------------------------------- (c)

/// A prefix-matched rank with more requests in flight than the load bound allows is avoided
/// (`prefix_skipped_full`); once its load drops, the prefix sends requests back to it.
#[test]
fn full_prefix_rank_is_avoided() {
    const HELD: usize = 3;
    let stack = Stack::start(
        "prefix_full_rank_is_avoided",
        StackOptions::new(prefix_config(json!({
            "assign": { "mode": "least_inflight", "min_capacity": 1 },
        })))
        .mock_args(&["--stream-interval-ms", "250"]),
    );
    let system = system_prompt("busy");
    let home = served_rank(&stack.send(&chat_with(&system, "First question")));
    settle();
    assert_eq!(
        served_rank(&stack.send(&chat_with(&system, "Second question"))),
        home
    );
    stack.assert_counter("prefix_hit", 1);
    settle();

    // Hold HELD long streams on the prefix's rank (explicit rank: counted in flight there).
    // Capacity with 3 in flight on 4 ranks, factor 1.25, floor 1: ceil(1.25 × 4 / 4) = 2.
    let addr = stack.addr();
    let (avoided_to, after) = std::thread::scope(|scope| {
        let holders: Vec<_> = (0..HELD)
            .map(|_| scope.spawn(move || hold_stream(addr, home)))
            .collect();
        std::thread::sleep(Duration::from_millis(600));
        let busy = served_rank(&stack.send(&chat_with(&system, "Third question, rank busy")));
        for h in holders {
            h.join().expect("holder thread");
        }
        settle();
        let after = served_rank(&stack.send(&chat_with(&system, "Fourth question, rank idle")));
        (busy, after)
    });
    println!(
        "prefix on rank {home}; with {HELD} streams held there the next request went to \
         {avoided_to}; after they ended, to {after}"
    );
    assert_ne!(avoided_to, home, "a full prefix rank was not avoided");
    stack.assert_counter("prefix_skipped_full", 1);
    assert_eq!(
        after, home,
        "the prefix still points at its rank: the request placed elsewhere overwrote nothing"
    );
    stack.assert_counter("prefix_hit", 2);
    stack.assert_counter("explicit", HELD as u64);
}

/// A prompt sharing only a prefix that other prompts already went on past (a *branched* system
/// prompt) yields to an idler rank when the work queued on its rank outweighs the prefix
/// (`prefix_spread`), while a conversation's own, longer history stays on the busy rank: the
/// spread needs no full rank, only a busier one. With `prefix.load_blocks` 40, one request in
/// flight outweighs the 32-block system prompt but not the conversation's 48 indexed blocks.
#[test]
fn shared_prefix_spreads_while_conversations_stay() {
    let stack = Stack::start(
        "prefix_shared_prefix_spreads",
        // The default floor (min_capacity 8): one request in flight never makes a rank full.
        StackOptions::new(prefix_config(json!({
            "assign": { "mode": "least_inflight" },
            "prefix": { "load_blocks": 40 }
        })))
        .mock_args(&["--stream-interval-ms", "250"]),
    );
    let system = system_prompt("shared");
    // User messages of 9 KiB: each prompt reaches indexed positions past the 32-block system
    // prompt (48), so every conversation has its own entries.
    let user = |tag: &str| format!("{tag}: ").repeat(9 * 1024 / (tag.len() + 2) + 1);
    let home = served_rank(&stack.send(&chat_with(&system, &user("first conversation"))));
    settle();
    // The second conversation matches the system prompt (not branched yet), goes to its rank and
    // marks it branched by recording its own positions past it.
    assert_eq!(
        served_rank(&stack.send(&chat_with(&system, &user("second conversation")))),
        home
    );
    settle();
    stack.settled().assert_zero(&["prefix_spread"]);

    let addr = stack.addr();
    let (third, next_turn) = std::thread::scope(|scope| {
        let holder = scope.spawn(move || hold_stream(addr, home));
        std::thread::sleep(Duration::from_millis(600));
        // One request in flight on `home`, none elsewhere.
        let third = served_rank(&stack.send(&chat_with(&system, &user("third conversation"))));
        let next_turn = served_rank(&stack.send(&Request::post("/v1/chat/completions").json(
            &json!({
                "model": "mock",
                "messages": [
                    { "role": "system", "content": system },
                    { "role": "user", "content": user("first conversation") },
                    { "role": "assistant", "content": "An answer." },
                    { "role": "user", "content": "And then?" },
                ],
            }),
        )));
        holder.join().expect("holder thread");
        (third, next_turn)
    });
    println!(
        "system prompt on rank {home}; with one stream held there a third conversation went to \
         {third}, the first conversation's next turn to {next_turn}"
    );
    assert_ne!(third, home, "a busy rank kept a shared prefix");
    assert_eq!(next_turn, home, "a conversation left its rank");
    let counters = stack.settled();
    counters.assert_eq("prefix_spread", 1);
    counters.assert_zero(&["prefix_skipped_full"]);
}

/// Conversations of short turns keep one rank on every turn with the defaults, while none of
/// their own part reaches the next indexed position: each is anchored by its opening (system
/// prompt and first user message, resent unchanged), not by wherever this turn's prompt ends.
/// Three shapes: a 4 KB system prompt many share with 0.5 KB questions, a 1 KB one with a
/// 2.5 KB first question (an opening further past the shared part than the next two indexed
/// positions, which the first turn and the next must still agree on), and no system prompt at
/// all, with a 50-byte first question (the first turns are shorter than a block: nothing to
/// look up or record, only the opening names them).
#[test]
fn conversations_of_short_turns_keep_their_rank() {
    const CONVERSATIONS: usize = 16;
    const TURNS: usize = 6;
    for (system_bytes, first_repeat) in [(4000, 5), (1000, 25), (0, 1)] {
        let stack = Stack::start(
            &format!("prefix_short_turns_{system_bytes}"),
            StackOptions::new(support::requests::default_config(json!({}))),
        );
        let mut system = String::from("You are the support assistant of a bookshop. ");
        while system.len() < system_bytes {
            system.push_str("Answer briefly, check the order number, never promise dates. ");
        }
        system.truncate(system_bytes);
        let opening = match system_bytes {
            0 => vec![],
            _ => vec![json!({ "role": "system", "content": system })],
        };
        let mut histories: Vec<Vec<Value>> = vec![opening; CONVERSATIONS];
        let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); CONVERSATIONS];
        // Turn by turn across the conversations, as concurrent users would interleave them.
        for turn in 0..TURNS {
            for (c, history) in histories.iter_mut().enumerate() {
                let question =
                    format!("Customer {c}, question {turn}: where is order {c}-{turn}? ");
                let repeat = if turn == 0 { first_repeat } else { 5 };
                history.push(json!({ "role": "user", "content": question.repeat(repeat) }));
                let request = Request::post("/v1/chat/completions")
                    .json(&json!({ "model": "mock", "messages": history }));
                ranks[c].push(served_rank(&stack.send(&request)));
                let answer = format!("Order {c}-{turn} ships soon. ").repeat(6);
                history.push(json!({ "role": "assistant", "content": answer }));
            }
        }
        let (homes, moved) = homes_and_moves(&ranks);
        println!(
            "{system_bytes} B system prompt, {CONVERSATIONS} conversations x {TURNS} short turns: \
             first turns per rank {homes:?}, {} moved: {moved:?}",
            moved.len()
        );
        // Without a system prompt the first two turns are under a block: nothing is recorded,
        // so each asks its home pair again. Before the opening anchored them they went to the
        // least loaded rank and every conversation moved (16 of 16); with the anchor but the
        // home's margin taken at their own size of a block or two, 1 of 16 did.
        assert_kept_and_spread(&format!("{system_bytes} B system prompt"), &homes, &moved);
    }
}

/// Chats about pictures: 16 conversations ask the same question about their own inline image
/// (3 KiB of base64 each), then go on about it, resending the picture each turn, with the
/// shipped defaults. Each conversation keeps its rank, and they spread: their prompts differ by
/// their pictures (the filter before it read media parts sent all 16 to one home pair).
#[test]
fn one_question_about_many_pictures_spreads_and_each_conversation_keeps_its_rank() {
    const CONVERSATIONS: usize = 16;
    let stack = Stack::start(
        "prefix_pictures",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let picture = |c: usize| {
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ c as u64;
        let base64: String = (0..3072)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                alphabet[(x % 64) as usize] as char
            })
            .collect();
        format!("data:image/png;base64,{base64}")
    };
    let mut histories: Vec<Vec<Value>> = (0..CONVERSATIONS)
        .map(|c| {
            vec![json!({ "role": "user", "content": [
                { "type": "text", "text": "Describe this picture in detail." },
                { "type": "image_url", "image_url": { "url": picture(c) } },
            ]})]
        })
        .collect();
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); CONVERSATIONS];
    for turn in 0..3 {
        for (c, history) in histories.iter_mut().enumerate() {
            let request = Request::post("/v1/chat/completions")
                .json(&json!({ "model": "mock", "messages": history }));
            ranks[c].push(served_rank(&stack.send(&request)));
            let answer = format!("Picture {c} shows a harbour at dusk, turn {turn}. ").repeat(8);
            history.push(json!({ "role": "assistant", "content": answer }));
            history.push(
                json!({ "role": "user", "content": format!("And what about the boats, {turn}?") }),
            );
        }
    }
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{CONVERSATIONS} chats about their own picture: first turns per rank {homes:?}, {} moved: \
         {moved:?}",
        moved.len()
    );
    assert_kept_and_spread("chats about pictures", &homes, &moved);
}

/// One task run by 16 agents that differ only by their tools (an evaluation harness comparing
/// tool sets): the same messages, each agent its own `tools`, three turns each, with the shipped
/// defaults. The engines render the tools into the prompt near its start, so the agents share
/// no cached prefix: they spread by their homes and each keeps its rank (the filter before it
/// read `tools` sent all 16 to the rank of the first one's identical-looking prompt).
#[test]
fn one_task_run_by_agents_with_different_tools_spreads_and_each_keeps_its_rank() {
    const AGENTS: usize = 16;
    let stack = Stack::start(
        "prefix_tools",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let tools = |a: usize| {
        json!({ "tools": [{ "type": "function", "function": {
            "name": format!("tool_{a}"),
            "description": format!("Tool number {a}: searches the repository its own way."),
            "parameters": { "type": "object", "properties": { "query": { "type": "string" } } }
        }}] })
    };
    let task = "Find why the nightly build fails and propose a fix. ".repeat(40);
    let ranks = three_turns_each(
        &stack,
        AGENTS,
        "You are a careful coding agent.",
        &task,
        tools,
    );
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{AGENTS} agents with their own tools on one task: first turns per rank {homes:?}, {} \
         moved: {moved:?}",
        moved.len()
    );
    assert_kept_and_spread("agents with their own tools", &homes, &moved);
}

/// Sixteen tenants of one application send the same first conversation, each with its own
/// `cache_salt` (vLLM's and SGLang's per-tenant cache: one tenant never hits another's KV), three
/// turns each, with the shipped defaults. No tenant can use another's cached prefix, so they
/// spread by their homes and each keeps its rank (a filter that did not read the salt sent all
/// 16 to the rank of the first tenant's identical-looking prompt).
#[test]
fn tenants_with_their_own_cache_salt_spread_and_each_keeps_its_rank() {
    const TENANTS: usize = 16;
    let stack = Stack::start(
        "prefix_cache_salt",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let question = "Summarise the attached quarterly report for the board. ".repeat(40);
    let ranks = three_turns_each(
        &stack,
        TENANTS,
        "You are the assistant of a reporting tool.",
        &question,
        |t| json!({ "cache_salt": format!("tenant-{t}") }),
    );
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{TENANTS} tenants with their own cache_salt: first turns per rank {homes:?}, {} moved: \
         {moved:?}",
        moved.len()
    );
    assert_kept_and_spread("tenants with their own cache_salt", &homes, &moved);
}

/// Agent loops on the OpenAI Responses API (`/v1/responses`, as the OpenAI Agents SDK sends them
/// by default), with the shipped defaults: shared `instructions`, then each session's task, and
/// per turn the items the server returned (a function call, as the SDK sends it back with its
/// id and status) and the tool's output. Each session keeps its rank and the sessions spread, as
/// chat conversations do. A request continuing server-side state (`previous_response_id`)
/// carries only its newest items: it is placed without a prefix lookup.
#[test]
fn responses_api_agent_loops_keep_their_rank_and_spread() {
    const SESSIONS: usize = 16;
    const TURNS: usize = 4;
    let stack = Stack::start(
        "prefix_responses_api",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let instructions = "You are a coding agent. Use the tools, then answer briefly. ".repeat(64);
    let mut inputs: Vec<Vec<Value>> = (0..SESSIONS)
        .map(|s| {
            let task = format!("Task {s}: make test {s} pass. ").repeat(48);
            vec![json!({ "role": "user", "content": [{ "type": "input_text", "text": task }] })]
        })
        .collect();
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); SESSIONS];
    for turn in 0..TURNS {
        for (s, input) in inputs.iter_mut().enumerate() {
            let request = Request::post("/v1/responses").json(&json!({
                "model": "mock", "input": input, "instructions": instructions,
                "max_output_tokens": 8,
            }));
            let response = stack.send(&request);
            ranks[s].push(served_rank(&response));
            let call = format!("call_{s}_{turn}");
            input.push(json!({
                "type": "function_call", "id": format!("fc_{s}_{turn}"), "call_id": call,
                "name": "run_tests", "arguments": format!("{{\"test\":{s},\"round\":{turn}}}"),
                "status": "completed",
            }));
            let output = format!("test {s} round {turn}: 3 failures in module {s}. ").repeat(12);
            input
                .push(json!({ "type": "function_call_output", "call_id": call, "output": output }));
        }
    }
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{SESSIONS} Responses API agent loops x {TURNS} turns: first turns per rank {homes:?}, {} moved: {moved:?}",
        moved.len()
    );
    assert_kept_and_spread("Responses API agent loops", &homes, &moved);
    let before = stack.settled();
    let looked_up = |c: &support::counters::Counters| {
        [
            "prefix_hit",
            "prefix_miss",
            "prefix_skipped_full",
            "prefix_spread",
            "prefix_reads",
        ]
        .iter()
        .map(|name| c.get(name))
        .sum::<u64>()
    };
    assert!(looked_up(&before) >= (SESSIONS * TURNS) as u64);
    for s in 0..4 {
        let request = Request::post("/v1/responses").json(&json!({
            "model": "mock", "previous_response_id": format!("resp_{s}"),
            "input": [{ "type": "function_call_output", "call_id": "c", "output": "ok ".repeat(400) }],
            "instructions": instructions,
        }));
        assert_eq!(stack.send(&request).status, 200);
    }
    let after = stack.settled();
    assert_eq!(
        looked_up(&after),
        looked_up(&before),
        "a stateful request was looked up"
    );
    assert!(after.get("no_key") >= before.get("no_key") + 4);
}

/// Coding-agent loops on the Anthropic Messages API (`/v1/messages`, which SGLang and vLLM serve,
/// as Claude Code sends them): a system prompt of blocks whose first one, a billing header,
/// changes on every request, then per turn the assistant's tool call and the tool's result. With
/// the shipped defaults each session keeps its rank and the sessions spread.
#[test]
fn messages_api_agent_loops_keep_their_rank_and_spread() {
    const SESSIONS: usize = 16;
    const TURNS: usize = 4;
    let stack = Stack::start(
        "prefix_messages_api",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let instructions = "You are a coding agent. Read files, run tools, answer briefly. ".repeat(64);
    let mut histories: Vec<Vec<Value>> = (0..SESSIONS)
        .map(|s| {
            let task = format!("Session {s}: make test {s} pass. ").repeat(48);
            vec![json!({ "role": "user", "content": [{ "type": "text", "text": task }] })]
        })
        .collect();
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); SESSIONS];
    let mut sent = 0;
    for turn in 0..TURNS {
        for (s, history) in histories.iter_mut().enumerate() {
            sent += 1;
            let system = json!([
                { "type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.0; request={sent};") },
                { "type": "text", "text": instructions, "cache_control": { "type": "ephemeral" } },
            ]);
            let request = Request::post("/v1/messages").json(&json!({
                "model": "mock", "max_tokens": 8, "system": system, "messages": history,
            }));
            ranks[s].push(served_rank(&stack.send(&request)));
            let id = format!("toolu_{s}_{turn}");
            history.push(json!({ "role": "assistant", "content": [
                { "type": "text", "text": "Running the tests." },
                { "type": "tool_use", "id": id, "name": "bash", "input": { "command": format!("make test T={s}") } },
            ]}));
            let output = format!("test {s} round {turn}: 3 failures in module {s}. ").repeat(12);
            history.push(json!({ "role": "user", "content": [
                { "type": "tool_result", "tool_use_id": id, "content": output },
            ]}));
        }
    }
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{SESSIONS} Messages API agent loops x {TURNS} turns: first turns per rank {homes:?}, {} moved: {moved:?}",
        moved.len()
    );
    assert_kept_and_spread("Messages API agent loops", &homes, &moved);
}

/// Sends `CONVERSATIONS` conversations of `TURNS` turns, a turn of each in turn (the first
/// conversation `lead` turns ahead of the others), keyed by `key_of(conversation)` in OpenAI's
/// `user`: each opens with `system` when given, and its first question is `first_bytes` long
/// (about; later ones ~450 B). Returns the rank of every turn.
fn keyed_conversations(
    stack: &Stack,
    who: &str,
    system: Option<&str>,
    (first_bytes, lead): (usize, usize),
    key_of: &dyn Fn(usize) -> String,
) -> Vec<Vec<u32>> {
    const TURNS: usize = 3;
    let opening: Vec<Value> = system
        .map(|s| json!({ "role": "system", "content": s }))
        .into_iter()
        .collect();
    let mut histories = vec![opening; CONVERSATIONS_UNDER_ONE_KEY];
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); CONVERSATIONS_UNDER_ONE_KEY];
    for step in 0..TURNS + lead {
        for (c, history) in histories.iter_mut().enumerate() {
            let Some(turn) = step.checked_sub(if c == 0 { 0 } else { lead }) else {
                continue;
            };
            if turn >= TURNS {
                continue;
            }
            let question = format!("{who} {c}, question {turn}: trains to {c}? ");
            let repeat = if turn == 0 {
                first_bytes.div_ceil(question.len())
            } else {
                10
            };
            history.push(json!({ "role": "user", "content": question.repeat(repeat) }));
            let request = Request::post("/v1/chat/completions").json(&json!({
                "model": "mock", "user": key_of(c), "messages": history,
            }));
            ranks[c].push(served_rank(&stack.send(&request)));
            let answer = format!("Train {c}-{turn} leaves at nine. ").repeat(8);
            history.push(json!({ "role": "assistant", "content": answer }));
        }
    }
    ranks
}

const CONVERSATIONS_UNDER_ONE_KEY: usize = 16;

/// Many conversations under one key (OpenAI's `user`, an end user's id, sent in the body): the
/// key's pin would pull every new conversation onto one rank, and move the older ones off their
/// history whenever it moved. The prompt overrules it: each conversation keeps its rank turn
/// after turn, the conversations spread over the ranks, and `key_overruled` counts it. Then
/// conversations with a key of their own each: their pins decide, `key_overruled` stays put.
#[test]
fn conversations_sharing_one_key_keep_their_rank_and_spread() {
    const CONVERSATIONS: usize = CONVERSATIONS_UNDER_ONE_KEY;
    let stack = Stack::start(
        "prefix_shared_key",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let system = "You are the assistant of a travel agency. Be precise and brief. ".repeat(32);
    // 6 KiB of its own in the first turn: more than `prefix.home_blocks` blocks.
    let ranks = keyed_conversations(&stack, "Traveller", Some(&system), (6 * 1024, 0), &|_| {
        "one-user-for-everything".to_string()
    });
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{CONVERSATIONS} conversations under one key: first turns per rank {homes:?}, {} moved",
        moved.len()
    );
    assert_kept_and_spread("conversations under one key", &homes, &moved);
    let shared = stack.settled();
    // The first conversation pins the key; the second is taken for its continuation (the system
    // prompt is not known to be shared yet); the third teaches the pin its tag; most later ones
    // are overruled, and so are the next turns of those not on the pin's rank.
    let overruled = shared.get("key_overruled");
    assert!(
        overruled >= (CONVERSATIONS - 2) as u64,
        "key_overruled {overruled}, expected at least {}",
        CONVERSATIONS - 2
    );

    let ranks = keyed_conversations(&stack, "Passenger", Some(&system), (6 * 1024, 0), &|c| {
        format!("conversation-{c}")
    });
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{CONVERSATIONS} conversations, a key each: first turns per rank {homes:?}, {} moved",
        moved.len()
    );
    assert_kept_and_spread("conversations with a key each", &homes, &moved);
    let own = stack.settled();
    own.assert_eq("key_overruled", overruled);
    own.assert_eq(
        "affinity_hit",
        shared.get("affinity_hit") + (CONVERSATIONS * 2) as u64,
    );
}

/// The same without a system prompt (ShareGPT-like chats, which share no prefix at all): no
/// prefix is known to be shared, so each conversation is named by its opening; first questions
/// of 6 KiB (indexed at once), of 100 bytes (nothing indexed until the second turn, so the
/// second turn is told from another conversation by its name alone) and of 700 bytes (one
/// block, named by its last block, which lies inside the opening every later turn resends). A
/// pin stores such a name only from a turn that goes on past its opening (a first turn cannot
/// tell a chat from a conversation folded into one growing message), so the first
/// conversation is a turn ahead of the others, as in any stream of conversations that do not
/// all start at once. On the build before names were taken past nothing, every conversation
/// followed the key's pin; before a last block inside the opening counted as kept, the
/// 700-byte ones did.
#[test]
fn conversations_sharing_one_key_without_a_system_prompt_keep_their_rank_and_spread() {
    const CONVERSATIONS: usize = CONVERSATIONS_UNDER_ONE_KEY;
    let stack = Stack::start(
        "prefix_shared_key_no_system",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    for (who, first_bytes) in [("Traveller", 6 * 1024), ("Commuter", 100), ("Rider", 700)] {
        let before = stack.settled().get("key_overruled");
        let key = format!("{who}-the-only-user");
        let ranks = keyed_conversations(&stack, who, None, (first_bytes, 1), &|_| key.clone());
        let (homes, moved) = homes_and_moves(&ranks);
        println!(
            "{CONVERSATIONS} conversations under one key, no system prompt, first question \
             {first_bytes} B: first turns per rank {homes:?}, {} moved",
            moved.len()
        );
        assert_kept_and_spread(&format!("{who}s under one key"), &homes, &moved);
        // All but the first (and the one in 15 whose name happens to equal its name) are
        // overruled where their rank is not the pin's.
        let overruled = stack.settled().get("key_overruled") - before;
        assert!(
            overruled >= (CONVERSATIONS - 2) as u64,
            "{who}: key_overruled {overruled}, expected at least {}",
            CONVERSATIONS - 2
        );
    }
}

/// Keyed conversations whose first turn has nothing of its own to index (a question shorter
/// than a block, with and without a shared system prompt), their turns alternating between two
/// Envoy replicas: the key decides, every turn on the rank of the first. Neither replica's index
/// knows the conversation when its next turn arrives (the first recorded nothing of its own,
/// the second went through the other replica), and the pin was written before the conversation
/// had a name of its own: the prompt must not take that for another conversation's pin (a rule
/// that did moved 30 of 40 such conversations back and forth for good).
#[test]
fn keyed_conversations_with_a_short_first_turn_keep_their_rank_through_two_replicas() {
    const CONVERSATIONS: usize = 12;
    const TURNS: usize = 6;
    for system_bytes in [0, 2048] {
        let mut stack = Stack::start(
            &format!("prefix_keyed_short_first_turn_{system_bytes}"),
            StackOptions::new(support::requests::default_config(json!({}))),
        );
        let b = stack.replica();
        let system = "You answer questions about trains, briefly and exactly. ".repeat(40);
        let opening = match system_bytes {
            0 => vec![],
            n => vec![json!({ "role": "system", "content": system[..n] })],
        };
        let mut histories: Vec<Vec<Value>> = vec![opening; CONVERSATIONS];
        let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); CONVERSATIONS];
        for turn in 0..TURNS {
            for (c, history) in histories.iter_mut().enumerate() {
                let question = format!("Rider {c}, question {turn}: the train to {c}? ");
                let repeat = if turn == 0 { 1 } else { 40 };
                history.push(json!({ "role": "user", "content": question.repeat(repeat) }));
                let request = Request::post("/v1/chat/completions")
                    .header(KEY_HEADER, &format!("rider-{c}"))
                    .json(&json!({ "model": "mock", "messages": history }));
                let via = if (turn + c) % 2 == 0 {
                    &stack.envoy
                } else {
                    &b
                };
                ranks[c].push(served_rank(&via.send(&request)));
                let answer = format!("Train {c}-{turn} leaves from platform {c}. ").repeat(20);
                history.push(json!({ "role": "assistant", "content": answer }));
            }
        }
        let (homes, moved) = homes_and_moves(&ranks);
        println!(
            "{CONVERSATIONS} keyed conversations, {system_bytes} B system prompt, a short first \
             turn, over two replicas: first turns per rank {homes:?}, {} moved: {moved:?}",
            moved.len()
        );
        assert_kept_and_spread(&format!("{system_bytes} B system prompt"), &homes, &moved);
        // Not even overruled onto the rank it was on: each request's key decided.
        for counters in support::counters::settled(&[&stack.envoy, &b]) {
            counters.assert_zero(&["key_overruled"]);
        }
    }
}

/// Keyed conversations of a block-id trace's shape (the prompt is whole 512-byte blocks, one
/// per block id) behind a shared 4-block preamble, each turn replacing the previous turn's last
/// block and adding one or two: the index sees the conversation's own ends marked continued,
/// then branched, and the anchor past them changes from turn to turn. Such a name is not the
/// conversation's: the key decides every turn, never overruled (a rule that tagged pins with it
/// overruled and moved most of them).
#[test]
fn keyed_block_id_conversations_that_replace_their_last_block_keep_their_rank() {
    const CONVERSATIONS: usize = 12;
    const TURNS: usize = 12;
    let stack = Stack::start(
        "prefix_keyed_block_ids",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let block = |id: usize| {
        let mut b = format!("<block {id:08}> ").repeat(32);
        b.truncate(512);
        b
    };
    let mut next_id = 1000;
    let mut ids: Vec<Vec<usize>> = (0..CONVERSATIONS)
        .map(|_| {
            let own: Vec<usize> = (0..3).map(|k| next_id + k).collect();
            next_id += 3;
            (0..4).chain(own).collect()
        })
        .collect();
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); CONVERSATIONS];
    for turn in 0..TURNS {
        for (c, conversation) in ids.iter_mut().enumerate() {
            if turn > 0 {
                conversation.pop();
                for _ in 0..1 + (turn + c) % 2 {
                    conversation.push(next_id);
                    next_id += 1;
                }
            }
            let prompt: String = conversation.iter().map(|&id| block(id)).collect();
            let request = completion(&prompt).header(KEY_HEADER, &format!("trace-{c}"));
            ranks[c].push(served_rank(&stack.send(&request)));
        }
    }
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{CONVERSATIONS} keyed block-id conversations replacing their last block: first turns \
         per rank {homes:?}, {} moved: {moved:?}",
        moved.len()
    );
    assert_kept_and_spread("keyed block-id conversations", &homes, &moved);
    stack.settled().assert_zero(&["key_overruled"]);
}

/// Conversations sent as one user message that grows turn by turn (how clients that fold a
/// history into one message send it, and trace replayers with a chat backend), their turns
/// alternating between two Envoy replicas, each with its own index: every turn is served where
/// the first was. The replica that has not seen a conversation names it by the chain at the
/// first indexed position past what it knows to be shared, a prefix of every turn, and the one
/// that has, where the conversation was first named (remembered in its index). Before, a chat
/// was named by its whole (short) opening, a new one on every turn, so it got a new home
/// whenever it crossed replicas, and on the replica that had seen it a history of a few blocks
/// followed its name, taken past a match that deepened every turn (11 and 9 of 12 moved).
#[test]
fn conversations_sent_as_one_growing_message_keep_their_rank_through_two_replicas() {
    const CONVERSATIONS: usize = 12;
    const TURNS: usize = 5;
    for form in ["chat", "completions"] {
        let mut stack = Stack::start(
            &format!("prefix_one_message_two_replicas_{form}"),
            StackOptions::new(support::requests::default_config(json!({}))),
        );
        let b = stack.replica();
        let preamble = "Transcript of a support conversation. Reply as the assistant. ".repeat(5);
        let mut texts: Vec<String> = vec![preamble; CONVERSATIONS];
        let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); CONVERSATIONS];
        for turn in 0..TURNS {
            for (c, text) in texts.iter_mut().enumerate() {
                let question =
                    format!("User {c}, turn {turn}: what happened to parcel {c}-{turn}? ");
                text.push_str(&question.repeat(12));
                let request = match form {
                    "chat" => Request::post("/v1/chat/completions").json(&json!({
                        "model": "mock",
                        "messages": [{ "role": "user", "content": text }],
                    })),
                    _ => completion(text),
                };
                let via = if (turn + c) % 2 == 0 {
                    &stack.envoy
                } else {
                    &b
                };
                ranks[c].push(served_rank(&via.send(&request)));
                text.push_str(&format!("Assistant: parcel {c}-{turn} is on its way. ").repeat(4));
            }
        }
        let (homes, moved) = homes_and_moves(&ranks);
        println!(
            "{CONVERSATIONS} {form} conversations of one growing message x {TURNS} turns over \
             two replicas: first turns per rank {homes:?}, {} moved: {moved:?}",
            moved.len()
        );
        assert_kept_and_spread(form, &homes, &moved);
    }
}

/// Conversations as a block-id trace replayer sends them (Mooncake's, Qwen's traces rendered as
/// text, here 384 bytes a block): each next turn repeats the previous prompt but its last block,
/// which the trace gives a new id once the conversation goes on, and adds two, so a prompt grows
/// by under one 512-byte index block a turn. A turn then matches where the previous turn went on
/// from; read as a prefix that turn branched from, the conversation was named anew and moved
/// every other turn (and a turn crossing a grid position lost its name too).
#[test]
fn trace_conversations_growing_less_than_a_block_a_turn_keep_their_rank() {
    const CONVERSATIONS: usize = 12;
    const TURNS: usize = 8;
    let stack = Stack::start(
        "prefix_trace_growth",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let block = |id: usize| format!("[block {id:06}] ").repeat(24);
    let mut next_id = 1;
    let mut fresh = || {
        next_id += 1;
        next_id
    };
    // Block 0 (the trace's system prompt) opens every conversation; then 3 blocks of its own.
    let mut ids: Vec<Vec<usize>> = (0..CONVERSATIONS)
        .map(|_| vec![0, fresh(), fresh(), fresh()])
        .collect();
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); CONVERSATIONS];
    for _ in 0..TURNS {
        for (c, conversation) in ids.iter_mut().enumerate() {
            let prompt: String = conversation.iter().map(|&id| block(id)).collect();
            ranks[c].push(served_rank(&stack.send(&completion(&prompt))));
            conversation.pop();
            conversation.extend([fresh(), fresh()]);
        }
    }
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{CONVERSATIONS} trace conversations x {TURNS} turns: first turns per rank {homes:?}, {} \
         moved: {moved:?}",
        moved.len()
    );
    assert_kept_and_spread("trace conversations", &homes, &moved);
}

/// Agent loops behind one long shared prompt (96 KiB of instructions and tool definitions, sent
/// as a completions prompt as a trace replayer does), each turn adding a 1 KiB tool result. The
/// first session's rank is kept busy while the others start, so they start elsewhere (at low
/// load a 96 KiB prefix held on one rank would keep them all there); then every session keeps
/// its rank from turn to turn. With only the first 64 KiB hashed, every prompt looked like the
/// first one's history and later turns followed it back to its rank (11 of 12 moved); with the
/// whole prefix hashed but only the sparse grid indexed, nothing of a session past the shared
/// 96 KiB was indexed before it reached the next grid position (128 KiB).
#[test]
fn agent_sessions_behind_a_long_shared_prompt_keep_their_rank() {
    const SESSIONS: usize = 12;
    const TURNS: usize = 5;
    const HELD: usize = 3;
    let stack = Stack::start(
        "prefix_agent_sessions",
        StackOptions::new(support::requests::default_config(json!({
            "assign": { "min_capacity": 1 },
        })))
        .mock_args(&["--stream-interval-ms", "250"]),
    );
    let mut prompts = agent_sessions(SESSIONS);
    let send = |prompt: &str| served_rank(&stack.send(&completion(prompt)));
    let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); SESSIONS];
    ranks[0].push(send(&prompts[0]));
    settle();
    // Streams held on the first session's rank fill it (capacity with 3 in flight on 4 ranks,
    // floor 1: 2 for a new conversation's home, 2 for a match), so the others start elsewhere.
    let addr = stack.addr();
    let first = ranks[0][0];
    std::thread::scope(|scope| {
        let holders: Vec<_> = (0..HELD)
            .map(|_| scope.spawn(move || hold_stream(addr, first)))
            .collect();
        std::thread::sleep(Duration::from_millis(600));
        for (s, prompt) in prompts.iter().enumerate().skip(1) {
            ranks[s].push(send(prompt));
        }
        for h in holders {
            h.join().expect("holder thread");
        }
    });
    settle();
    for turn in 0..TURNS {
        for (s, prompt) in prompts.iter_mut().enumerate() {
            let result = format!("tool result {s}-{turn}: line {turn} of file {s}. ").repeat(40);
            prompt.push_str(&result[..1024]);
            ranks[s].push(send(prompt));
        }
    }
    let (homes, moved) = homes_and_moves(&ranks);
    println!(
        "{SESSIONS} agent sessions x {} turns: first turns per rank {homes:?}, {} moved: \
         {moved:?}",
        TURNS + 1,
        moved.len()
    );
    assert!(
        ranks.iter().skip(1).all(|r| r[0] != first),
        "the busy rank was not avoided: {homes:?}"
    );
    assert!(moved.is_empty(), "sessions moved between turns: {moved:?}");
}

/// On a quiet cluster (one request at a time, nothing ever queued), new agent sessions behind a
/// long shared prompt go to their own homes once the prompt's first holder runs hot (clearly more
/// work lately than the home, and at least twice as much): each home computes the shared 96 KiB
/// once and holds it, instead of every session piling onto the rank that saw it first (no queue
/// ever forms there to say it is busy). Each session's next turn then stays where its first went.
#[test]
fn a_long_shared_prompt_spreads_to_the_sessions_homes_on_a_quiet_cluster() {
    const SESSIONS: usize = 16;
    let stack = Stack::start(
        "prefix_long_shared_prompt_spreads",
        StackOptions::new(support::requests::default_config(json!({}))),
    );
    let mut prompts = agent_sessions(SESSIONS);
    let send = |prompt: &str| served_rank(&stack.send(&completion(prompt)));
    let firsts: Vec<u32> = prompts.iter().map(|p| send(p)).collect();
    let nexts: Vec<u32> = prompts
        .iter_mut()
        .enumerate()
        .map(|(s, prompt)| {
            prompt.push_str(&format!("step result {s}: done. ").repeat(64));
            send(prompt)
        })
        .collect();
    let homes = per_rank(firsts.iter().copied());
    println!("{SESSIONS} sessions behind a 96 KiB shared prompt, one at a time: first turns per rank {homes:?}; next turns {nexts:?}");
    assert!(
        homes.iter().all(|&n| n <= SESSIONS / 2) && homes.iter().filter(|&&n| n > 0).count() >= 3,
        "new sessions piled onto the shared prompt's holder: {homes:?}"
    );
    assert_eq!(
        nexts, firsts,
        "sessions moved between their first and second turn"
    );
}

// ---------------------------------------------------------------- (d)

/// A keyed request records its prefix: keyless requests with the same system prompt follow it.
/// And the other way round: a new key whose prompt is indexed is placed (and pinned) by it.
#[test]
fn keyed_request_records_its_prefix() {
    const KEYS: usize = 6;
    let stack = Stack::start(
        "prefix_keyed_request_records",
        StackOptions::new(prefix_config(json!({}))),
    );
    let mut placed = Vec::new();
    for i in 0..KEYS {
        let system = system_prompt(&format!("keyed-{i}"));
        let keyed = chat_with(&system, "Turn one").header(KEY_HEADER, &format!("conv-{i}"));
        let rank = served_rank(&stack.send(&keyed));
        let keyless = served_rank(&stack.send(&chat_with(&system, "Someone else asks")));
        assert_eq!(
            keyless, rank,
            "key conv-{i}: keyless follower went elsewhere"
        );
        // The key's next turn is a pin hit, the prompt grew: still the same rank.
        let next = chat_with(&system, "Turn one, and now turn two")
            .header(KEY_HEADER, &format!("conv-{i}"));
        assert_eq!(served_rank(&stack.send(&next)), rank);
        placed.push(rank);
    }
    // Placed by the assigner (their home) and pinned at once: nothing to learn.
    stack.assert_counter("assigned", KEYS as u64);
    stack.assert_counter("affinity_hit", KEYS as u64);
    stack.assert_counter("prefix_hit", KEYS as u64);

    // Reverse: keyless first, then a new key with the same system prompt: placed by the
    // prefix and pinned at once (no learning needed), its next turn a pin hit.
    let mut reverse = Vec::new();
    for i in 0..KEYS {
        let system = system_prompt(&format!("reverse-{i}"));
        let rank = served_rank(&stack.send(&chat_with(&system, "Anonymous question")));
        let key = format!("late-key-{i}");
        let keyed = chat_with(&system, "Keyed question").header(KEY_HEADER, &key);
        assert_eq!(
            served_rank(&stack.send(&keyed)),
            rank,
            "{key}: not placed by its prefix"
        );
        let unrelated =
            chat_with(&format!("Unrelated {i}. ").repeat(50), "x").header(KEY_HEADER, &key);
        assert_eq!(
            served_rank(&stack.send(&unrelated)),
            rank,
            "{key}: pin not written"
        );
        reverse.push(rank);
    }
    println!("keyed first: ranks {placed:?}; keyless first then keyed: ranks {reverse:?}");
    // The late keys were pinned where their prefix placed them, not by the assigner.
    let counters = stack.settled();
    counters.assert_eq("prefix_hit", 2 * KEYS as u64);
    counters.assert_eq("assigned", KEYS as u64);
    counters.assert_zero(&["learned"]);
    counters.assert_eq("affinity_hit", 2 * KEYS as u64);
}

// ---------------------------------------------------------------- (e)

/// Thousands of distinct prompts through a tiny index (4 buckets × 2 ways = 8 entries): every
/// prompt is recorded, all but 8 entries are evicted, the newest prompt is still found and the
/// oldest is gone. (The 100,000-prompt version runs natively: `prefix_index::tests`.)
#[test]
fn index_stays_at_its_bound() {
    const PROMPTS: u64 = 3000;
    const ENTRIES: u64 = 4 * 2;
    let stack = Stack::start(
        "prefix_index_bound",
        StackOptions::new(prefix_config(json!({
            "assign": { "mode": "hash" },
            // home_blocks 0: a one-block match must win over the request's home for the hit
            // below to show that the entry is still indexed.
            "prefix": {
                "block_bytes": 64,
                "max_blocks": 1,
                "home_blocks": 0,
                "table": { "buckets": 4, "ways": 2 },
            },
        }))),
    );
    let prompt = |n: u64| format!("Distinct prompt {n:06}, long enough to fill one whole block.");
    let mut client = Client::new(stack.addr());
    let mut ranks = BTreeSet::new();
    for n in 0..PROMPTS {
        let response = client.send(&chat_with(&prompt(n), ""));
        ranks.insert(served_rank(&response));
    }
    let counters = stack.settled();
    counters.assert_eq("prefix_miss", PROMPTS);
    counters.assert_eq("prefix_recorded", PROMPTS);
    let evictions = counters.get("prefix_evictions");
    println!(
        "{PROMPTS} distinct one-block prompts into {ENTRIES} entries: {evictions} evicted, ranks used {ranks:?}"
    );
    assert!(
        (PROMPTS - ENTRIES..PROMPTS).contains(&evictions),
        "live entries = recorded - evicted = {} (bound {ENTRIES})",
        PROMPTS - evictions
    );
    // The newest prompt is still indexed; the oldest was evicted long ago.
    let last = served_rank(&client.send(&chat_with(&prompt(PROMPTS - 1), "again")));
    stack.assert_counter("prefix_hit", 1);
    let _ = last;
    client.send(&chat_with(&prompt(0), "again"));
    stack.assert_counter("prefix_miss", PROMPTS + 1);
}

// ---------------------------------------------------------------- failure

/// A rank that fails a request its prefix sent there loses the prompt's entries: the next request
/// sharing the prefix is placed afresh (and recorded where it then goes).
#[test]
fn failed_prefix_rank_is_forgotten() {
    let mut stack = Stack::start(
        "prefix_failed_rank_forgotten",
        StackOptions::new(prefix_config(json!({ "assign": { "mode": "hash" } }))),
    );
    let system = system_prompt("failing");
    let home = served_rank(&stack.send(&chat_with(&system, "Before the failure")));
    stack.mock(home).kill();
    let failed = stack.send(&chat_with(&system, "Sent to the dead rank by its prefix"));
    assert!(
        failed.status >= 500,
        "expected a 5xx from the killed rank {home}, got {}",
        failed.status
    );
    stack.assert_counter("prefix_hit", 1);
    stack.assert_counter("prefix_forgotten", 1);
    // Forgotten: a miss, placed on a live rank (the dead one is cooling down), recorded there.
    let moved = served_rank(&stack.send(&chat_with(&system, "After the failure")));
    assert_ne!(moved, home);
    stack.assert_counter("prefix_miss", 2);
    assert_eq!(
        served_rank(&stack.send(&chat_with(&system, "And again"))),
        moved,
        "the prefix was not re-recorded on its new rank"
    );
    stack.assert_counter("prefix_hit", 2);
    println!("prefix on rank {home}; rank killed, one 503, entries forgotten, now on rank {moved}");
}
