//! Routing and the OpenAI / SGLang shaped answers.
//!
//! Every JSON answer carries a `mock` object describing what actually reached
//! this upstream (rank, path, body length and FNV-1a 64, headers) so the
//! end-to-end tests can assert on the proxy's effect without a packet capture.
//! LLM answers add `inflight` / `max_inflight`, and GET /mock/stats reports the
//! per-rank counters (see `stats`). In engine mode (`--engine`) LLM requests
//! are first dispatched to an internal rank (see `engine`).
//!
//! The info endpoints a model gateway probes before it routes to a worker
//! (the SGLang model gateway: `/health`, then `/server_info` and `/model_info`,
//! each under its older `/get_*` name too) answer in SGLang's shape, so the
//! mock registers as a healthy SGLang worker.
//!
//! An LLM request is served like an engine would: it waits for one of the
//! rank's `--max-concurrency` slots, looks its prompt up in the rank's prefix
//! cache (see `rank`), and takes the modelled prefill and decode time (see
//! `service`). Answers report the prompt and cached token counts in `usage` /
//! `meta_info`, in `mock` and in `x-mock-*` headers.

use std::io::{self, Write};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mock_rank::fnv::fnv1a64_hex;
use mock_rank::prompt::prompt_blocks;
use serde_json::{json, Map, Value};

use crate::cli::{Config, Mode};
use crate::engine::{self, RoundRobin};
use crate::http::{self, BodyStream, Head, Request, ResponseMeta};
use crate::rank::RankState;
use crate::service::{event_ranges, ServiceModel};

const DEFAULT_MODEL: &str = "mock-model";
/// What `/model_info` reports: a gateway labels the worker with them.
const MODEL_TYPE: &str = "mock";
const ARCHITECTURE: &str = "MockRankForCausalLM";
/// Tokens (= SSE events) produced when the request does not ask for a count.
const DEFAULT_TOKENS: u64 = 5;
/// Upper bound so a request cannot keep a connection streaming for long.
const MAX_TOKENS: u64 = 50;
/// Upper bound while decode time is modelled: long enough for realistic
/// generations, whose time the model (not the count) then bounds.
const MAX_MODELED_TOKENS: u64 = 4096;

/// Makes ids unique within one process so tests can tell answers apart.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Generate,
    /// OpenAI Responses (`/v1/responses`).
    Responses,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Health,
    Models,
    ServerInfo,
    ModelInfo,
    Llm(Api),
    Stats,
    ResetStats,
    MethodNotAllowed,
    NotFound,
}

fn route(method: &str, path: &str) -> Route {
    let read = matches!(method, "GET" | "HEAD");
    let post = method == "POST";
    match path {
        "/health" if read => Route::Health,
        "/v1/models" if read => Route::Models,
        // SGLang serves both names; gateways try the new one first.
        "/server_info" | "/get_server_info" if read => Route::ServerInfo,
        "/model_info" | "/get_model_info" if read => Route::ModelInfo,
        "/v1/chat/completions" if post => Route::Llm(Api::Chat),
        "/v1/completions" if post => Route::Llm(Api::Completion),
        "/generate" if post => Route::Llm(Api::Generate),
        "/v1/responses" if post => Route::Llm(Api::Responses),
        "/v1/messages" if post => Route::Llm(Api::Messages),
        "/mock/stats" if read => Route::Stats,
        // `/mock/reset` is an alias: it also empties the prefix caches.
        "/mock/reset-stats" | "/mock/reset" if post => Route::ResetStats,
        "/health"
        | "/v1/models"
        | "/server_info"
        | "/get_server_info"
        | "/model_info"
        | "/get_model_info"
        | "/v1/chat/completions"
        | "/v1/completions"
        | "/generate"
        | "/v1/responses"
        | "/v1/messages"
        | "/mock/stats"
        | "/mock/reset-stats"
        | "/mock/reset" => Route::MethodNotAllowed,
        _ => Route::NotFound,
    }
}

/// The configuration plus the shared state of the running mock.
#[derive(Debug)]
pub struct Server {
    cfg: Config,
    service: ServiceModel,
    /// One entry per rank served: `[--rank]`, or internal ranks 0..dp_size.
    ranks: Vec<RankState>,
    round_robin: RoundRobin,
}

impl Server {
    pub fn new(cfg: Config) -> Self {
        let ranks = (0..cfg.dp_size())
            .map(|_| RankState::new(cfg.cache_blocks, cfg.max_concurrency))
            .collect();
        Server {
            service: ServiceModel::from_config(&cfg),
            cfg,
            ranks,
            round_robin: RoundRobin::default(),
        }
    }

    /// The rank every answer reports: the `--rank`, or `None` for an engine,
    /// whose answers name a rank only once a request is dispatched to one.
    pub fn fixed_rank(&self) -> Option<u32> {
        match self.cfg.mode {
            Mode::Rank(rank) => Some(rank),
            Mode::Engine { .. } => None,
        }
    }

    /// `(rank as reported, state)` of every rank served.
    fn ranks(&self) -> impl Iterator<Item = (u32, &RankState)> {
        let fixed = self.fixed_rank();
        (0u32..)
            .zip(&self.ranks)
            .map(move |(i, state)| (fixed.unwrap_or(i), state))
    }

    /// State of `rank`, which `dispatch` returned.
    fn rank_state(&self, rank: u32) -> &RankState {
        let index = match self.cfg.mode {
            Mode::Rank(_) => 0,
            Mode::Engine { .. } => rank as usize,
        };
        &self.ranks[index]
    }

    /// The rank that serves an LLM request: the `--rank`; for an engine the
    /// rank the request names where that engine honours it (`engine`), else
    /// the next rank round robin. `Err` when the engine refuses the request.
    fn dispatch(&self, req: &Request, api: Api) -> Result<u32, engine::Refusal> {
        let Mode::Engine { dp_size } = self.cfg.mode else {
            return Ok(self.fixed_rank().unwrap_or(0));
        };
        let path = match api {
            Api::Generate => engine::Path::Generate,
            Api::Chat | Api::Completion | Api::Responses | Api::Messages => engine::Path::OpenAi,
        };
        let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
        let kind = self.cfg.engine_kind;
        Ok(
            engine::honoured_rank(kind, path, &req.head.headers, &body, dp_size)?
                .unwrap_or_else(|| self.round_robin.pick(dp_size)),
        )
    }

    fn stats_json(&self) -> Value {
        let per_rank: Vec<Value> = self
            .ranks()
            .map(|(rank, state)| {
                let s = state.stats.snapshot();
                let cache = state.cache_snapshot();
                json!({
                    "rank": rank,
                    "requests": s.requests,
                    "inflight": s.inflight,
                    "max_inflight": s.max_inflight,
                    "prompt_tokens": s.prompt_tokens,
                    "cached_tokens": s.cached_tokens,
                    "cache_blocks": cache.blocks,
                    "cache_capacity": cache.capacity,
                    "cache_evictions": cache.evictions,
                    "max_queue_us": s.max_queue_us,
                })
            })
            .collect();
        json!({
            "rank": self.fixed_rank(),
            "engine": self.fixed_rank().is_none(),
            "dp_size": self.cfg.dp_size(),
            "per_rank": per_rank,
        })
    }

    /// Zeroes the counters, empties the prefix caches and restarts the
    /// engine's round robin at rank 0.
    fn reset_stats(&self) {
        for state in &self.ranks {
            state.reset();
        }
        self.round_robin.reset();
    }

    /// Most output tokens a request can ask for.
    fn token_cap(&self) -> u64 {
        if self.service.decodes() {
            MAX_MODELED_TOKENS
        } else {
            MAX_TOKENS
        }
    }
}

/// Answers one parsed request. Returns whether the connection may be reused.
pub fn respond<W: Write>(w: &mut W, srv: &Server, req: &Request) -> io::Result<bool> {
    let rank = srv.fixed_rank();
    let meta = ResponseMeta::for_request(rank, &req.head);
    match route(&req.head.method, req.head.path()) {
        Route::Health => http::write_response(w, &meta, 200, "text/plain", b"ok"),
        Route::Models => write_json(w, &meta, 200, &models(srv, req)),
        Route::ServerInfo => write_json(w, &meta, 200, &server_info(srv, req)),
        Route::ModelInfo => write_json(w, &meta, 200, &model_info(srv, req)),
        // An engine that drops a request it will not read (or a kept-alive connection it is
        // closing): no answer at all, the connection closed.
        Route::Llm(_) if requested_close(&req.head) => Ok(false),
        Route::Llm(api) => match srv.dispatch(req, api) {
            Ok(rank) => match requested_failure(&req.head) {
                // An engine answers some requests with an error of its own (a parameter it
                // rejects, an internal error): the tests ask for one with `x-mock-fail`.
                Some(status) => {
                    let meta = ResponseMeta::for_request(Some(rank), &req.head);
                    let body = error_json(Some(rank), "failure requested", "mock_failure");
                    write_json(w, &meta, status, &with_mock(body, srv, req))
                }
                None => serve_llm(w, srv, rank, req, api),
            },
            Err(refusal) => {
                let body = error_json(rank, &refusal.message, "invalid_request_error");
                write_json(w, &meta, refusal.status, &with_mock(body, srv, req))
            }
        },
        Route::Stats => write_json(w, &meta, 200, &srv.stats_json()),
        Route::ResetStats => {
            srv.reset_stats();
            write_json(w, &meta, 200, &srv.stats_json())
        }
        Route::MethodNotAllowed => {
            let body = error_json(rank, "method not allowed", "method_not_allowed");
            write_json(w, &meta, 405, &with_mock(body, srv, req))
        }
        Route::NotFound => {
            let body = error_json(rank, "no such endpoint", "not_found");
            write_json(w, &meta, 404, &with_mock(body, srv, req))
        }
    }
}

/// Whether an LLM request asks the mock to close the connection without answering
/// (`x-mock-fail: close`).
fn requested_close(head: &Head) -> bool {
    head.headers
        .iter()
        .any(|(n, v)| n == "x-mock-fail" && v.trim() == "close")
}

/// The status an LLM request asks to be answered with (`x-mock-fail: 400..=599`).
fn requested_failure(head: &Head) -> Option<u16> {
    let (_, value) = head.headers.iter().find(|(n, _)| n == "x-mock-fail")?;
    value
        .trim()
        .parse()
        .ok()
        .filter(|s| (400..=599).contains(s))
}

/// Body of the answer to a request that could not be parsed.
pub fn error_json(rank: Option<u32>, message: &str, kind: &str) -> Value {
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

/// Replaces the minimal `mock` object with the full one for `req`, which was
/// not dispatched to a rank (in engine mode `mock.rank` is null).
fn with_mock(mut value: Value, srv: &Server, req: &Request) -> Value {
    if let Some(obj) = value.as_object_mut() {
        obj.insert("mock".into(), mock_info(srv, srv.fixed_rank(), req));
    }
    value
}

/// What reached this upstream: the e2e tests' view through the proxy.
fn mock_info(srv: &Server, rank: Option<u32>, req: &Request) -> Value {
    let mut headers = Map::new();
    for (name, value) in &req.head.headers {
        // Repeated headers are combined as HTTP allows (RFC 9110 5.3).
        let combined = match headers.get(name).and_then(Value::as_str) {
            Some(prev) => format!("{prev}, {value}"),
            None => value.clone(),
        };
        headers.insert(name.clone(), Value::String(combined));
    }
    let mut mock = json!({
        "rank": rank,
        "engine": false,
        "method": req.head.method,
        "path": req.head.target,
        "body_len": req.body.len(),
        "body_fnv1a64": fnv1a64_hex(&req.body),
        "headers": headers,
    });
    if let Mode::Engine { dp_size } = srv.cfg.mode {
        mock["engine"] = json!(true);
        mock["dp_size"] = json!(dp_size);
    }
    mock
}

fn models(srv: &Server, req: &Request) -> Value {
    let list = json!({
        "object": "list",
        "data": [{
            "id": DEFAULT_MODEL,
            "object": "model",
            "created": 0,
            "owned_by": "mock-rank",
            "root": srv.cfg.model_path,
        }],
    });
    with_mock(list, srv, req)
}

/// `/server_info`: the engine's settings, as SGLang lists its server args.
/// Limits the mock does not have (an unlimited cache or concurrency) are null.
fn server_info(srv: &Server, req: &Request) -> Value {
    let cfg = &srv.cfg;
    let nonzero = |n: u64| (n > 0).then_some(n);
    let cache_tokens = (cfg.cache_blocks as u64).saturating_mul(u64::from(cfg.block_tokens));
    let info = json!({
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "served_model_name": DEFAULT_MODEL,
        "dp_size": cfg.dp_size(),
        "tp_size": 1,
        "page_size": cfg.block_tokens,
        "max_running_requests": nonzero(cfg.max_concurrency as u64),
        "max_total_tokens": nonzero(cache_tokens),
        "version": concat!("mock-rank ", env!("CARGO_PKG_VERSION")),
    });
    with_mock(info, srv, req)
}

/// `/model_info`: what the served model is, in SGLang's fields.
fn model_info(srv: &Server, req: &Request) -> Value {
    let info = json!({
        "model_path": srv.cfg.model_path,
        "tokenizer_path": srv.cfg.model_path,
        "is_generation": true,
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
    });
    with_mock(info, srv, req)
}

/// What the simulated engine did with a request before answering.
#[derive(Debug, Clone, Copy)]
struct Served {
    prompt_tokens: u64,
    /// Prompt tokens found in the rank's prefix cache.
    cached_tokens: u64,
    /// Time spent waiting for a `--max-concurrency` slot.
    queue_us: u64,
}

impl Served {
    fn headers(&self) -> Vec<(&'static str, String)> {
        vec![
            ("x-mock-prompt-tokens", self.prompt_tokens.to_string()),
            ("x-mock-cached-tokens", self.cached_tokens.to_string()),
            ("x-mock-queue-us", self.queue_us.to_string()),
        ]
    }
}

/// Everything needed to render one LLM answer, streamed or not.
struct Answer {
    api: Api,
    rank: u32,
    id: String,
    created: u64,
    model: String,
    served: Served,
    tokens: u64,
    stream: bool,
    mock: Value,
}

impl Answer {
    /// `body` is `Null` when the request body is not JSON.
    fn new(api: Api, rank: u32, body: &Value, served: Served, token_cap: u64, mock: Value) -> Self {
        let prefix = match api {
            Api::Chat => "chatcmpl",
            Api::Completion => "cmpl",
            Api::Generate => "gen",
            Api::Responses => "resp",
            Api::Messages => "msg",
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
            served,
            tokens: requested_tokens(body, token_cap),
            stream: body.get("stream") == Some(&Value::Bool(true)),
            mock,
        }
    }

    /// Text of token `i`; every piece names the rank so any fragment of an
    /// answer identifies who produced it.
    fn piece(&self, i: u64) -> String {
        format!("rank {} token {}. ", self.rank, i)
    }

    /// Text of the tokens in `range`, as one SSE event carries them.
    fn pieces(&self, range: Range<u64>) -> String {
        range.map(|i| self.piece(i)).collect()
    }

    fn text_upto(&self, n: u64) -> String {
        self.pieces(0..n).trim_end().to_string()
    }

    fn usage(&self) -> Value {
        let prompt_tokens = self.served.prompt_tokens;
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": prompt_tokens + self.tokens,
            "prompt_tokens_details": {"cached_tokens": self.served.cached_tokens},
        })
    }

    fn generate_meta(&self, completion_tokens: u64, done: bool) -> Value {
        json!({
            "id": self.id,
            "prompt_tokens": self.served.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": self.served.cached_tokens,
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
            Api::Responses => json!({
                "id": self.id,
                "object": "response",
                "created_at": self.created,
                "model": self.model,
                "status": "completed",
                "output": [{
                    "type": "message",
                    "id": format!("msg-{}", self.id),
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }],
                "usage": self.responses_usage(),
                "mock": self.mock,
            }),
            Api::Messages => json!({
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": "end_turn",
                "usage": self.messages_usage(),
                "mock": self.mock,
            }),
        }
    }

    /// `usage` as the Messages API names it.
    fn messages_usage(&self) -> Value {
        let cached = self.served.cached_tokens;
        json!({
            "input_tokens": self.served.prompt_tokens.saturating_sub(cached),
            "cache_read_input_tokens": cached,
            "output_tokens": self.tokens,
        })
    }

    /// `usage` as the Responses API names it.
    fn responses_usage(&self) -> Value {
        let input_tokens = self.served.prompt_tokens;
        json!({
            "input_tokens": input_tokens,
            "output_tokens": self.tokens,
            "total_tokens": input_tokens + self.tokens,
            "input_tokens_details": {"cached_tokens": self.served.cached_tokens},
        })
    }

    /// The SSE event carrying the tokens in `range` of a streamed answer.
    /// The last OpenAI event also carries `usage`, as with
    /// `stream_options.include_usage` but without an extra event.
    fn chunk(&self, range: Range<u64>) -> Value {
        let last = range.end >= self.tokens;
        let finish = if last { json!("stop") } else { Value::Null };
        let mut event = match self.api {
            Api::Chat => {
                let mut delta = json!({"content": self.pieces(range.clone())});
                if range.start == 0 {
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
                "choices": [{
                    "index": 0,
                    "text": self.pieces(range.clone()),
                    "finish_reason": finish,
                }],
                "rank": self.rank,
                "mock": self.mock,
            }),
            // The Responses API's text delta events; the last one also
            // carries `usage` (the real stream sends it in `response.completed`).
            Api::Responses => {
                let mut event = json!({
                    "type": "response.output_text.delta",
                    "item_id": format!("msg-{}", self.id),
                    "delta": self.pieces(range.clone()),
                    "rank": self.rank,
                    "mock": self.mock,
                });
                if last {
                    event["usage"] = self.responses_usage();
                }
                return event;
            }
            // The Messages API's text delta events; the last one also
            // carries `usage` (the real stream sends it in `message_delta`).
            Api::Messages => {
                let mut event = json!({
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": self.pieces(range.clone())},
                    "rank": self.rank,
                    "mock": self.mock,
                });
                if last {
                    event["usage"] = self.messages_usage();
                }
                return event;
            }
            // SGLang streams the cumulative text in every event; its
            // meta_info already carries the token counts.
            Api::Generate => {
                return json!({
                    "text": self.text_upto(range.end),
                    "meta_info": self.generate_meta(range.end, last),
                    "rank": self.rank,
                    "mock": self.mock,
                })
            }
        };
        if last {
            event["usage"] = self.usage();
        }
        event
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn requested_model(body: &Value) -> String {
    body.get("model")
        .and_then(Value::as_str)
        .unwrap_or(DEFAULT_MODEL)
        .to_string()
}

/// Output token count: OpenAI `max_tokens` or `max_completion_tokens`, SGLang
/// `sampling_params.max_new_tokens`, clamped to 1..=cap.
fn requested_tokens(body: &Value, cap: u64) -> u64 {
    body.get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .or_else(|| body.get("max_output_tokens"))
        .or_else(|| body.pointer("/sampling_params/max_new_tokens"))
        .and_then(Value::as_u64)
        .map_or(DEFAULT_TOKENS, |n| n.clamp(1, cap))
}

/// Answers an LLM request on `rank`, counted in flight on that rank until
/// the answer is fully written (flushed) or writing it failed. Queued requests
/// count as in flight: to the proxy they are outstanding all the same.
fn serve_llm<W: Write>(
    w: &mut W,
    srv: &Server,
    rank: u32,
    req: &Request,
    api: Api,
) -> io::Result<bool> {
    let state = srv.rank_state(rank);
    let inflight = state.stats.enter();
    // A body that is not JSON still gets an answer: the mock must accept
    // whatever a real proxy passes through.
    let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
    let prompt = prompt_blocks(req.head.path(), &body, srv.cfg.block_tokens);
    // Held until the answer is written or writing failed (dropped on return).
    let slot = state.slots.acquire();
    let served = Served {
        prompt_tokens: prompt.prompt_tokens,
        cached_tokens: state.cached_tokens(&prompt, srv.cfg.block_tokens),
        queue_us: u64::try_from(slot.waited.as_micros()).unwrap_or(u64::MAX),
    };
    state
        .stats
        .record_service(served.prompt_tokens, served.cached_tokens, served.queue_us);
    let mut mock = mock_info(srv, Some(rank), req);
    mock["inflight"] = json!(inflight.inflight);
    mock["max_inflight"] = json!(inflight.max_inflight);
    mock["prompt_tokens"] = json!(served.prompt_tokens);
    mock["cached_tokens"] = json!(served.cached_tokens);
    mock["queue_us"] = json!(served.queue_us);
    if let Some(pd) = engine::pd_info(srv.cfg.engine_kind, &body, srv.cfg.prefill_dp_size()) {
        mock["pd"] = pd;
    }
    let mut meta = ResponseMeta::for_request(Some(rank), &req.head);
    meta.extra_headers = served.headers();
    let answer = Answer::new(api, rank, &body, served, srv.token_cap(), mock);
    // Simulated time to first token: before the status line, so it also
    // delays the response headers the filter learns the rank from.
    let uncached = served.prompt_tokens.saturating_sub(served.cached_tokens);
    let ttft = Duration::from_millis(srv.cfg.delay_for(rank)) + srv.service.prefill(uncached);
    if answer.stream {
        pause(ttft);
        stream(w, srv, &meta, &answer)
    } else {
        pause(ttft + srv.service.decode(answer.tokens));
        write_json(w, &meta, 200, &answer.full())
    }
}

/// Sends the answer's events: the first at once (the prefill is over), the
/// rest paced by the decode time when it is modelled, else by
/// `--stream-interval-ms`.
fn stream<W: Write>(
    w: &mut W,
    srv: &Server,
    meta: &ResponseMeta,
    answer: &Answer,
) -> io::Result<bool> {
    let mut body = BodyStream::start(w, meta, "text/event-stream")?;
    let first_token = Instant::now();
    for range in event_ranges(answer.tokens, srv.service.tokens_per_event()) {
        if range.start > 0 {
            if srv.service.decodes() {
                // Paced from the first token so sleep overshoot never adds up.
                let due = first_token + srv.service.decode(range.end - 1);
                pause(due.saturating_duration_since(Instant::now()));
            } else {
                pause(Duration::from_millis(srv.cfg.stream_interval_ms));
            }
        }
        let event = format!("data: {}\n\n", answer.chunk(range));
        body.send(event.as_bytes())?;
    }
    body.send(b"data: [DONE]\n\n")?;
    body.finish()
}

fn pause(duration: Duration) {
    if !duration.is_zero() {
        thread::sleep(duration);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{read_body, read_head};
    use std::io::Cursor;

    fn server(mode: Mode) -> Server {
        server_with(mode, |_| {})
    }

    /// A server for `mode` with `set` applied to the default config.
    fn server_with(mode: Mode, set: impl FnOnce(&mut Config)) -> Server {
        let mut cfg = Config::new(mode);
        cfg.stream_interval_ms = 0;
        set(&mut cfg);
        Server::new(cfg)
    }

    fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
        head.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
    }

    fn header_u64(head: &str, name: &str) -> u64 {
        header(head, name)
            .unwrap_or_else(|| panic!("no {name} in {head}"))
            .parse()
            .expect("numeric header")
    }

    /// The JSON of every `data: {...}` event of a streamed body.
    fn events(body: &str) -> Vec<Value> {
        body.split("data: ")
            .filter(|e| e.starts_with('{'))
            .map(|e| json_of(e.split("\n\n").next().expect("event")))
            .collect()
    }

    /// A chat body whose canonical prompt is `user\n{text}\n`.
    fn chat_body(text: &str) -> String {
        json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string()
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

    /// Runs `respond` on `srv` and splits the output into (head, body).
    fn run_on(srv: &Server, req: &Request) -> (String, String) {
        let mut out = Vec::new();
        respond(&mut out, srv, req).expect("respond");
        let text = String::from_utf8(out).expect("utf8");
        let (head, body) = text.split_once("\r\n\r\n").expect("header end");
        (head.to_string(), body.to_string())
    }

    /// Runs `respond` on a fresh `--rank 3` server.
    fn run(req: &Request) -> (String, String) {
        run_on(&server(Mode::Rank(3)), req)
    }

    fn json_of(body: &str) -> Value {
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }

    /// A chat request carrying `x-data-parallel-rank: value` when given.
    fn chat_with_rank(value: Option<&str>) -> Request {
        let header = value.map_or(String::new(), |v| format!("X-Data-Parallel-Rank: {v}\r\n"));
        request(&format!(
            "POST /v1/chat/completions HTTP/1.1\r\n{header}Content-Length: 2\r\n\r\n{{}}"
        ))
    }

    fn header_rank(head: &str) -> Option<u32> {
        head.lines()
            .find_map(|l| l.strip_prefix("x-dp-rank: "))
            .map(|v| v.parse().expect("numeric x-dp-rank"))
    }

    #[test]
    fn a_requested_failure_is_answered_with_its_status_and_rank() {
        let req = request(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-mock-fail: 500\r\nContent-Length: 2\r\n\r\n{}",
        );
        let (head, body) = run(&req);
        assert!(head.starts_with("HTTP/1.1 500"), "{head}");
        assert!(head.contains("x-dp-rank: 3"), "{head}");
        assert!(body.contains("mock_failure"), "{body}");
        // Out of range: served as usual.
        let req = request(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-mock-fail: 200\r\nContent-Length: 2\r\n\r\n{}",
        );
        assert!(run(&req).0.starts_with("HTTP/1.1 200"));
    }

    #[test]
    fn a_requested_close_writes_nothing_and_ends_the_connection() {
        let req = request(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-mock-fail: close\r\nContent-Length: 2\r\n\r\n{}",
        );
        let srv = server(Mode::Rank(3));
        let mut out = Vec::new();
        let reuse = respond(&mut out, &srv, &req).expect("respond");
        assert!(!reuse, "the connection must close");
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    }

    #[test]
    fn routes() {
        assert_eq!(route("GET", "/health"), Route::Health);
        assert_eq!(route("HEAD", "/v1/models"), Route::Models);
        assert_eq!(route("GET", "/server_info"), Route::ServerInfo);
        assert_eq!(route("GET", "/get_server_info"), Route::ServerInfo);
        assert_eq!(route("GET", "/model_info"), Route::ModelInfo);
        assert_eq!(route("HEAD", "/get_model_info"), Route::ModelInfo);
        assert_eq!(route("POST", "/server_info"), Route::MethodNotAllowed);
        assert_eq!(route("POST", "/get_model_info"), Route::MethodNotAllowed);
        assert_eq!(route("POST", "/generate"), Route::Llm(Api::Generate));
        assert_eq!(route("POST", "/v1/responses"), Route::Llm(Api::Responses));
        assert_eq!(route("GET", "/v1/responses"), Route::MethodNotAllowed);
        assert_eq!(route("POST", "/v1/messages"), Route::Llm(Api::Messages));
        assert_eq!(route("GET", "/generate"), Route::MethodNotAllowed);
        assert_eq!(route("POST", "/nope"), Route::NotFound);
        assert_eq!(route("GET", "/mock/stats"), Route::Stats);
        assert_eq!(route("POST", "/mock/reset-stats"), Route::ResetStats);
        assert_eq!(route("GET", "/mock/reset-stats"), Route::MethodNotAllowed);
        assert_eq!(route("POST", "/mock/stats"), Route::MethodNotAllowed);
    }

    #[test]
    fn token_count() {
        let count = |s: &str| {
            let body = serde_json::from_str(s).unwrap_or(Value::Null);
            requested_tokens(&body, MAX_TOKENS)
        };
        assert_eq!(count("not json"), 5);
        assert_eq!(count(r#"{"max_tokens": 3}"#), 3);
        assert_eq!(count(r#"{"max_tokens": 0}"#), 1);
        assert_eq!(count(r#"{"max_tokens": 4096}"#), 50);
        assert_eq!(count(r#"{"max_tokens": "7"}"#), 5);
        assert_eq!(count(r#"{"sampling_params": {"max_new_tokens": 2}}"#), 2);
        let body = json!({"max_completion_tokens": 5000});
        assert_eq!(requested_tokens(&body, MAX_MODELED_TOKENS), 4096);
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
        assert_eq!(v["mock"]["engine"], false);
        assert!(v["mock"].get("dp_size").is_none());
        assert_eq!(v["mock"]["inflight"], 1);
        assert_eq!(v["mock"]["max_inflight"], 1);
    }

    #[test]
    fn inflight_reported_and_released() {
        let srv = server(Mode::Rank(3));
        // Two requests already running on this rank.
        let _a = srv.rank_state(3).stats.enter();
        let b = srv.rank_state(3).stats.enter();
        let (_, body) = run_on(&srv, &post("/generate", "{}"));
        let v = json_of(&body);
        assert_eq!(v["mock"]["inflight"], 3);
        assert_eq!(v["mock"]["max_inflight"], 3);
        drop(b);
        let (_, body) = run_on(&srv, &post("/generate", "{}"));
        let v = json_of(&body);
        assert_eq!(v["mock"]["inflight"], 2);
        assert_eq!(v["mock"]["max_inflight"], 3);
        let s = srv.rank_state(3).stats.snapshot();
        assert_eq!((s.requests, s.inflight, s.max_inflight), (4, 1, 3));
    }

    #[test]
    fn inflight_released_when_writing_fails() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
        }
        // One slot per rank: a leaked slot would hang the last request.
        let srv = server_with(Mode::Engine { dp_size: 2 }, |c| c.max_concurrency = 1);
        for body in ["{}", r#"{"stream":true}"#] {
            let req = post("/v1/completions", body);
            assert!(respond(&mut Broken, &srv, &req).is_err());
        }
        let snaps: Vec<_> = srv.ranks().map(|(_, s)| s.stats.snapshot()).collect();
        assert!(snaps.iter().all(|s| s.requests == 1 && s.inflight == 0));
        for _ in 0..2 {
            let (head, _) = run_on(&srv, &post("/v1/completions", "{}"));
            assert_eq!(header_u64(&head, "x-mock-queue-us"), 0, "{head}");
        }
    }

    #[test]
    fn engine_dispatch_by_header_and_round_robin() {
        let srv = server(Mode::Engine { dp_size: 4 });
        let mut seen = Vec::new();
        for value in [None, Some("2"), None, Some("02"), None, None, None] {
            let (head, body) = run_on(&srv, &chat_with_rank(value));
            assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
            let v = json_of(&body);
            let rank = header_rank(&head).expect("x-dp-rank");
            assert_eq!(v["mock"]["rank"], rank);
            assert_eq!(v["mock"]["engine"], true);
            assert_eq!(v["mock"]["dp_size"], 4);
            assert!(v["choices"][0]["message"]["content"]
                .as_str()
                .expect("content")
                .starts_with(&format!("Hello from DP rank {rank}:")));
            seen.push(rank);
        }
        // Requests naming a rank do not advance the round robin.
        assert_eq!(seen, [0, 2, 1, 2, 2, 3, 0]);
        let stats = json_of(&run_on(&srv, &request("GET /mock/stats HTTP/1.1\r\n\r\n")).1);
        assert_eq!(stats["rank"], Value::Null);
        assert_eq!(stats["engine"], true);
        let requests: Vec<u64> = (0..4)
            .map(|r| {
                assert_eq!(stats["per_rank"][r]["rank"], r);
                assert_eq!(stats["per_rank"][r]["inflight"], 0);
                stats["per_rank"][r]["requests"].as_u64().expect("requests")
            })
            .collect();
        assert_eq!(requests, [2, 1, 3, 1]);
    }

    #[test]
    fn engine_rejects_invalid_rank_header() {
        let srv = server(Mode::Engine { dp_size: 4 });
        for bad in ["4", "-1", "abc", "1.5", "", "+1"] {
            let (head, body) = run_on(&srv, &chat_with_rank(Some(bad)));
            assert!(
                head.starts_with("HTTP/1.1 400 Bad Request"),
                "{bad:?}: {head}"
            );
            assert!(head.contains("content-type: application/json"));
            assert!(head.contains("connection: keep-alive"));
            assert_eq!(header_rank(&head), None, "not dispatched: {head}");
            let v = json_of(&body);
            assert_eq!(v["error"]["type"], "invalid_request_error");
            let msg = v["error"]["message"].as_str().expect("message");
            assert!(msg.starts_with("invalid x-data-parallel-rank "), "{msg}");
            assert_eq!(v["mock"]["rank"], Value::Null);
        }
        let repeated = request(
            "POST /generate HTTP/1.1\r\nx-data-parallel-rank: 1\r\nx-data-parallel-rank: 1\r\n\r\n",
        );
        assert!(run_on(&srv, &repeated).0.starts_with("HTTP/1.1 400"));
        assert!(srv.ranks().all(|(_, s)| s.stats.snapshot().requests == 0));
        // Outside the LLM endpoints the header is not looked at.
        let (head, _) = run_on(
            &srv,
            &request("GET /health HTTP/1.1\r\nx-data-parallel-rank: x\r\n\r\n"),
        );
        assert!(head.starts_with("HTTP/1.1 200"));
        assert_eq!(header_rank(&head), None);
    }

    #[test]
    fn rank_mode_ignores_rank_header() {
        let (head, body) = run(&chat_with_rank(Some("abc")));
        assert!(head.starts_with("HTTP/1.1 200"));
        assert_eq!(header_rank(&head), Some(3));
        assert_eq!(json_of(&body)["mock"]["rank"], 3);
    }

    #[test]
    fn stats_and_reset() {
        let srv = server(Mode::Rank(7));
        for _ in 0..3 {
            run_on(&srv, &post("/v1/completions", "{}"));
        }
        run_on(&srv, &request("GET /health HTTP/1.1\r\n\r\n"));
        let (head, body) = run_on(&srv, &request("GET /mock/stats HTTP/1.1\r\n\r\n"));
        assert!(head.starts_with("HTTP/1.1 200"));
        assert_eq!(header_rank(&head), Some(7));
        assert_eq!(
            json_of(&body),
            json!({"rank": 7, "engine": false, "dp_size": 1, "per_rank": [
                {"rank": 7, "requests": 3, "inflight": 0, "max_inflight": 1,
                 "prompt_tokens": 0, "cached_tokens": 0, "cache_blocks": 0,
                 "cache_capacity": 0, "cache_evictions": 0, "max_queue_us": 0},
            ]})
        );
        let (head, body) = run_on(&srv, &request("POST /mock/reset-stats HTTP/1.1\r\n\r\n"));
        assert!(head.starts_with("HTTP/1.1 200"));
        assert_eq!(json_of(&body)["per_rank"][0]["requests"], 0);
        let (_, body) = run_on(&srv, &request("GET /mock/stats HTTP/1.1\r\n\r\n"));
        assert_eq!(
            json_of(&body)["per_rank"][0],
            json!({"rank": 7, "requests": 0, "inflight": 0, "max_inflight": 0,
                   "prompt_tokens": 0, "cached_tokens": 0, "cache_blocks": 0,
                   "cache_capacity": 0, "cache_evictions": 0, "max_queue_us": 0})
        );
    }

    #[test]
    fn repeated_prompt_hits_the_cache() {
        let srv = server_with(Mode::Rank(0), |c| c.block_tokens = 2);
        // "user\n" + 29 bytes + "\n" = 35 bytes: 9 tokens, four full blocks of 8 bytes.
        let body = chat_body("the quick brown fox jumps ove");
        let (head, first) = run_on(&srv, &post("/v1/chat/completions", &body));
        assert_eq!(header_u64(&head, "x-mock-prompt-tokens"), 9);
        assert_eq!(header_u64(&head, "x-mock-cached-tokens"), 0);
        assert_eq!(header_u64(&head, "x-mock-queue-us"), 0);
        assert!(head.contains("x-dp-rank: 0"));
        let first = json_of(&first);
        assert_eq!(first["usage"]["prompt_tokens"], 9);
        assert_eq!(first["usage"]["completion_tokens"], 5);
        assert_eq!(first["usage"]["total_tokens"], 14);
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(first["mock"]["prompt_tokens"], 9);
        assert_eq!(first["mock"]["cached_tokens"], 0);
        let (head, second) = run_on(&srv, &post("/v1/chat/completions", &body));
        assert_eq!(header_u64(&head, "x-mock-cached-tokens"), 8);
        let second = json_of(&second);
        assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert_eq!(second["mock"]["cached_tokens"], 8);
        let stats = srv.stats_json()["per_rank"][0].clone();
        assert_eq!(stats["prompt_tokens"], 18);
        assert_eq!(stats["cached_tokens"], 8);
        assert_eq!(stats["cache_blocks"], 4);
        // The reset empties the cache too (and /mock/reset is the same).
        run_on(&srv, &request("POST /mock/reset HTTP/1.1\r\n\r\n"));
        assert_eq!(srv.stats_json()["per_rank"][0]["cache_blocks"], 0);
        let (head, _) = run_on(&srv, &post("/v1/chat/completions", &body));
        assert_eq!(header_u64(&head, "x-mock-cached-tokens"), 0);
    }

    #[test]
    fn generate_reports_meta_info_tokens() {
        let srv = server_with(Mode::Rank(0), |c| c.block_tokens = 1);
        let body = r#"{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":2}}"#;
        run_on(&srv, &post("/generate", body));
        let (head, answer) = run_on(&srv, &post("/generate", body));
        assert_eq!(header_u64(&head, "x-mock-cached-tokens"), 3);
        let v = json_of(&answer);
        assert_eq!(v["meta_info"]["prompt_tokens"], 3);
        assert_eq!(v["meta_info"]["cached_tokens"], 3);
        assert_eq!(v["meta_info"]["completion_tokens"], 2);
    }

    #[test]
    fn capacity_evicts_and_shows_in_stats() {
        let srv = server_with(Mode::Rank(0), |c| {
            c.block_tokens = 1;
            c.cache_blocks = 2;
        });
        run_on(
            &srv,
            &post("/v1/completions", r#"{"prompt":"aaaabbbbcccc"}"#),
        );
        run_on(&srv, &post("/v1/completions", r#"{"prompt":"xxxx"}"#));
        let stats = srv.stats_json()["per_rank"][0].clone();
        assert_eq!(stats["cache_blocks"], 2);
        assert_eq!(stats["cache_capacity"], 2);
        assert_eq!(stats["cache_evictions"], 1);
        let (head, _) = run_on(
            &srv,
            &post("/v1/completions", r#"{"prompt":"aaaabbbbcccc"}"#),
        );
        assert_eq!(
            header_u64(&head, "x-mock-cached-tokens"),
            1,
            "the leaf bbbb was evicted, its prefix aaaa kept; cccc never fitted"
        );
    }

    #[test]
    fn engine_ranks_have_their_own_caches() {
        let srv = server(Mode::Engine { dp_size: 2 });
        let body = json!({"prompt": "p".repeat(128)}).to_string();
        let on = |rank: &str| {
            let req = request(&format!(
                "POST /v1/completions HTTP/1.1\r\nx-data-parallel-rank: {rank}\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ));
            header_u64(&run_on(&srv, &req).0, "x-mock-cached-tokens")
        };
        assert_eq!(on("0"), 0);
        assert_eq!(on("1"), 0, "rank 1 has not seen it");
        assert_eq!(on("0"), 32);
        assert_eq!(on("1"), 32);
        let stats = srv.stats_json();
        assert_eq!(stats["per_rank"][0]["cached_tokens"], 32);
        assert_eq!(stats["per_rank"][1]["cache_blocks"], 2);
    }

    #[test]
    fn malformed_body_has_an_empty_prompt() {
        let (head, body) = run(&post("/v1/chat/completions", "{not json"));
        assert!(head.starts_with("HTTP/1.1 200 OK"));
        assert_eq!(header_u64(&head, "x-mock-prompt-tokens"), 0);
        let v = json_of(&body);
        assert_eq!(v["usage"]["prompt_tokens"], 0);
        assert_eq!(v["usage"]["total_tokens"], 5);
    }

    #[test]
    fn prefill_time_only_for_uncached_tokens() {
        // 1 ms per uncached token; the prompt is exactly 48 tokens = 3 blocks.
        let srv = server_with(Mode::Rank(0), |c| c.prefill_us_per_token = 1_000.0);
        let body = json!({"prompt": "x".repeat(192)}).to_string();
        let timed = || {
            let started = Instant::now();
            let (head, _) = run_on(&srv, &post("/v1/completions", &body));
            (started.elapsed(), header_u64(&head, "x-mock-cached-tokens"))
        };
        let (cold, cached) = timed();
        assert_eq!(cached, 0);
        assert!(cold >= Duration::from_millis(48), "{cold:?}");
        let (warm, cached) = timed();
        assert_eq!(cached, 48);
        assert!(
            warm < cold,
            "cached prompt is not prefilled: {warm:?} vs {cold:?}"
        );
    }

    #[test]
    fn decode_time_and_token_count() {
        let srv = server_with(Mode::Rank(0), |c| c.decode_us_per_token = 100.0);
        let started = Instant::now();
        let (_, body) = run_on(&srv, &post("/v1/completions", r#"{"max_tokens":300}"#));
        assert!(started.elapsed() >= Duration::from_millis(30));
        let v = json_of(&body);
        assert_eq!(v["usage"]["completion_tokens"], 300, "above the 50 cap");
    }

    #[test]
    fn decode_model_groups_stream_events() {
        // 1 ms per token: 5 tokens per event after the first.
        let srv = server_with(Mode::Rank(0), |c| c.decode_us_per_token = 1_000.0);
        let started = Instant::now();
        let (head, body) = run_on(
            &srv,
            &post("/v1/chat/completions", r#"{"stream":true,"max_tokens":12}"#),
        );
        assert!(started.elapsed() >= Duration::from_millis(11));
        assert!(header(&head, "x-mock-queue-us").is_some());
        let events = events(&body);
        let pieces: Vec<usize> = events
            .iter()
            .map(|e| {
                let text = e["choices"][0]["delta"]["content"]
                    .as_str()
                    .expect("content");
                text.matches("token").count()
            })
            .collect();
        assert_eq!(pieces, [1, 5, 5, 1]);
        assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(body.ends_with("data: [DONE]\n\n\r\n0\r\n\r\n"));
    }

    #[test]
    fn last_stream_event_carries_usage() {
        let srv = server(Mode::Rank(0));
        let body = json!({"stream": true, "max_tokens": 3, "prompt": "abcdefgh"}).to_string();
        let (head, answer) = run_on(&srv, &post("/v1/completions", &body));
        assert_eq!(header_u64(&head, "x-mock-prompt-tokens"), 2);
        let events = events(&answer);
        assert_eq!(events.len(), 3, "no extra event");
        assert!(events[..2].iter().all(|e| e.get("usage").is_none()));
        assert_eq!(events[2]["usage"]["prompt_tokens"], 2);
        assert_eq!(events[2]["usage"]["completion_tokens"], 3);
        assert_eq!(
            events[2]["usage"]["prompt_tokens_details"]["cached_tokens"],
            0
        );
        assert_eq!(events[2]["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn max_concurrency_queues_requests() {
        let srv = server_with(Mode::Rank(0), |c| {
            c.max_concurrency = 1;
            c.decode_us_per_token = 1_000.0;
        });
        let queued: Vec<u64> = thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        let (head, _) =
                            run_on(&srv, &post("/v1/completions", r#"{"max_tokens":30}"#));
                        header_u64(&head, "x-mock-queue-us")
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        // One of them waited for the other's ~30 ms.
        let waited = queued.iter().max().copied().unwrap_or(0);
        assert!(waited >= 20_000, "{queued:?}");
        let stats = srv.stats_json()["per_rank"][0].clone();
        assert_eq!(stats["max_queue_us"], waited);
        assert_eq!(stats["max_inflight"], 2, "queued requests count in flight");
    }

    #[test]
    fn engine_reset_restarts_round_robin() {
        let srv = server(Mode::Engine { dp_size: 3 });
        run_on(&srv, &chat_with_rank(None));
        run_on(&srv, &request("POST /mock/reset-stats HTTP/1.1\r\n\r\n"));
        let (head, _) = run_on(&srv, &chat_with_rank(None));
        assert_eq!(header_rank(&head), Some(0));
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
        for event in body.split("data: ").filter(|e| e.starts_with('{')) {
            let json_text = event.split("\n\n").next().expect("event");
            let v = json_of(json_text);
            assert_eq!(v["rank"], 3);
            assert_eq!(v["mock"]["rank"], 3);
            assert_eq!(v["mock"]["inflight"], 1);
            assert_eq!(v["mock"]["max_inflight"], 1);
        }
    }

    #[test]
    fn engine_stream_reports_internal_rank() {
        let srv = server(Mode::Engine { dp_size: 4 });
        let req = request(
            "POST /generate HTTP/1.1\r\nx-data-parallel-rank: 1\r\nContent-Length: 30\r\n\r\n{\"stream\":true,\"max_tokens\":2}",
        );
        let (head, body) = run_on(&srv, &req);
        assert_eq!(header_rank(&head), Some(1));
        assert!(head.contains("transfer-encoding: chunked"));
        assert_eq!(
            body.matches("\"rank\":1").count(),
            4,
            "top-level and mock.rank in both events: {body}"
        );
        assert_eq!(body.matches("\"engine\":true").count(), 2);
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

    /// The JSON answer of `GET path` on `srv`, which must be a 200.
    fn get_json(srv: &Server, path: &str) -> Value {
        let (head, body) = run_on(srv, &request(&format!("GET {path} HTTP/1.1\r\n\r\n")));
        assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        json_of(&body)
    }

    #[test]
    fn server_info_reports_the_engine_settings_under_both_names() {
        let srv = server_with(Mode::Rank(2), |cfg| {
            cfg.model_path = Some("/models/tiny".into());
            cfg.block_tokens = 8;
            cfg.cache_blocks = 100;
            cfg.max_concurrency = 4;
        });
        for path in ["/server_info", "/get_server_info"] {
            let v = get_json(&srv, path);
            assert_eq!(v["model_path"], "/models/tiny", "{path}");
            assert_eq!(v["tokenizer_path"], "/models/tiny");
            assert_eq!(v["served_model_name"], DEFAULT_MODEL);
            assert_eq!(v["dp_size"], 1);
            assert_eq!(v["page_size"], 8);
            assert_eq!(v["max_running_requests"], 4);
            assert_eq!(v["max_total_tokens"], 800);
            assert!(v["version"]
                .as_str()
                .expect("version")
                .starts_with("mock-rank "));
            assert_eq!(v["mock"]["rank"], 2);
        }
        // Unlimited cache and concurrency, no model path, an engine's dp_size.
        let v = get_json(&server(Mode::Engine { dp_size: 4 }), "/server_info");
        assert_eq!(v["dp_size"], 4);
        assert_eq!(v["model_path"], Value::Null);
        assert_eq!(v["max_running_requests"], Value::Null);
        assert_eq!(v["max_total_tokens"], Value::Null);
    }

    #[test]
    fn model_info_names_a_generation_model_under_both_names() {
        let srv = server_with(Mode::Rank(0), |cfg| cfg.model_path = Some("/m".into()));
        for path in ["/model_info", "/get_model_info"] {
            let v = get_json(&srv, path);
            assert_eq!(v["model_path"], "/m", "{path}");
            assert_eq!(v["tokenizer_path"], "/m");
            assert_eq!(v["is_generation"], true);
            assert_eq!(v["model_type"], MODEL_TYPE);
            assert_eq!(v["architectures"], json!([ARCHITECTURE]));
        }
        assert_eq!(
            get_json(&server(Mode::Rank(0)), "/model_info")["model_path"],
            Value::Null
        );
    }

    #[test]
    fn models_list_the_served_model_and_its_path() {
        let srv = server_with(Mode::Rank(0), |cfg| cfg.model_path = Some("/m".into()));
        let v = get_json(&srv, "/v1/models");
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["id"], DEFAULT_MODEL);
        assert_eq!(v["data"][0]["root"], "/m");
        assert_eq!(
            get_json(&server(Mode::Rank(0)), "/v1/models")["data"][0]["root"],
            Value::Null
        );
    }

    #[test]
    fn info_endpoints_touch_no_rank_state() {
        let srv = server(Mode::Rank(1));
        for path in ["/health", "/server_info", "/model_info", "/v1/models"] {
            run_on(&srv, &request(&format!("GET {path} HTTP/1.1\r\n\r\n")));
        }
        assert!(srv.ranks().all(|(_, s)| s.stats.snapshot().requests == 0));
    }
}
