//! Token accounting from an answer body: OpenAI `usage` (with
//! `prompt_tokens_details.cached_tokens`) or SGLang `meta_info`, in a plain
//! JSON answer or in an SSE stream, where the usage rides on the last event
//! that carries one. The hit rate is computed from what the server says it
//! reused, so the numbers mean the same with the mock or a real engine.

use serde_json::Value;

/// Prompt and cached token counts reported by a server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// The usage in `body`: a JSON object, or the last SSE `data:` event that
/// carries one. Nothing found (or not JSON) gives `Usage::default()`.
pub fn from_body(body: &[u8]) -> Usage {
    let text = String::from_utf8_lossy(body);
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') {
        return serde_json::from_str::<Value>(trimmed)
            .ok()
            .and_then(|v| from_value(&v))
            .unwrap_or_default();
    }
    let mut last = None;
    for data in sse_data(&text) {
        if data.trim() == "[DONE]" {
            continue;
        }
        if let Some(usage) = serde_json::from_str::<Value>(&data)
            .ok()
            .and_then(|v| from_value(&v))
        {
            last = Some(usage);
        }
    }
    last.unwrap_or_default()
}

/// The data of every SSE event: `data:` lines joined by "\n", events ended
/// by a blank line (or the end of the stream).
pub fn sse_data(text: &str) -> Vec<String> {
    let mut events = Vec::new();
    let mut data: Option<String> = None;
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() {
            events.extend(data.take());
            continue;
        }
        let Some(value) = line.strip_prefix("data:") else {
            // Comments, `event:`, `id:` and `retry:` lines carry no data.
            continue;
        };
        let value = value.strip_prefix(' ').unwrap_or(value);
        match &mut data {
            Some(d) => {
                d.push('\n');
                d.push_str(value);
            }
            None => data = Some(value.to_string()),
        }
    }
    events.extend(data);
    events
}

/// Usage of one JSON answer or event; `None` when it reports none.
pub fn from_value(v: &Value) -> Option<Usage> {
    let (prompt, cached) = if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        (
            u.get("prompt_tokens"),
            u.get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens")),
        )
    } else if let Some(m) = v.get("meta_info").filter(|m| m.is_object()) {
        (m.get("prompt_tokens"), m.get("cached_tokens"))
    } else {
        return None;
    };
    let usage = Usage {
        prompt_tokens: prompt.and_then(Value::as_u64),
        cached_tokens: cached.and_then(Value::as_u64),
    };
    (usage != Usage::default()).then_some(usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(prompt: u64, cached: u64) -> Usage {
        Usage {
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
        }
    }

    #[test]
    fn plain_json_openai_and_sglang() {
        let openai = br#"{"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        assert_eq!(from_body(openai), usage(100, 64));
        let sglang = br#" {"text":"x","meta_info":{"prompt_tokens":30,"cached_tokens":16}}"#;
        assert_eq!(from_body(sglang), usage(30, 16));
        let no_details = br#"{"usage":{"prompt_tokens":7}}"#;
        assert_eq!(
            from_body(no_details),
            Usage {
                prompt_tokens: Some(7),
                cached_tokens: None
            }
        );
        assert_eq!(from_body(b"{\"error\":{}}"), Usage::default());
        assert_eq!(from_body(b"not json"), Usage::default());
        assert_eq!(from_body(b""), Usage::default());
    }

    #[test]
    fn sse_takes_last_event_with_usage() {
        let stream = "data: {\"choices\":[],\"usage\":null}\n\n\
                      : comment\n\
                      event: message\r\n\
                      data: {\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":1}}}\r\n\r\n\
                      data: {\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n\
                      data: {\"choices\":[{\"delta\":{}}]}\n\n\
                      data: [DONE]\n\n";
        assert_eq!(from_body(stream.as_bytes()), usage(9, 8));
        // SGLang streams meta_info on every event; no trailing blank line.
        let sglang = "data: {\"meta_info\":{\"prompt_tokens\":4,\"cached_tokens\":0}}\n\n\
                      data: {\"meta_info\":{\"prompt_tokens\":4,\"cached_tokens\":4}}";
        assert_eq!(from_body(sglang.as_bytes()), usage(4, 4));
        assert_eq!(from_body(b"data: [DONE]\n\n"), Usage::default());
    }

    #[test]
    fn multi_line_events() {
        let text = "data: {\"usage\":\ndata: {\"prompt_tokens\":3}}\n\nid: 1\ndata:x\n";
        assert_eq!(
            sse_data(text),
            vec![
                "{\"usage\":\n{\"prompt_tokens\":3}}".to_string(),
                "x".to_string()
            ]
        );
        assert_eq!(from_body(text.as_bytes()).prompt_tokens, Some(3));
    }
}
