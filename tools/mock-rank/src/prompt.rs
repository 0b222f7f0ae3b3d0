//! The prompt of an LLM request as the simulated engine sees it: a token count
//! and the chained hashes of its full KV blocks, the keys of the prefix cache.
//!
//! The mock has no tokenizer, so it uses a fixed convention that a load
//! generator can reproduce exactly: text is one token per 4 bytes of UTF-8,
//! token ids count one each. Requests are reduced to a canonical prompt:
//!
//! - `/v1/chat/completions`: for each message in order, its `role`, `\n`, its
//!   text content, `\n`. Content is a string, or a list of parts whose `text`
//!   fields are concatenated (other parts, e.g. images, add nothing).
//! - `/v1/completions`: `prompt` as a string, a list of strings (concatenated),
//!   or token ids (a list of integers, or a list of such lists, flattened).
//! - `/generate` (SGLang): `text` (string or list of strings), else `input_ids`.
//! - `/v1/responses`: `instructions` as a `system` message, then `input`: a
//!   string as a `user` message, or each item as a message whose role is its
//!   `role` (else its `type`) and whose text is its content (as in chat), or a
//!   function call's `name` and `arguments`, or a call output's `output`.
//! - `/v1/messages` (Anthropic): `system` (a string, or its blocks' `text`,
//!   less Claude Code's `x-anthropic-billing-header` block) as a `system` message, then `messages` as in chat, where a `tool_use` block
//!   adds its `name` and its `input` as JSON, and a `tool_result` block the
//!   text of its `content`.
//! - anything else, or missing fields: the empty prompt.
//!
//! Blocks are `4 * block_tokens` bytes of text, or `block_tokens` ids. Only
//! full blocks are hashed: like vLLM, a partial last block is never cached.
//! Hashes are chained, `hash_i = H(hash_{i-1}, block_i)`, so equal hashes mean
//! equal prefixes; `hash_{-1}` is the hash of the `model` field, so different
//! models never share blocks. `H(prev, block)` is FNV-1a 64 over the 8
//! little-endian bytes of `prev` then the block's bytes (an id is its 8
//! little-endian bytes).
//!
//! ```
//! use mock_rank::prompt::prompt_blocks;
//! let body = serde_json::json!({"model": "m", "prompt": "0123456789abcdef"});
//! let blocks = prompt_blocks("/v1/completions", &body, 2);
//! assert_eq!(blocks.prompt_tokens, 4);
//! assert_eq!(blocks.hashes.len(), 2); // 16 bytes = two blocks of 2 tokens
//! ```

use serde_json::Value;

use crate::fnv::{fnv1a64, fnv1a64_extend};

/// Bytes of text per token, the mock's stand-in for a tokenizer.
pub const BYTES_PER_TOKEN: usize = 4;

/// Tokens and chained block hashes of a request's prompt as the engine sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    pub prompt_tokens: u64,
    pub hashes: Vec<u64>,
}

/// A request's prompt reduced to what the engine would tokenize.
#[derive(Debug, PartialEq, Eq)]
enum Canonical {
    Text(Vec<u8>),
    Ids(Vec<u64>),
}

/// `path` is the request path (e.g. "/v1/chat/completions", "/v1/completions",
/// "/generate"), `body` the parsed JSON body. `block_tokens` >= 1 (0 is
/// treated as 1).
pub fn prompt_blocks(path: &str, body: &Value, block_tokens: u32) -> PromptBlocks {
    let block_tokens = block_tokens.max(1) as usize;
    let seed = model_seed(body);
    match canonical(path, body) {
        Canonical::Text(text) => PromptBlocks {
            prompt_tokens: text.len().div_ceil(BYTES_PER_TOKEN) as u64,
            hashes: chain(seed, text.chunks_exact(BYTES_PER_TOKEN * block_tokens)),
        },
        Canonical::Ids(ids) => PromptBlocks {
            prompt_tokens: ids.len() as u64,
            hashes: chain_ids(seed, ids.chunks_exact(block_tokens)),
        },
    }
}

/// `hash_{-1}`: requests for different models never share cached blocks.
fn model_seed(body: &Value) -> u64 {
    let model = body.get("model").and_then(Value::as_str).unwrap_or("");
    fnv1a64(model.as_bytes())
}

/// Hashes of text blocks, each chained to the one before it.
fn chain<'a>(seed: u64, blocks: impl Iterator<Item = &'a [u8]>) -> Vec<u64> {
    let mut prev = seed;
    blocks
        .map(|block| {
            prev = fnv1a64_extend(block_start(prev), block);
            prev
        })
        .collect()
}

/// Hashes of id blocks, each chained to the one before it.
fn chain_ids<'a>(seed: u64, blocks: impl Iterator<Item = &'a [u64]>) -> Vec<u64> {
    let mut prev = seed;
    blocks
        .map(|block| {
            prev = block.iter().fold(block_start(prev), |hash, id| {
                fnv1a64_extend(hash, &id.to_le_bytes())
            });
            prev
        })
        .collect()
}

/// `H(prev, ·)` before the block bytes: FNV-1a 64 over `prev`, little-endian.
fn block_start(prev: u64) -> u64 {
    fnv1a64(&prev.to_le_bytes())
}

fn canonical(path: &str, body: &Value) -> Canonical {
    // Query strings do not change what an endpoint reads from the body.
    let path = path.split('?').next().unwrap_or(path);
    match path {
        "/v1/chat/completions" => Canonical::Text(chat_text(body)),
        "/v1/responses" => Canonical::Text(responses_text(body)),
        "/v1/messages" => Canonical::Text(messages_text(body)),
        "/v1/completions" => body.get("prompt").map_or(empty(), text_or_ids),
        "/generate" => match (body.get("text"), body.get("input_ids")) {
            (Some(text), _) => text_or_ids(text),
            (None, Some(ids)) => Canonical::Ids(flat_ids(ids)),
            (None, None) => empty(),
        },
        _ => empty(),
    }
}

fn empty() -> Canonical {
    Canonical::Text(Vec::new())
}

/// Role and content of every message, each followed by a newline.
fn chat_text(body: &Value) -> Vec<u8> {
    let mut text = Vec::new();
    let messages = body.get("messages").and_then(Value::as_array);
    for message in messages.into_iter().flatten() {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        push_message(&mut text, role, &[message.get("content")]);
    }
    text
}

/// The Responses API's prompt: instructions, then the input items.
fn responses_text(body: &Value) -> Vec<u8> {
    let mut text = Vec::new();
    if let Some(instructions) = body.get("instructions").filter(|v| v.is_string()) {
        push_message(&mut text, "system", &[Some(instructions)]);
    }
    match body.get("input") {
        Some(input @ Value::String(_)) => push_message(&mut text, "user", &[Some(input)]),
        Some(Value::Array(items)) => {
            for item in items {
                let label = item.get("role").or_else(|| item.get("type"));
                let label = label.and_then(Value::as_str).unwrap_or("");
                let parts = ["name", "arguments", "content", "output"].map(|f| item.get(f));
                push_message(&mut text, label, &parts);
            }
        }
        _ => {}
    }
    text
}

/// The Messages API's prompt: the system text, then the messages, tool
/// calls and results read as their text.
fn messages_text(body: &Value) -> Vec<u8> {
    let mut text = Vec::new();
    if let Some(system) = body.get("system") {
        // Claude Code's per-request billing block, which vLLM drops from the prompt.
        let billing = |b: &Value| {
            let text = b.get("text").and_then(Value::as_str).unwrap_or("");
            text.starts_with("x-anthropic-billing-header")
        };
        let system = match system {
            Value::Array(blocks) => {
                Value::Array(blocks.iter().filter(|b| !billing(b)).cloned().collect())
            }
            other => other.clone(),
        };
        push_message(&mut text, "system", &[Some(&system)]);
    }
    let messages = body.get("messages").and_then(Value::as_array);
    for message in messages.into_iter().flatten() {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        let content = match message.get("content") {
            Some(Value::Array(blocks)) => Value::Array(blocks.iter().map(block_text).collect()),
            other => other.cloned().unwrap_or(Value::Null),
        };
        push_message(&mut text, role, &[Some(&content)]);
    }
    text
}

/// A content block as a text part: tool calls and results by their text.
fn block_text(block: &Value) -> Value {
    let text = match block.get("type").and_then(Value::as_str) {
        Some("tool_use") => {
            let name = block.get("name").and_then(Value::as_str).unwrap_or("");
            let input = block.get("input").map(Value::to_string).unwrap_or_default();
            format!("{name}{input}")
        }
        Some("tool_result") => {
            let mut out = Vec::new();
            push_message(&mut out, "", &[block.get("content")]);
            String::from_utf8_lossy(&out).into_owned()
        }
        _ => return block.clone(),
    };
    serde_json::json!({ "type": "text", "text": text })
}

/// `role`, a newline, the text of each of `contents` (a string, or a list of
/// parts whose `text` fields are concatenated), a newline.
fn push_message(text: &mut Vec<u8>, role: &str, contents: &[Option<&Value>]) {
    text.extend_from_slice(role.as_bytes());
    text.push(b'\n');
    for content in contents.iter().flatten() {
        match content {
            Value::String(content) => text.extend_from_slice(content.as_bytes()),
            Value::Array(parts) => {
                for part in parts.iter().filter_map(|p| p.get("text")?.as_str()) {
                    text.extend_from_slice(part.as_bytes());
                }
            }
            _ => {}
        }
    }
    text.push(b'\n');
}

/// A string, a list of strings (concatenated), or token ids; a list is read
/// as ids when its first element is a number or a list.
fn text_or_ids(value: &Value) -> Canonical {
    match value {
        Value::String(text) => Canonical::Text(text.as_bytes().to_vec()),
        Value::Array(items)
            if matches!(items.first(), Some(Value::Number(_) | Value::Array(_))) =>
        {
            Canonical::Ids(flat_ids(value))
        }
        Value::Array(items) => Canonical::Text(
            items
                .iter()
                .filter_map(Value::as_str)
                .flat_map(str::bytes)
                .collect(),
        ),
        _ => empty(),
    }
}

/// Token ids of a list of ids or a list of such lists (a batch, flattened).
/// Elements that are not non-negative integers are skipped.
fn flat_ids(value: &Value) -> Vec<u64> {
    let Some(items) = value.as_array() else {
        return Vec::new();
    };
    items
        .iter()
        .flat_map(|item| match item {
            Value::Array(inner) => inner.iter().filter_map(Value::as_u64).collect(),
            other => other.as_u64().into_iter().collect::<Vec<u64>>(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHAT: &str = "/v1/chat/completions";
    const COMPLETIONS: &str = "/v1/completions";
    const GENERATE: &str = "/generate";

    /// The hashes of `text` with model "m": the reference the API must match.
    fn text_hashes(text: &[u8], block_tokens: usize) -> Vec<u64> {
        let mut prev = fnv1a64(b"m");
        text.chunks_exact(4 * block_tokens)
            .map(|block| {
                prev = fnv1a64_extend(fnv1a64(&prev.to_le_bytes()), block);
                prev
            })
            .collect()
    }

    #[test]
    fn chat_canonical_form() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "hello "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "world"},
            ]},
            {"role": "assistant", "content": null},
        ]});
        assert_eq!(
            canonical(CHAT, &body),
            Canonical::Text(b"system\nbe brief\nuser\nhello world\nassistant\n\n".to_vec())
        );
        let blocks = prompt_blocks(CHAT, &body, 2);
        // 44 bytes: 11 tokens, five full blocks of 8 bytes.
        assert_eq!(blocks.prompt_tokens, 11);
        assert_eq!(
            blocks.hashes,
            text_hashes(b"system\nbe brief\nuser\nhello world\nassistant\n\n", 2)
        );
    }

    #[test]
    fn responses_canonical_form() {
        let body = json!({"model": "m", "instructions": "be brief", "input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "id": "msg-1",
             "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
        ]});
        assert_eq!(
            canonical("/v1/responses", &body),
            Canonical::Text(
                b"system\nbe brief\nuser\nweather?\nfunction_call\nget{}\nfunction_call_output\nsunny\nassistant\nSunny.\n"
                    .to_vec()
            )
        );
        let text_input = json!({"input": "hi", "instructions": null});
        assert_eq!(
            canonical("/v1/responses", &text_input),
            Canonical::Text(b"user\nhi\n".to_vec())
        );
    }

    #[test]
    fn messages_canonical_form() {
        let body = json!({"system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; n=7;"},
                {"type": "text", "text": "be brief"},
            ], "messages": [
            {"role": "user", "content": "run it"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "bash", "input": {"cmd": "ls"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "a b"}]},
        ]});
        assert_eq!(
            canonical("/v1/messages", &body),
            Canonical::Text(
                b"system\nbe brief\nuser\nrun it\nassistant\nbash{\"cmd\":\"ls\"}\nuser\n\na b\n\n"
                    .to_vec()
            )
        );
    }

    #[test]
    fn completion_prompt_forms() {
        let text = |prompt: Value| canonical(COMPLETIONS, &json!({"prompt": prompt}));
        assert_eq!(text(json!("abc")), Canonical::Text(b"abc".to_vec()));
        assert_eq!(text(json!(["ab", "cd"])), Canonical::Text(b"abcd".to_vec()));
        assert_eq!(text(json!([1, 2, 3])), Canonical::Ids(vec![1, 2, 3]));
        assert_eq!(text(json!([[1, 2], [3]])), Canonical::Ids(vec![1, 2, 3]));
        assert_eq!(text(json!([])), Canonical::Text(Vec::new()));
        assert_eq!(text(json!(7)), Canonical::Text(Vec::new()));
        assert_eq!(canonical(COMPLETIONS, &json!({})), empty());
    }

    #[test]
    fn generate_text_and_ids() {
        let gen = |body: Value| canonical(GENERATE, &body);
        assert_eq!(gen(json!({"text": "hi"})), Canonical::Text(b"hi".to_vec()));
        assert_eq!(
            gen(json!({"text": ["a", "b"]})),
            Canonical::Text(b"ab".to_vec())
        );
        assert_eq!(
            gen(json!({"input_ids": [5, 6]})),
            Canonical::Ids(vec![5, 6])
        );
        assert_eq!(gen(json!({"input_ids": 5})), Canonical::Ids(Vec::new()));
        assert_eq!(gen(json!({})), empty());
    }

    #[test]
    fn unknown_path_or_body_is_empty() {
        let empty_blocks = PromptBlocks::default();
        let body = json!({"prompt": "some long text for sure"});
        assert_eq!(prompt_blocks("/v1/embeddings", &body, 1), empty_blocks);
        assert_eq!(prompt_blocks(CHAT, &Value::Null, 1), empty_blocks);
        assert_eq!(
            prompt_blocks(CHAT, &json!({"messages": "x"}), 1),
            empty_blocks
        );
        // The query string is not part of the path.
        assert_eq!(
            prompt_blocks("/v1/completions?x=1", &body, 1),
            prompt_blocks(COMPLETIONS, &body, 1)
        );
    }

    #[test]
    fn token_count_rounds_up_and_partial_block_is_not_hashed() {
        let blocks = |prompt: &str| prompt_blocks(COMPLETIONS, &json!({"prompt": prompt}), 2);
        assert_eq!(blocks("").prompt_tokens, 0);
        assert_eq!(blocks("a").prompt_tokens, 1);
        assert_eq!(blocks("abcde").prompt_tokens, 2);
        assert!(
            blocks("1234567").hashes.is_empty(),
            "7 bytes < one block of 8"
        );
        assert_eq!(blocks("12345678").hashes.len(), 1);
        let long = blocks("12345678abcdefghXYZ");
        assert_eq!(long.prompt_tokens, 5);
        assert_eq!(long.hashes.len(), 2, "the 3-byte tail is not a block");
    }

    #[test]
    fn ids_blocks() {
        let blocks = prompt_blocks(GENERATE, &json!({"input_ids": [1, 2, 3, 4, 5]}), 2);
        assert_eq!(blocks.prompt_tokens, 5);
        assert_eq!(blocks.hashes.len(), 2);
        let batched = prompt_blocks(COMPLETIONS, &json!({"prompt": [[1, 2], [3, 4, 5]]}), 2);
        assert_eq!(batched.hashes, blocks.hashes, "model \"\" and the same ids");
        let other = prompt_blocks(GENERATE, &json!({"input_ids": [1, 2, 3, 9]}), 2);
        assert_eq!(other.hashes[0], blocks.hashes[0]);
        assert_ne!(other.hashes[1], blocks.hashes[1]);
    }

    #[test]
    fn hashes_are_chained_prefixes() {
        let body = |prompt: &str| json!({"model": "m", "prompt": prompt});
        let a = prompt_blocks(COMPLETIONS, &body("aaaabbbbccccdddd"), 1);
        let b = prompt_blocks(COMPLETIONS, &body("aaaabbbbXXXXdddd"), 1);
        assert_eq!(a.hashes.len(), 4);
        assert_eq!(a.hashes[..2], b.hashes[..2]);
        // The same last block after a different prefix is a different block.
        assert_ne!(a.hashes[3], b.hashes[3]);
        assert_eq!(a.hashes, text_hashes(b"aaaabbbbccccdddd", 1));
        // Repeated blocks inside one prompt still get distinct hashes.
        let same = prompt_blocks(COMPLETIONS, &body("aaaaaaaa"), 1);
        assert_ne!(same.hashes[0], same.hashes[1]);
    }

    #[test]
    fn model_seeds_the_chain() {
        let blocks = |model: Value| {
            prompt_blocks(
                COMPLETIONS,
                &json!({"model": model, "prompt": "aaaabbbb"}),
                1,
            )
        };
        assert_ne!(blocks(json!("m1")).hashes[0], blocks(json!("m2")).hashes[0]);
        assert_eq!(blocks(json!("m1")), blocks(json!("m1")));
        // A missing or non-string model is the empty model name.
        assert_eq!(blocks(json!(null)), blocks(json!("")));
        assert_eq!(blocks(json!(3)).prompt_tokens, 2);
    }

    #[test]
    fn zero_block_tokens_is_one() {
        let body = json!({"prompt": "aaaabbbb"});
        assert_eq!(
            prompt_blocks(COMPLETIONS, &body, 0),
            prompt_blocks(COMPLETIONS, &body, 1)
        );
    }
}
