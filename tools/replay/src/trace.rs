//! The trace: one request per JSONL line, in either of two dialects — our own
//! (`t_ms`, `key`, `messages` or `text`, `output_tokens`, as `synth` writes)
//! and the public Mooncake KV-cache traces (`timestamp`, `hash_ids`,
//! `input_length`, `output_length`). Both become one `Request`, and
//! `Request::body` turns it into the exact JSON `run` sends and `oracle`
//! hashes, so the two can never disagree about what a prompt is.

use std::io::BufRead;

use serde_json::{json, Map, Value};

use crate::text;

/// `output_tokens` when a line gives none.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 16;

pub const CHAT_PATH: &str = "/v1/chat/completions";
pub const COMPLETIONS_PATH: &str = "/v1/completions";

/// What the prompt of one request is made of.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Chat messages, sent verbatim to /v1/chat/completions. Each is an
    /// object with a string `role`.
    Messages(Vec<Value>),
    /// Plain text, sent as `prompt` to /v1/completions.
    Text(String),
    /// Block ids, expanded to pseudo-text (`text::blocks`) and sent as
    /// `prompt` to /v1/completions; `input_length` (tokens) cuts the text.
    Blocks {
        ids: Vec<u64>,
        input_length: Option<u64>,
    },
}

/// One request of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// 1-based line in the trace file, for messages.
    pub line: usize,
    /// Arrival time, milliseconds (any origin: `run` replays relative to the
    /// first request).
    pub t_ms: f64,
    /// Routing key (session, user, ...), if any.
    pub key: Option<String>,
    /// The conversation this request is a turn of, where the trace names it apart from the
    /// routing key (`session`: a key many conversations share, as `scripts/rekey-trace.py`
    /// writes); `None`: the key names the conversation.
    pub session: Option<String>,
    pub prompt: Prompt,
    pub output_tokens: u64,
}

/// How bodies are built; the same for `run` and `oracle`.
#[derive(Debug, Clone, PartialEq)]
pub struct BodyOptions {
    pub model: String,
    pub block_tokens: u32,
    pub stream: bool,
    /// Put the key in the body as `prompt_cache_key`.
    pub key_in_body: bool,
    /// Send block-id prompts as a chat of one user message holding the whole text (as clients
    /// that fold a conversation's history into one message do) instead of a completions prompt.
    pub blocks_as_chat: bool,
}

impl Request {
    /// The endpoint path and JSON body for this request.
    pub fn body(&self, opts: &BodyOptions) -> (&'static str, Value) {
        let mut body = Map::new();
        body.insert("model".into(), json!(opts.model));
        let path = match &self.prompt {
            Prompt::Messages(messages) => {
                body.insert("messages".into(), Value::Array(messages.clone()));
                CHAT_PATH
            }
            Prompt::Text(text) => {
                body.insert("prompt".into(), json!(text));
                COMPLETIONS_PATH
            }
            Prompt::Blocks { ids, input_length } => {
                let mut text = text::blocks(ids, opts.block_tokens);
                if let Some(tokens) = input_length {
                    let len = usize::try_from(*tokens)
                        .unwrap_or(usize::MAX)
                        .saturating_mul(text::BYTES_PER_TOKEN);
                    // Block text is ASCII: any cut is a char boundary.
                    text.truncate(len);
                }
                if opts.blocks_as_chat {
                    let message = json!({"role": "user", "content": text});
                    body.insert("messages".into(), Value::Array(vec![message]));
                    CHAT_PATH
                } else {
                    body.insert("prompt".into(), Value::String(text));
                    COMPLETIONS_PATH
                }
            }
        };
        body.insert("max_tokens".into(), json!(self.output_tokens));
        if opts.stream {
            body.insert("stream".into(), json!(true));
            // OpenAI-style servers report usage in a stream only when asked.
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        if opts.key_in_body {
            if let Some(key) = &self.key {
                body.insert("prompt_cache_key".into(), json!(key));
            }
        }
        (path, Value::Object(body))
    }
}

/// Reads a whole trace. Blank lines are skipped; the first bad line is an
/// error naming its number. Requests come back in arrival order (a stable
/// sort, so equal times keep file order).
pub fn read<R: BufRead>(input: R) -> Result<Vec<Request>, String> {
    let mut requests = Vec::new();
    for (i, line) in input.lines().enumerate() {
        let number = i + 1;
        let line = line.map_err(|e| format!("line {number}: cannot read: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let request = parse_line(&line, number).map_err(|e| format!("line {number}: {e}"))?;
        requests.push(request);
    }
    requests.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    Ok(requests)
}

/// Reads the trace file at `path` (`-` is stdin).
pub fn read_file(path: &str) -> Result<Vec<Request>, String> {
    let result = if path == "-" {
        read(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(path).map_err(|e| format!("cannot open {path}: {e}"))?;
        read(std::io::BufReader::new(file))
    };
    result.map_err(|e| format!("{path}: {e}"))
}

/// Parses one non-blank line.
pub fn parse_line(line: &str, number: usize) -> Result<Request, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
    let Value::Object(obj) = value else {
        return Err("expected a JSON object".into());
    };
    let t_ms = match (obj.get("t_ms"), obj.get("timestamp")) {
        (Some(v), _) => time(v, "t_ms")?,
        (None, Some(v)) => time(v, "timestamp")?,
        (None, None) => return Err("missing arrival time (t_ms or timestamp)".into()),
    };
    let key = name(obj.get("key"), "key")?;
    let session = name(obj.get("session"), "session")?;
    let output_tokens = match (obj.get("output_tokens"), obj.get("output_length")) {
        (Some(v), _) => count(v, "output_tokens")?,
        (None, Some(v)) => count(v, "output_length")?,
        (None, None) => DEFAULT_OUTPUT_TOKENS,
    };
    let input_length = obj
        .get("input_length")
        .map(|v| count(v, "input_length"))
        .transpose()?;
    let sources: Vec<&str> = ["messages", "text", "blocks", "hash_ids"]
        .into_iter()
        .filter(|f| obj.contains_key(*f))
        .collect();
    let prompt = match sources.as_slice() {
        ["messages"] => Prompt::Messages(messages(&obj["messages"])?),
        ["text"] => match &obj["text"] {
            Value::String(s) => Prompt::Text(s.clone()),
            _ => return Err("text: expected a string".into()),
        },
        [field @ ("blocks" | "hash_ids")] => Prompt::Blocks {
            ids: block_ids(&obj[*field], field)?,
            input_length,
        },
        [] => return Err("missing prompt: one of messages, text, blocks, hash_ids".into()),
        many => {
            return Err(format!(
                "several prompts given ({}): expected one",
                many.join(", ")
            ))
        }
    };
    Ok(Request {
        line: number,
        t_ms,
        key,
        session,
        prompt,
        output_tokens,
    })
}

/// A key or session name: a string (or a number, as text); absent or `null`: none.
fn name(v: Option<&Value>, field: &str) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(_) => Err(format!("{field}: expected a string")),
    }
}

fn time(v: &Value, field: &str) -> Result<f64, String> {
    match v.as_f64() {
        Some(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!(
            "{field}: expected a non-negative number of milliseconds"
        )),
    }
}

fn count(v: &Value, field: &str) -> Result<u64, String> {
    v.as_u64()
        .ok_or_else(|| format!("{field}: expected a non-negative integer"))
}

fn messages(v: &Value) -> Result<Vec<Value>, String> {
    let Value::Array(list) = v else {
        return Err("messages: expected an array".into());
    };
    for (i, m) in list.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(format!(
                "messages[{i}]: expected an object with a string role"
            ));
        }
    }
    Ok(list.clone())
}

fn block_ids(v: &Value, field: &str) -> Result<Vec<u64>, String> {
    let Value::Array(list) = v else {
        return Err(format!("{field}: expected an array of integers"));
    };
    list.iter()
        .enumerate()
        .map(|(i, id)| {
            id.as_u64()
                .ok_or_else(|| format!("{field}[{i}]: expected a non-negative integer"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> BodyOptions {
        BodyOptions {
            model: "m".into(),
            block_tokens: 4,
            stream: false,
            key_in_body: false,
            blocks_as_chat: false,
        }
    }

    #[test]
    fn own_dialect() {
        let text = r#"{"t_ms": 12.5, "key": "t1-s2", "messages": [{"role":"system","content":"hi"},{"role":"user","content":"yo"}], "output_tokens": 32}

{"t_ms": 3, "text": "hello world"}
"#;
        let reqs = read(text.as_bytes()).expect("valid trace");
        assert_eq!(reqs.len(), 2);
        // Sorted by time: the text request (line 3) comes first.
        assert_eq!(reqs[0].line, 3);
        assert_eq!(reqs[0].prompt, Prompt::Text("hello world".into()));
        assert_eq!(reqs[0].key, None);
        assert_eq!(reqs[0].output_tokens, DEFAULT_OUTPUT_TOKENS);
        assert_eq!(reqs[1].t_ms, 12.5);
        assert_eq!(reqs[1].key.as_deref(), Some("t1-s2"));
        assert_eq!(reqs[1].output_tokens, 32);
        let Prompt::Messages(m) = &reqs[1].prompt else {
            panic!("messages expected")
        };
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn mooncake_dialect() {
        let line =
            r#"{"timestamp": 27482, "input_length": 6, "output_length": 52, "hash_ids": [46, 47]}"#;
        let req = parse_line(line, 1).expect("mooncake line");
        assert_eq!(req.t_ms, 27482.0);
        assert_eq!(req.output_tokens, 52);
        assert_eq!(
            req.prompt,
            Prompt::Blocks {
                ids: vec![46, 47],
                input_length: Some(6)
            }
        );
        let (path, body) = req.body(&opts());
        assert_eq!(path, COMPLETIONS_PATH);
        let prompt = body["prompt"].as_str().expect("prompt");
        // Two 4-token blocks (32 bytes) cut to 6 tokens (24 bytes).
        assert_eq!(prompt.len(), 24);
        assert_eq!(prompt, &text::blocks(&[46, 47], 4)[..24]);
        assert_eq!(body["max_tokens"], 52);
        assert_eq!(body["model"], "m");
        // As a chat: the same text, as the one user message.
        let as_chat = BodyOptions {
            blocks_as_chat: true,
            ..opts()
        };
        let (path, body) = req.body(&as_chat);
        assert_eq!(path, CHAT_PATH);
        assert!(body.get("prompt").is_none());
        assert_eq!(body["messages"].as_array().map(Vec::len), Some(1));
        assert_eq!(body["messages"][0]["role"], "user");
        assert_eq!(body["messages"][0]["content"].as_str(), Some(prompt));
        // `blocks` is the same thing under our name; input_length is optional.
        let req = parse_line(r#"{"t_ms": 0, "blocks": [1, 2, 3]}"#, 1).expect("blocks");
        let (_, body) = req.body(&opts());
        assert_eq!(body["prompt"].as_str().map(str::len), Some(48));
    }

    #[test]
    fn bodies_for_each_mode() {
        let req = parse_line(
            r#"{"t_ms": 0, "key": "k", "messages": [{"role":"user","content":"x"}]}"#,
            1,
        )
        .expect("chat");
        let (path, body) = req.body(&opts());
        assert_eq!(path, CHAT_PATH);
        assert_eq!(body["messages"][0]["content"], "x");
        assert!(body.get("stream").is_none());
        assert!(body.get("prompt_cache_key").is_none());
        let streamed = BodyOptions {
            stream: true,
            key_in_body: true,
            ..opts()
        };
        let (_, body) = req.body(&streamed);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["prompt_cache_key"], "k");
    }

    #[test]
    fn bad_lines_name_the_line() {
        let cases = [
            ("not json", "invalid JSON"),
            ("[1]", "JSON object"),
            (r#"{"text": "x"}"#, "missing arrival time"),
            (r#"{"t_ms": -1, "text": "x"}"#, "t_ms"),
            (r#"{"t_ms": "5", "text": "x"}"#, "t_ms"),
            (r#"{"t_ms": 0}"#, "missing prompt"),
            (
                r#"{"t_ms": 0, "text": "x", "hash_ids": [1]}"#,
                "several prompts",
            ),
            (r#"{"t_ms": 0, "text": 5}"#, "text"),
            (r#"{"t_ms": 0, "hash_ids": [1, -2]}"#, "hash_ids[1]"),
            (r#"{"t_ms": 0, "blocks": "1"}"#, "blocks"),
            (
                r#"{"t_ms": 0, "messages": [{"content": "x"}]}"#,
                "messages[0]",
            ),
            (
                r#"{"t_ms": 0, "text": "x", "output_tokens": 1.5}"#,
                "output_tokens",
            ),
            (r#"{"t_ms": 0, "text": "x", "key": [1]}"#, "key"),
            (
                r#"{"t_ms": 0, "hash_ids": [1], "input_length": -3}"#,
                "input_length",
            ),
        ];
        for (line, expected) in cases {
            let trace = format!("{{\"t_ms\": 0, \"text\": \"ok\"}}\n\n{line}\n");
            let err = read(trace.as_bytes()).expect_err(line);
            assert!(err.starts_with("line 3: "), "{line}: {err}");
            assert!(err.contains(expected), "{line}: {err}");
        }
    }
}
