//! Routing and the OpenAI / SGLang shaped answers.
//!
//! Every JSON answer carries a `mock` object describing what actually reached
//! this upstream (rank, path, body length and FNV-1a 64, headers) so the
//! end-to-end tests can assert on the proxy's effect without a packet capture.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::cli::Config;
use crate::fnv::fnv1a64_hex;
use crate::http::{self, BodyStream, Request, ResponseMeta};

const DEFAULT_MODEL: &str = "mock-model";
/// Tokens (= SSE events) produced when the request does not ask for a count.
const DEFAULT_TOKENS: u64 = 5;
/// Upper bound so a request cannot keep a connection streaming for long.
const MAX_TOKENS: u64 = 50;

/// Makes ids unique within one process so tests can tell answers apart.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Generate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Health,
    Models,
    Llm(Api),
    MethodNotAllowed,
    NotFound,
}

fn route(method: &str, path: &str) -> Route {
    let read = matches!(method, "GET" | "HEAD");
    let post = method == "POST";
    match path {
        "/health" if read => Route::Health,
        "/v1/models" if read => Route::Models,
        "/v1/chat/completions" if post => Route::Llm(Api::Chat),
        "/v1/completions" if post => Route::Llm(Api::Completion),
        "/generate" if post => Route::Llm(Api::Generate),
        "/health" | "/v1/models" | "/v1/chat/completions" | "/v1/completions" | "/generate" => {
            Route::MethodNotAllowed
        }
        _ => Route::NotFound,
    }
}

/// Answers one parsed request. Returns whether the connection may be reused.
pub fn respond<W: Write>(w: &mut W, cfg: &Config, req: &Request) -> io::Result<bool> {
    let meta = ResponseMeta::for_request(cfg.rank, &req.head);
    match route(&req.head.method, req.head.path()) {
        Route::Health => http::write_response(w, &meta, 200, "text/plain", b"ok"),
        Route::Models => write_json(w, &meta, 200, &models(cfg.rank, req)),
        Route::Llm(api) => serve_llm(w, cfg, &meta, req, api),
        Route::MethodNotAllowed => {
            let body = error_json(cfg.rank, "method not allowed", "method_not_allowed");
            write_json(w, &meta, 405, &with_mock(body, cfg.rank, req))
        }
        Route::NotFound => {
            let body = error_json(cfg.rank, "no such endpoint", "not_found");
            write_json(w, &meta, 404, &with_mock(body, cfg.rank, req))
        }
    }
}

/// Body of the answer to a request that could not be parsed.
pub fn error_json(rank: u32, message: &str, kind: &str) -> Value {
    json!({
        "error": {"message": message, "type": kind},
        "mock": {"rank": rank},
    })
}

pub fn write_json<W: Write>(
    w: &mut W,
    meta: &ResponseMeta,
    status: u16,
    value: &Value,
) -> io::Result<bool> {
    // Serialising a `Value` cannot fail; an empty body is a safe fallback.
    let body = serde_json::to_vec(value).unwrap_or_default();
    http::write_response(w, meta, status, "application/json", &body)
}

/// Replaces the minimal `mock` object with the full one for `req`.
fn with_mock(mut value: Value, rank: u32, req: &Request) -> Value {
    if let Some(obj) = value.as_object_mut() {
        obj.insert("mock".into(), mock_info(rank, req));
    }
    value
}

/// What reached this upstream: the e2e tests' view through the proxy.
fn mock_info(rank: u32, req: &Request) -> Value {
    let mut headers = Map::new();
    for (name, value) in &req.head.headers {
        // Repeated headers are combined as HTTP allows (RFC 9110 5.3).
        let combined = match headers.get(name).and_then(Value::as_str) {
            Some(prev) => format!("{prev}, {value}"),
            None => value.clone(),
        };
        headers.insert(name.clone(), Value::String(combined));
    }
    json!({
        "rank": rank,
        "method": req.head.method,
        "path": req.head.target,
        "body_len": req.body.len(),
        "body_fnv1a64": fnv1a64_hex(&req.body),
        "headers": headers,
    })
}

fn models(rank: u32, req: &Request) -> Value {
    let list = json!({
        "object": "list",
        "data": [{"id": DEFAULT_MODEL, "object": "model", "created": 0, "owned_by": "mock-rank"}],
    });
    with_mock(list, rank, req)
}

/// Everything needed to render one LLM answer, streamed or not.
struct Answer {
    api: Api,
    rank: u32,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u64,
    tokens: u64,
    stream: bool,
    mock: Value,
}

impl Answer {
    fn new(api: Api, rank: u32, req: &Request) -> Self {
        // A body that is not JSON still gets an answer: the mock must accept
        // whatever a real proxy passes through.
        let body: Option<Value> = serde_json::from_slice(&req.body).ok();
        let body = body.as_ref();
        let prefix = match api {
            Api::Chat => "chatcmpl",
            Api::Completion => "cmpl",
            Api::Generate => "gen",
        };
        Answer {
            api,
            rank,
            id: format!(
                "{prefix}-mock-{rank}-{}",
                NEXT_ID.fetch_add(1, Ordering::Relaxed)
            ),
            created: unix_now(),
            model: requested_model(body),
            prompt_tokens: req.body.len() as u64 / 4,
            tokens: requested_tokens(body),
            stream: body.and_then(|b| b.get("stream")) == Some(&Value::Bool(true)),
            mock: mock_info(rank, req),
        }
    }

    /// Text of token `i`; every piece names the rank so any fragment of an
    /// answer identifies who produced it.
    fn piece(&self, i: u64) -> String {
        format!("rank {} token {}. ", self.rank, i)
    }

    fn text_upto(&self, n: u64) -> String {
        let text: String = (0..n).map(|i| self.piece(i)).collect();
        text.trim_end().to_string()
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        })
    }

    fn generate_meta(&self, completion_tokens: u64, done: bool) -> Value {
        json!({
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": 0,
            "finish_reason": if done { json!({"type": "stop"}) } else { Value::Null },
        })
    }

    /// The complete (non-streaming) answer.
    fn full(&self) -> Value {
        let text = format!(
            "Hello from DP rank {}: {}",
            self.rank,
            self.text_upto(self.tokens)
        );
        match self.api {
            Api::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }],
                "usage": self.usage(),
                "mock": self.mock,
            }),
            Api::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": self.usage(),
                "mock": self.mock,
            }),
            Api::Generate => json!({
                "text": text,
                "meta_info": self.generate_meta(self.tokens, true),
                "mock": self.mock,
            }),
        }
    }

    /// SSE event `i` of a streamed answer.
    fn chunk(&self, i: u64) -> Value {
        let last = i + 1 >= self.tokens;
        let finish = if last { json!("stop") } else { Value::Null };
        match self.api {
            Api::Chat => {
                let mut delta = json!({"content": self.piece(i)});
                if i == 0 {
                    delta["role"] = json!("assistant");
                }
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    "rank": self.rank,
                    "mock": self.mock,
                })
            }
            Api::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": self.piece(i), "finish_reason": finish}],
                "rank": self.rank,
                "mock": self.mock,
            }),
            // SGLang streams the cumulative text in every event.
            Api::Generate => json!({
                "text": self.text_upto(i + 1),
                "meta_info": self.generate_meta(i + 1, last),
                "rank": self.rank,
                "mock": self.mock,
            }),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn requested_model(body: Option<&Value>) -> String {
    body.and_then(|b| b.get("model"))
        .and_then(Value::as_str)
        .unwrap_or(DEFAULT_MODEL)
        .to_string()
}

/// Token / event count: OpenAI `max_tokens` or `max_completion_tokens`, SGLang
/// `sampling_params.max_new_tokens`, clamped to 1..=MAX_TOKENS.
fn requested_tokens(body: Option<&Value>) -> u64 {
    let Some(body) = body else {
        return DEFAULT_TOKENS;
    };
    body.get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .or_else(|| body.pointer("/sampling_params/max_new_tokens"))
        .and_then(Value::as_u64)
        .map_or(DEFAULT_TOKENS, |n| n.clamp(1, MAX_TOKENS))
}

fn serve_llm<W: Write>(
    w: &mut W,
    cfg: &Config,
    meta: &ResponseMeta,
    req: &Request,
    api: Api,
) -> io::Result<bool> {
    let answer = Answer::new(api, cfg.rank, req);
    // Simulated time-to-first-byte: before the status line, so it also
    // delays the response headers the filter learns the rank from.
    sleep_ms(cfg.delay_ms);
    if answer.stream {
        stream(w, cfg, meta, &answer)
    } else {
        write_json(w, meta, 200, &answer.full())
    }
}

fn stream<W: Write>(
    w: &mut W,
    cfg: &Config,
    meta: &ResponseMeta,
    answer: &Answer,
) -> io::Result<bool> {
    let mut body = BodyStream::start(w, meta, "text/event-stream")?;
    for i in 0..answer.tokens {
        if i > 0 {
            sleep_ms(cfg.stream_interval_ms);
        }
        let event = format!("data: {}\n\n", answer.chunk(i));
        body.send(event.as_bytes())?;
    }
    body.send(b"data: [DONE]\n\n")?;
    body.finish()
}

fn sleep_ms(ms: u64) {
    if ms > 0 {
        thread::sleep(Duration::from_millis(ms));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{read_body, read_head};
    use std::io::Cursor;

    fn config() -> Config {
        Config {
            rank: 3,
            host: "127.0.0.1".into(),
            port: 0,
            delay_ms: 0,
            stream_interval_ms: 0,
        }
    }

    fn request(text: &str) -> Request {
        let mut input = Cursor::new(text.as_bytes().to_vec());
        let head = read_head(&mut input).expect("head");
        let body = read_body(&mut input, head.framing).expect("body");
        Request { head, body }
    }

    fn post(path: &str, body: &str) -> Request {
        request(&format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ))
    }

    /// Runs `respond` and splits the output into (head, body).
    fn run(req: &Request) -> (String, String) {
        let mut out = Vec::new();
        respond(&mut out, &config(), req).expect("respond");
        let text = String::from_utf8(out).expect("utf8");
        let (head, body) = text.split_once("\r\n\r\n").expect("header end");
        (head.to_string(), body.to_string())
    }

    #[test]
    fn routes() {
        assert_eq!(route("GET", "/health"), Route::Health);
        assert_eq!(route("HEAD", "/v1/models"), Route::Models);
        assert_eq!(route("POST", "/generate"), Route::Llm(Api::Generate));
        assert_eq!(route("GET", "/generate"), Route::MethodNotAllowed);
        assert_eq!(route("POST", "/nope"), Route::NotFound);
    }

    #[test]
    fn token_count() {
        let count = |s: &str| requested_tokens(serde_json::from_str::<Value>(s).ok().as_ref());
        assert_eq!(count("not json"), 5);
        assert_eq!(count(r#"{"max_tokens": 3}"#), 3);
        assert_eq!(count(r#"{"max_tokens": 0}"#), 1);
        assert_eq!(count(r#"{"max_tokens": 4096}"#), 50);
        assert_eq!(count(r#"{"max_tokens": "7"}"#), 5);
        assert_eq!(count(r#"{"sampling_params": {"max_new_tokens": 2}}"#), 2);
    }

    #[test]
    fn chat_answer_shape_and_mock() {
        let body = r#"{"model":"m1","messages":[]}"#;
        let (head, json_body) = run(&post("/v1/chat/completions", body));
        assert!(head.starts_with("HTTP/1.1 200 OK"));
        assert!(head.contains("x-dp-rank: 3"));
        let v: Value = serde_json::from_str(&json_body).expect("json");
        assert_eq!(v["model"], "m1");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(v["mock"]["rank"], 3);
        assert_eq!(v["mock"]["path"], "/v1/chat/completions");
        assert_eq!(v["mock"]["body_len"], body.len());
        assert_eq!(v["mock"]["body_fnv1a64"], fnv1a64_hex(body.as_bytes()));
        assert_eq!(v["mock"]["headers"]["x-a"], "1, 2");
        assert_eq!(v["mock"]["headers"]["host"], "x");
    }

    #[test]
    fn malformed_json_body_still_answered() {
        let (head, json_body) = run(&post("/generate", "{not json"));
        assert!(head.starts_with("HTTP/1.1 200 OK"));
        let v: Value = serde_json::from_str(&json_body).expect("json");
        assert_eq!(v["meta_info"]["cached_tokens"], 0);
        assert_eq!(v["mock"]["body_len"], 9);
    }

    #[test]
    fn streamed_answer_events() {
        let (head, body) = run(&post(
            "/v1/completions",
            r#"{"stream":true,"max_tokens":3}"#,
        ));
        assert!(head.contains("content-type: text/event-stream"));
        assert!(head.contains("transfer-encoding: chunked"));
        assert_eq!(body.matches("data: {").count(), 3);
        assert!(body.contains("data: [DONE]\n\n"));
        assert!(body.ends_with("0\r\n\r\n"));
    }

    #[test]
    fn not_found_and_health() {
        let (head, body) = run(&request("GET /x HTTP/1.1\r\n\r\n"));
        assert!(head.starts_with("HTTP/1.1 404"));
        assert!(head.contains("x-dp-rank: 3"));
        assert!(body.contains("\"not_found\""));
        let (head, body) = run(&request("GET /health HTTP/1.1\r\n\r\n"));
        assert!(head.starts_with("HTTP/1.1 200"));
        assert_eq!(body, "ok");
    }
}
