//! `run`: open-loop replay. Each request leaves at its trace time (divided by
//! `--speed`) whether or not earlier ones have finished, because a closed loop
//! hides overload: a slow rank would slow the client down instead of building
//! a queue. Within a session (requests with one key), by default, a turn waits
//! for the previous turn's answer as a real client does (`--turns in-order`):
//! a compressed trace would otherwise send a turn before the answer it
//! continues exists. Sends run on a growing pool of worker threads, each
//! keeping one keep-alive connection per target; `--max-inflight` caps
//! concurrency only as a safety valve, and every send it delayed is counted.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Condvar, Mutex, PoisonError};
use std::thread::{self, Scope};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::{self, Conn, Response, Target};
use crate::jsonl;
use crate::rng::{derive, fnv1a64, Rng};
use crate::stats;
use crate::trace::{self, BodyOptions, Request};
use crate::usage;

/// Stack of a worker thread: it only parses HTTP and JSON answers.
const WORKER_STACK_BYTES: usize = 512 * 1024;
/// Stream tag of the per-request target choice.
const TARGET_STREAM: u64 = 0x7a59;
/// Longest excerpt of an error answer kept in a record.
const MAX_ERROR_CHARS: usize = 200;

/// Where the routing key goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyMode {
    /// In the `--key-header` request header.
    Header,
    /// As `"prompt_cache_key"` in the JSON body.
    Body,
    /// Not sent.
    None,
}

/// How a request picks one of several targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpreadMode {
    /// Seeded random choice per request.
    Random,
    /// Hash of the key (random for requests without one).
    Session,
}

/// When a session's next turn may leave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnOrder {
    /// At its trace time, after the previous turn's answer has ended.
    InOrder,
    /// At its trace time, whatever the previous turn's state.
    Open,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub trace: String,
    pub targets: Vec<Target>,
    pub key_mode: KeyMode,
    /// Lower-cased header name for `KeyMode::Header`.
    pub key_header: String,
    pub speed: f64,
    pub stream: bool,
    pub timeout: Duration,
    pub max_inflight: usize,
    pub spread: SpreadMode,
    pub turns: TurnOrder,
    pub seed: u64,
    pub out: Option<String>,
    pub summary: Option<String>,
    pub block_tokens: u32,
    pub blocks_as_chat: bool,
    pub model: String,
    pub limit: Option<usize>,
    pub dp_size: Option<u32>,
}

impl Config {
    fn body_options(&self) -> BodyOptions {
        BodyOptions {
            model: self.model.clone(),
            block_tokens: self.block_tokens,
            stream: self.stream,
            key_in_body: self.key_mode == KeyMode::Body,
            blocks_as_chat: self.blocks_as_chat,
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    /// Position in the (time-sorted) trace.
    pub index: usize,
    /// Line in the trace file.
    pub line: usize,
    pub key: Option<String>,
    /// The conversation whose turns go in order (`--turns in-order`): the trace's `session`,
    /// else its key. Not written out (the key is).
    pub session: Option<String>,
    /// Index of the `--target` used.
    pub target: usize,
    /// When it was due, ms after the replay started.
    pub scheduled_ms: f64,
    /// How late the send started, µs.
    pub lateness_us: u64,
    /// Whether `--max-inflight` held this send back.
    pub inflight_delayed: bool,
    /// How long the turn waited past its trace time for its session's previous
    /// answer to end (`--turns in-order`), µs.
    pub turn_wait_us: u64,
    pub status: Option<u16>,
    /// From the `x-dp-rank` answer header.
    pub rank: Option<u32>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Mock-reported queueing (`x-mock-queue-us`), when present.
    pub queue_us: Option<u64>,
    /// Send start (connect included when a new connection was needed) to
    /// the first response byte.
    pub ttfb_us: Option<u64>,
    /// Send start to the last response byte.
    pub total_us: Option<u64>,
    pub error: Option<String>,
}

impl Record {
    /// Answered with a 2xx status and no error.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// The JSONL line of `--out`.
    pub fn to_line(&self) -> String {
        jsonl::object(&[
            ("index", json!(self.index)),
            ("line", json!(self.line)),
            ("key", json!(self.key)),
            ("target", json!(self.target)),
            ("scheduled_ms", json!(self.scheduled_ms)),
            ("lateness_us", json!(self.lateness_us)),
            ("inflight_delayed", json!(self.inflight_delayed)),
            ("turn_wait_us", json!(self.turn_wait_us)),
            ("status", json!(self.status)),
            ("rank", json!(self.rank)),
            ("prompt_tokens", json!(self.prompt_tokens)),
            ("cached_tokens", json!(self.cached_tokens)),
            ("queue_us", json!(self.queue_us)),
            ("ttfb_us", json!(self.ttfb_us)),
            ("total_us", json!(self.total_us)),
            ("error", json!(self.error)),
        ])
    }
}

/// One request ready to go.
struct Job {
    record: Record,
    due: Instant,
    /// Complete request bytes, or why none could be built.
    request: Result<Vec<u8>, String>,
}

/// Counts requests in flight and makes the dispatcher wait at the cap.
struct Gate {
    inflight: Mutex<usize>,
    freed: Condvar,
}

impl Gate {
    /// Takes a slot; returns whether it had to wait for one.
    fn acquire(&self, max: usize) -> bool {
        let mut n = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
        let delayed = *n >= max;
        while *n >= max {
            n = self.freed.wait(n).unwrap_or_else(PoisonError::into_inner);
        }
        *n += 1;
        delayed
    }

    fn release(&self) {
        let mut n = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.saturating_sub(1);
        self.freed.notify_one();
    }
}

/// What the workers share.
struct Shared<'a> {
    targets: &'a [Target],
    timeout: Duration,
    jobs: Mutex<Receiver<Job>>,
    /// Workers waiting for a job and not yet promised one.
    idle: AtomicUsize,
    gate: Gate,
    turns: TurnOrder,
    /// Sessions with a turn in flight, each with the turns that wait for it
    /// (`--turns in-order`; always empty with `--turns open`).
    sessions: Mutex<HashMap<String, VecDeque<Job>>>,
}

impl Shared<'_> {
    /// Whether `job` may leave now; otherwise it waits for its session's turn
    /// in flight, and goes when that turn ends ([`Shared::next_turn`]).
    fn turn_may_leave(&self, job: Job) -> Option<Job> {
        if self.turns == TurnOrder::Open {
            return Some(job);
        }
        let Some(key) = job.record.session.clone() else {
            return Some(job);
        };
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        match sessions.get_mut(&key) {
            Some(waiting) => {
                waiting.push_back(job);
                None
            }
            None => {
                sessions.insert(key, VecDeque::new());
                Some(job)
            }
        }
    }

    /// The session's next turn once its turn in flight (of `key`) has ended,
    /// due no earlier than now; `None` when none waits (the session is idle).
    fn next_turn(&self, key: Option<&str>) -> Option<Job> {
        let key = key.filter(|_| self.turns == TurnOrder::InOrder)?;
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        let waiting = sessions.get_mut(key)?;
        let Some(mut job) = waiting.pop_front() else {
            sessions.remove(key);
            return None;
        };
        let now = Instant::now();
        if job.due < now {
            job.record.turn_wait_us = micros(now - job.due);
            job.due = now;
        }
        Some(job)
    }
}

/// Replays `requests` (time-sorted) and returns one record per request in
/// trace order, and the wall time in seconds.
pub fn execute(cfg: &Config, requests: &[Request]) -> (Vec<Record>, f64) {
    let (job_tx, job_rx) = mpsc::channel::<Job>();
    let (rec_tx, rec_rx) = mpsc::channel::<Record>();
    let shared = Shared {
        targets: &cfg.targets,
        timeout: cfg.timeout,
        jobs: Mutex::new(job_rx),
        idle: AtomicUsize::new(0),
        gate: Gate {
            inflight: Mutex::new(0),
            freed: Condvar::new(),
        },
        turns: cfg.turns,
        sessions: Mutex::new(HashMap::new()),
    };
    let opts = cfg.body_options();
    let mut target_rng = Rng::new(derive(cfg.seed, &[TARGET_STREAM]));
    let t0 = requests.first().map_or(0.0, |r| r.t_ms);
    let start = Instant::now();
    thread::scope(|scope| {
        for (index, req) in requests.iter().enumerate() {
            let scheduled_ms = (req.t_ms - t0) / cfg.speed;
            let random_target = target_rng.below(cfg.targets.len() as u64) as usize;
            let target = match (cfg.spread, &req.key) {
                (SpreadMode::Session, Some(key)) => {
                    (fnv1a64(key.as_bytes()) % cfg.targets.len() as u64) as usize
                }
                _ => random_target,
            };
            let job = Job {
                record: Record {
                    index,
                    line: req.line,
                    key: req.key.clone(),
                    session: req.session.clone().or_else(|| req.key.clone()),
                    target,
                    scheduled_ms,
                    ..Record::default()
                },
                due: start + offset(scheduled_ms),
                request: build_request(cfg, &opts, &cfg.targets[target], req),
            };
            let now = Instant::now();
            if job.due > now {
                thread::sleep(job.due - now);
            }
            let Some(mut job) = shared.turn_may_leave(job) else {
                continue;
            };
            // Only a send that is due and finds the cap reached is delayed.
            job.record.inflight_delayed = shared.gate.acquire(cfg.max_inflight);
            dispatch(scope, &shared, &job_tx, &rec_tx, job);
        }
        // Workers leave once the queue is closed and drained.
        drop(job_tx);
    });
    let wall_s = start.elapsed().as_secs_f64();
    drop(rec_tx);
    let mut records: Vec<Record> = rec_rx.into_iter().collect();
    records.sort_by_key(|r| r.index);
    (records, wall_s)
}

/// Hands `job` to an idle worker, or starts a new one.
fn dispatch<'scope, 'env>(
    scope: &'scope Scope<'scope, 'env>,
    shared: &'scope Shared<'env>,
    jobs: &Sender<Job>,
    records: &Sender<Record>,
    job: Job,
) {
    let claimed = shared
        .idle
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if claimed {
        // A worker is waiting for exactly this job; the receiver outlives
        // the dispatcher, so sending cannot fail while workers wait.
        if let Err(mpsc::SendError(job)) = jobs.send(job) {
            fail(shared, records, job.record, "internal: job queue closed");
        }
        return;
    }
    let fallback = job.record.clone();
    let records_for_worker = records.clone();
    let spawned = thread::Builder::new()
        .name("dp-replay-worker".into())
        .stack_size(WORKER_STACK_BYTES)
        .spawn_scoped(scope, move || worker(shared, &records_for_worker, job));
    if let Err(err) = spawned {
        fail(
            shared,
            records,
            fallback,
            &format!("cannot start a thread: {err}"),
        );
    }
}

fn fail(shared: &Shared, records: &Sender<Record>, mut record: Record, msg: &str) {
    let key = record.session.clone();
    record.error = Some(msg.to_string());
    let _ = records.send(record);
    // The turns waiting for this one fail with it rather than wait for ever.
    while let Some(next) = shared.next_turn(key.as_deref()) {
        let mut next = next.record;
        next.error = Some(format!("{msg} (an earlier turn of its session)"));
        let _ = records.send(next);
    }
    shared.gate.release();
}

/// Runs jobs until the queue closes, keeping one connection per target.
fn worker(shared: &Shared, records: &Sender<Record>, first: Job) {
    let mut conns: HashMap<usize, Conn> = HashMap::new();
    let mut job = first;
    loop {
        let record = perform(shared, &mut conns, job);
        let key = record.session.clone();
        let _ = records.send(record);
        // The session's next turn, if it was waiting for this one, goes from
        // this worker and takes over its slot.
        if let Some(next) = shared.next_turn(key.as_deref()) {
            let now = Instant::now();
            if next.due > now {
                thread::sleep(next.due - now);
            }
            job = next;
            continue;
        }
        // Idle before releasing the slot: a dispatcher woken by the release
        // then finds this worker instead of starting another.
        shared.idle.fetch_add(1, Ordering::SeqCst);
        shared.gate.release();
        let next = shared
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .recv();
        match next {
            Ok(next) => job = next,
            Err(_) => return,
        }
    }
}

/// The request bytes for `req`, or why it cannot be sent.
fn build_request(
    cfg: &Config,
    opts: &BodyOptions,
    target: &Target,
    req: &Request,
) -> Result<Vec<u8>, String> {
    let (path, body) = req.body(opts);
    let body = serde_json::to_vec(&body).map_err(|e| format!("cannot encode body: {e}"))?;
    let mut headers = Vec::new();
    if let (KeyMode::Header, Some(key)) = (cfg.key_mode, &req.key) {
        if !http::valid_header_value(key) {
            return Err(format!("key {key:?} is not a valid header value"));
        }
        headers.push((cfg.key_header.as_str(), key.as_str()));
    }
    Ok(http::post(target, path, &headers, &body))
}

/// Sends one job and measures it.
fn perform(shared: &Shared, conns: &mut HashMap<usize, Conn>, job: Job) -> Record {
    let Job {
        mut record,
        due,
        request,
    } = job;
    let start = Instant::now();
    record.lateness_us = micros(start.saturating_duration_since(due));
    let request = match request {
        Ok(bytes) => bytes,
        Err(msg) => {
            record.error = Some(msg);
            return record;
        }
    };
    let deadline = start + shared.timeout;
    let target = &shared.targets[record.target];
    let mut reused = conns.remove(&record.target);
    let result = loop {
        let was_reused = reused.is_some();
        let mut conn = match reused.take() {
            Some(mut conn) => {
                conn.set_deadline(deadline);
                conn
            }
            None => match Conn::connect(target, deadline) {
                Ok(conn) => conn,
                Err(err) => break Err(format!("connect {}: {err}", target.authority)),
            },
        };
        let sent = match conn.send(&request) {
            Ok(()) => conn.wait_first_byte().map_err(|e| ("no answer", e)),
            Err(err) => Err(("send", err)),
        };
        match sent {
            Ok(()) => {}
            // The server may have closed an idle connection just as we
            // reused it: nothing was answered, so try once on a fresh one
            // (not after a timeout, which spent the whole deadline).
            Err((_, err)) if was_reused && err.kind() != io::ErrorKind::TimedOut => continue,
            Err((stage, err)) => break Err(format!("{stage}: {err}")),
        }
        let ttfb = start.elapsed();
        match conn.read_response() {
            Ok(response) => {
                if response.keep_alive {
                    conns.insert(record.target, conn);
                }
                break Ok((response, ttfb, start.elapsed()));
            }
            Err(err) => break Err(format!("read response: {err}")),
        }
    };
    match result {
        Ok((response, ttfb, total)) => {
            record.ttfb_us = Some(micros(ttfb));
            record.total_us = Some(micros(total));
            fill_from_response(&mut record, &response);
        }
        Err(msg) => record.error = Some(msg),
    }
    record
}

/// Status, rank, token counts and, for non-2xx answers, an error excerpt.
fn fill_from_response(record: &mut Record, response: &Response) {
    let header_u64 = |name: &str| response.header(name).and_then(|v| v.parse::<u64>().ok());
    record.status = Some(response.status);
    record.rank = response.header("x-dp-rank").and_then(|v| v.parse().ok());
    let usage = usage::from_body(&response.body);
    record.prompt_tokens = usage
        .prompt_tokens
        .or_else(|| header_u64("x-mock-prompt-tokens"));
    record.cached_tokens = usage
        .cached_tokens
        .or_else(|| header_u64("x-mock-cached-tokens"));
    record.queue_us = header_u64("x-mock-queue-us");
    if !(200..300).contains(&response.status) {
        record.error = Some(format!(
            "HTTP {}: {}",
            response.status,
            error_excerpt(&response.body)
        ));
    }
}

/// `error.message` of a JSON error answer, else the start of the body.
fn error_excerpt(body: &[u8]) -> String {
    let message = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
        v.pointer("/error/message")
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    let text = message.unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    text.chars().take(MAX_ERROR_CHARS).collect()
}

/// `ms` as a duration, saturating at a year: absurd trace times (or a tiny
/// `--speed`) wait very long instead of overflowing the clock.
fn offset(ms: f64) -> Duration {
    const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);
    Duration::try_from_secs_f64(ms / 1e3)
        .unwrap_or(MAX_WAIT)
        .min(MAX_WAIT)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The `run` subcommand: replay, write records and summary, print the table.
pub fn main(cfg: &Config) -> Result<(), String> {
    let mut requests = trace::read_file(&cfg.trace)?;
    if let Some(limit) = cfg.limit {
        requests.truncate(limit);
    }
    // Open outputs first: a typo in a path should not cost a whole run.
    let mut out = cfg.out.as_deref().map(create).transpose()?;
    let summary_file = cfg.summary.as_deref().map(create).transpose()?;
    let (records, wall_s) = execute(cfg, &requests);
    if let (Some(w), Some(path)) = (out.as_mut(), cfg.out.as_deref()) {
        let written: io::Result<()> = records
            .iter()
            .try_for_each(|r| {
                w.write_all(r.to_line().as_bytes())?;
                w.write_all(b"\n")
            })
            .and_then(|()| w.flush());
        written.map_err(|e| format!("--out {path}: {e}"))?;
    }
    let summary = stats::summarize(&records, wall_s, cfg.dp_size);
    eprint!("{}", summary.table());
    if let (Some(mut w), Some(path)) = (summary_file, cfg.summary.as_deref()) {
        serde_json::to_writer_pretty(&mut w, &summary.to_json())
            .map_err(io::Error::from)
            .and_then(|()| w.write_all(b"\n"))
            .and_then(|()| w.flush())
            .map_err(|e| format!("--summary {path}: {e}"))?;
    }
    Ok(())
}

fn create(path: &str) -> Result<BufWriter<File>, String> {
    File::create(path)
        .map(BufWriter::new)
        .map_err(|e| format!("cannot create {path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;

    /// Request heads and bodies a test server received.
    type Seen = Arc<Mutex<Vec<(String, String)>>>;

    /// A keep-alive HTTP/1.1 server on a free port answering every request
    /// as rank 2 with 100 prompt / 60 cached tokens: plain JSON with a
    /// Content-Length, or a chunked SSE stream when the body asks for one.
    fn server() -> (String, Seen) {
        slow_server(Duration::ZERO)
    }

    /// `server`, answering each request after `delay`.
    fn slow_server(delay: Duration) -> (String, Seen) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let seen: Seen = Arc::default();
        let log = Arc::clone(&seen);
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let log = Arc::clone(&log);
                thread::spawn(move || serve(conn, &log, delay));
            }
        });
        (url, seen)
    }

    fn serve(conn: TcpStream, log: &Mutex<Vec<(String, String)>>, delay: Duration) {
        let mut reader = BufReader::new(conn.try_clone().expect("clone"));
        let mut w = conn;
        loop {
            let mut head = String::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                if line == "\r\n" {
                    break;
                }
                head.push_str(&line);
            }
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            let mut body = vec![0; len];
            reader.read_exact(&mut body).expect("body");
            let body = String::from_utf8(body).expect("utf8");
            let usage = r#"{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":60}}"#;
            let answer = if body.contains("\"stream\":true") {
                let events = format!(
                    "data: {{\"choices\":[],\"usage\":null}}\n\ndata: {{\"choices\":[],\"usage\":{usage}}}\n\ndata: [DONE]\n\n"
                );
                let (a, b) = events.split_at(10);
                format!(
                    "HTTP/1.1 200 OK\r\nx-dp-rank: 2\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
                    a.len(),
                    b.len()
                )
            } else {
                let json = format!(r#"{{"usage":{usage}}}"#);
                format!(
                    "HTTP/1.1 200 OK\r\nx-dp-rank: 2\r\ncontent-length: {}\r\n\r\n{json}",
                    json.len()
                )
            };
            log.lock().expect("log").push((head, body));
            thread::sleep(delay);
            if w.write_all(answer.as_bytes()).is_err() {
                return;
            }
        }
    }

    /// A URL where nothing listens.
    fn dead_url() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", listener.local_addr().expect("addr"))
    }

    fn trace(n: usize) -> Vec<Request> {
        (0..n)
            .map(|i| {
                let line = format!(
                    r#"{{"t_ms": {}, "key": "s{}", "hash_ids": [1, 2, {i}]}}"#,
                    i * 2,
                    i % 3
                );
                trace::parse_line(&line, i + 1).expect("line")
            })
            .collect()
    }

    fn config(targets: &[String]) -> Config {
        Config {
            trace: String::new(),
            targets: targets
                .iter()
                .map(|u| Target::parse(u).expect("url"))
                .collect(),
            key_mode: KeyMode::Header,
            key_header: "x-smg-routing-key".into(),
            speed: 1.0,
            stream: false,
            timeout: Duration::from_secs(5),
            max_inflight: 1024,
            spread: SpreadMode::Random,
            turns: TurnOrder::InOrder,
            seed: 1,
            out: None,
            summary: None,
            block_tokens: 16,
            blocks_as_chat: false,
            model: "mock-model".into(),
            limit: None,
            dp_size: Some(4),
        }
    }

    #[test]
    fn replays_against_a_server() {
        let (url, seen) = server();
        for stream in [false, true] {
            seen.lock().expect("log").clear();
            let cfg = Config {
                stream,
                ..config(std::slice::from_ref(&url))
            };
            let (records, wall_s) = execute(&cfg, &trace(12));
            assert_eq!(records.len(), 12);
            assert!(
                wall_s >= 0.02,
                "open loop follows the trace clock: {wall_s}"
            );
            for (i, r) in records.iter().enumerate() {
                assert!(r.ok(), "{r:?}");
                assert_eq!(r.index, i);
                assert_eq!(r.rank, Some(2));
                assert_eq!((r.prompt_tokens, r.cached_tokens), (Some(100), Some(60)));
                assert!(r.ttfb_us.is_some() && r.total_us >= r.ttfb_us);
                assert_eq!(r.scheduled_ms, (i * 2) as f64);
            }
            let s = stats::summarize(&records, wall_s, cfg.dp_size);
            assert_eq!(s.token_hit_rate, Some(0.6));
            assert_eq!(s.per_rank[&2].requests, 12);
            assert_eq!(s.ranks_counted, 4);
            let seen = seen.lock().expect("log");
            assert_eq!(seen.len(), 12);
            for (head, body) in seen.iter() {
                assert!(
                    head.starts_with("POST /v1/completions HTTP/1.1\r\n"),
                    "{head}"
                );
                assert!(head.contains("x-smg-routing-key: s"), "{head}");
                let v: Value = serde_json::from_str(body).expect("json body");
                assert_eq!(v["model"], "mock-model");
                assert_eq!(v["prompt"].as_str().map(str::len), Some(3 * 64));
                assert_eq!(v.get("stream").is_some(), stream);
            }
        }
    }

    #[test]
    fn key_in_body_and_errors_are_counted() {
        let (url, seen) = server();
        let cfg = Config {
            key_mode: KeyMode::Body,
            spread: SpreadMode::Session,
            max_inflight: 1,
            ..config(&[url, dead_url()])
        };
        let (records, _) = execute(&cfg, &trace(9));
        // Session spread: a key always lands on the same target.
        let mut by_key: HashMap<String, usize> = HashMap::new();
        for r in &records {
            let key = r.key.clone().expect("key");
            assert_eq!(*by_key.entry(key).or_insert(r.target), r.target);
            assert_eq!(r.ok(), r.target == 0, "{r:?}");
            if r.target == 1 {
                assert!(r
                    .error
                    .as_deref()
                    .is_some_and(|e| e.starts_with("connect ")));
            }
        }
        let s = stats::summarize(&records, 1.0, None);
        assert_eq!(s.ok + s.errors, 9);
        for (head, body) in seen.lock().expect("log").iter() {
            assert!(!head.contains("x-smg-routing-key"), "{head}");
            assert!(body.contains("\"prompt_cache_key\":\"s"), "{body}");
        }
    }

    #[test]
    fn max_inflight_delays_are_counted() {
        let (url, _) = slow_server(Duration::from_millis(30));
        let cfg = Config {
            max_inflight: 1,
            ..config(&[url])
        };
        // Three requests due at once, one at a time: the last two wait.
        let reqs: Vec<Request> = trace(3)
            .into_iter()
            .map(|r| Request { t_ms: 0.0, ..r })
            .collect();
        let (records, wall_s) = execute(&cfg, &reqs);
        assert!(records.iter().all(Record::ok), "{records:?}");
        let delayed: Vec<bool> = records.iter().map(|r| r.inflight_delayed).collect();
        assert_eq!(delayed, [false, true, true]);
        assert!(wall_s >= 0.09, "three rounds of 30 ms: {wall_s}");
        assert!(records[1].lateness_us >= 30_000, "{records:?}");
        assert!(records[2].lateness_us >= 60_000, "{records:?}");
        assert_eq!(stats::summarize(&records, wall_s, None).inflight_delayed, 2);
    }

    /// Three turns of one session due at once: in order, each leaves when the
    /// previous answer has ended (and says how long it waited); open, all at once.
    /// Another session's turn is not held back by them.
    #[test]
    fn a_sessions_turns_wait_for_the_previous_answer() {
        let (url, _) = slow_server(Duration::from_millis(30));
        let at_once = |key: &str, i: usize| {
            let line = format!(r#"{{"t_ms": 0, "key": "{key}", "hash_ids": [1, {i}]}}"#);
            trace::parse_line(&line, i + 1).expect("line")
        };
        let reqs: Vec<Request> = vec![
            at_once("a", 0),
            at_once("a", 1),
            at_once("b", 2),
            at_once("a", 3),
        ];
        let (records, wall_s) = execute(&config(std::slice::from_ref(&url)), &reqs);
        assert!(records.iter().all(Record::ok), "{records:?}");
        assert!(wall_s >= 0.09, "three turns one after the other: {wall_s}");
        assert_eq!(records[0].turn_wait_us, 0);
        assert!(records[1].turn_wait_us >= 25_000, "{records:?}");
        assert_eq!(records[2].turn_wait_us, 0, "another session");
        assert!(records[3].turn_wait_us >= 55_000, "{records:?}");
        assert_eq!(stats::summarize(&records, wall_s, None).turns_waited, 2);
        let open = Config {
            turns: TurnOrder::Open,
            ..config(&[url])
        };
        let (records, wall_s) = execute(&open, &reqs);
        assert!(
            records.iter().all(|r| r.ok() && r.turn_wait_us == 0),
            "{records:?}"
        );
        assert!(wall_s < 0.09, "all at once: {wall_s}");
    }

    /// One routing key shared by two conversations (`session` names each): only a
    /// conversation's own turns wait for each other, never the other conversation's.
    #[test]
    fn a_shared_key_does_not_chain_other_conversations() {
        let (url, _) = slow_server(Duration::from_millis(30));
        let at_once = |session: &str, i: usize| {
            let line = format!(
                r#"{{"t_ms": 0, "key": "everyone", "session": "{session}", "hash_ids": [1, {i}]}}"#
            );
            trace::parse_line(&line, i + 1).expect("line")
        };
        let reqs: Vec<Request> = vec![at_once("a", 0), at_once("b", 1), at_once("a", 2)];
        let (records, _) = execute(&config(&[url]), &reqs);
        assert!(records.iter().all(Record::ok), "{records:?}");
        assert_eq!(
            records[1].turn_wait_us, 0,
            "another conversation, the same key"
        );
        assert!(records[2].turn_wait_us >= 25_000, "{records:?}");
        assert!(records.iter().all(|r| r.key.as_deref() == Some("everyone")));
    }

    #[test]
    fn stale_keep_alive_connection_is_retried() {
        // Answers one request per connection, claiming keep-alive, then
        // closes: each reuse finds a dead connection.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 65536];
                let _ = conn.read(&mut buf);
                let _ = conn
                    .write_all(b"HTTP/1.1 200 OK\r\nx-dp-rank: 1\r\ncontent-length: 2\r\n\r\n{}");
            }
        });
        let (records, _) = execute(&config(&[url]), &trace(4));
        assert!(records.iter().all(Record::ok), "{records:?}");
        assert!(records.iter().all(|r| r.rank == Some(1)));
    }

    #[test]
    fn silent_server_times_out() {
        // Connections complete in the backlog, but nobody ever answers.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let cfg = Config {
            timeout: Duration::from_millis(100),
            ..config(&[url])
        };
        let begin = Instant::now();
        let (records, _) = execute(&cfg, &trace(2));
        assert!(begin.elapsed() < Duration::from_secs(3));
        for r in &records {
            assert_eq!(r.error.as_deref(), Some("no answer: timed out"), "{r:?}");
            assert_eq!(r.status, None);
        }
        drop(listener);
    }

    #[test]
    fn bad_header_key_is_an_error_record() {
        let (url, _) = server();
        let mut reqs = trace(1);
        reqs[0].key = Some("a\r\nb".into());
        let (records, _) = execute(&config(&[url]), &reqs);
        assert!(records[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("not a valid header value")));
    }

    #[test]
    fn offsets_saturate() {
        assert_eq!(offset(1500.0), Duration::from_millis(1500));
        assert_eq!(offset(f64::INFINITY), offset(1e300));
        assert!(offset(f64::NAN) <= offset(f64::INFINITY));
    }

    #[test]
    fn error_answers_keep_a_short_message() {
        assert_eq!(
            error_excerpt(br#"{"error":{"message":"invalid rank"}}"#),
            "invalid rank"
        );
        assert_eq!(error_excerpt(b"  upstream reset \n"), "upstream reset");
        assert_eq!(error_excerpt(&[b'x'; 1000]).len(), MAX_ERROR_CHARS);
        let response = Response {
            status: 503,
            headers: vec![
                ("x-mock-prompt-tokens".into(), "8".into()),
                ("x-mock-cached-tokens".into(), "4".into()),
                ("x-mock-queue-us".into(), "12".into()),
            ],
            body: b"no healthy upstream".to_vec(),
            keep_alive: true,
        };
        let mut record = Record::default();
        fill_from_response(&mut record, &response);
        assert!(!record.ok());
        assert_eq!(
            record.error.as_deref(),
            Some("HTTP 503: no healthy upstream")
        );
        assert_eq!(
            (record.prompt_tokens, record.cached_tokens),
            (Some(8), Some(4))
        );
        assert_eq!((record.rank, record.queue_us), (None, Some(12)));
        let line = record.to_line();
        assert!(
            line.starts_with(r#"{"index":0,"line":0,"key":null,"#),
            "{line}"
        );
        let v: Value = serde_json::from_str(&line).expect("record line is JSON");
        assert_eq!(v["status"], 503);
        assert_eq!(v["rank"], Value::Null);
    }
}
