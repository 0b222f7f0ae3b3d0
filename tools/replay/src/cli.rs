//! Command-line parsing, hand-rolled like mock-rank's to keep the tool
//! std + serde_json. Every subcommand declares its flags once (name, arity);
//! the generic parser rejects unknown, repeated and value-less flags with a
//! message naming the flag, and each builder validates ranges.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use crate::http::{self, Target};
use crate::{oracle, run, synth};

pub const USAGE: &str = "\
usage: dp-replay synth [flags] > trace.jsonl
       dp-replay run --trace FILE --target URL [--target URL]... [flags]
       dp-replay oracle --trace FILE [flags]

Load generator for dp-affinity. `dp-replay COMMAND -h` describes each command.

  synth   write a deterministic synthetic multi-turn chat workload (JSONL)
  run     replay a trace open-loop against Envoy (or mock ranks) and measure
          prefix-cache hit rate, per-rank balance and latency
  oracle  best achievable hit rates of a trace (shared / per-key caches)

Exit status: 0 done (a run's failed requests are counted, not fatal),
1 unreadable trace or output, 2 usage error.
";

pub const SYNTH_USAGE: &str = "\
usage: dp-replay synth [flags] > trace.jsonl

Writes a synthetic multi-turn chat trace to stdout, one request per line,
sorted by time: {\"t_ms\", \"key\": \"t<tenant>-s<session>\", \"messages\", \"output_tokens\"}.
Turn k resends the tenant's system prompt, all earlier user/assistant turns and
a new user message. Same flags and seed, same bytes.

  --seed N            random seed (default 1)
  --tenants T         tenants, each with its own system prompt (default 4)
  --sessions S        sessions; tenant chosen Zipf-like (default 100)
  --system-tokens N   tokens of each tenant's system prompt (default 1000)
  --user-tokens N     mean tokens of a new user message, uniform in
                      [N/2, 3N/2] (default 64)
  --output-tokens N   tokens of each assistant answer, also the requested
                      output_tokens (default 32)
  --max-turns N       turns per session, Zipf-like in 1..=N (default 8)
  --zipf S            Zipf exponent of tenant popularity and turns (default 1.0)
  --session-rate R    session starts per second, Poisson (default 2.0)
  --think-ms MS       mean think time between turns, exponential (default 2000)
  --response-ms MS    assumed response time added before thinking (default 500)
  -h, --help          print this help
";

pub const RUN_USAGE: &str = "\
usage: dp-replay run --trace FILE --target URL [--target URL]... [flags]

Replays a trace open-loop: request i is sent at (t_ms[i] - t_ms[0]) / speed
whether or not earlier ones finished, except that a session's turn waits for
its previous turn's answer (see --turns). Prints a summary table on stderr.

  --trace FILE        JSONL trace (`-` = stdin): t_ms|timestamp, key, session
                      (when a key names several conversations), one of
                      messages|text|blocks|hash_ids, output_tokens|output_length,
                      input_length
  --target URL        http://HOST:PORT[/prefix]; repeat for several replicas
  --spread MODE       random (seeded per request, default) | session (hash
                      of the key; random without a key): target choice
  --turns ORDER       in-order (default): a request waits for the answer to
                      the previous request of its session (its `session`,
                      else its key) to end, as a client does | open: every
                      request leaves at its trace time
  --key-mode MODE     header (default) | body (\"prompt_cache_key\") | none
  --key-header NAME   header carrying the key (default x-smg-routing-key)
  --speed X           time compression: 2 replays twice as fast (default 1)
  --stream            ask for SSE answers (\"stream\": true)
  --timeout-ms N      per-request deadline: connect + send + answer (default 60000)
  --max-inflight N    concurrency cap, a safety valve; delayed sends are
                      counted (default 1024)
  --seed N            seed of the random target choice (default 1)
  --out FILE          per-request records, JSONL
  --summary FILE      summary, JSON
  --block-tokens N    tokens per block id when expanding blocks/hash_ids to
                      text; match the mock's --block-tokens (default 16)
  --blocks-as FORM    text (default): blocks/hash_ids prompts as a completions
                      \"prompt\"; chat: as one user message of a chat
  --model M           \"model\" of every request (default mock-model)
  --limit N           replay only the first N requests
  --dp-size N         ranks 0..N for the balance figures (default: ranks seen)
  -h, --help          print this help
";

pub const ORACLE_USAGE: &str = "\
usage: dp-replay oracle --trace FILE [flags]

Prints, as JSON, the hit rate of one unlimited prefix cache shared by all
requests in arrival order (the upper bound for any placement) and of one
unlimited cache per routing key (perfect session affinity), computed with
mock-rank's own prompt hashing on the bodies `run` sends.

  --trace FILE        JSONL trace (`-` = stdin), as for `run`
  --block-tokens N    tokens per KV block, as the mock's --block-tokens
                      (default 16)
  --blocks-as FORM    text (default) | chat, as for `run`
  --model M           \"model\" of every request; it seeds the hashes
                      (default mock-model)
  --limit N           only the first N requests
  -h, --help          print this help
";

const DEFAULT_MODEL: &str = "mock-model";
const DEFAULT_BLOCK_TOKENS: u32 = 16;
const MAX_BLOCK_TOKENS: u32 = 1 << 20;
const MAX_DP_SIZE: u32 = 4096;
const MAX_INFLIGHT: usize = 65536;

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Print this text and exit successfully.
    Help(&'static str),
    Synth(synth::Config),
    Run(run::Config),
    Oracle(oracle::Config),
}

/// A usage error: the message and the usage text of the command concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError {
    pub message: String,
    pub usage: &'static str,
}

pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Command, UsageError> {
    let args: Vec<String> = args.into_iter().collect();
    let Some((command, rest)) = args.split_first() else {
        return Err(usage_error("missing command (synth, run or oracle)", USAGE));
    };
    let (usage, specs, build): (&'static str, &[(&str, Arity)], Builder) = match command.as_str() {
        "-h" | "--help" | "help" => return Ok(Command::Help(USAGE)),
        "synth" => (SYNTH_USAGE, SYNTH_FLAGS, synth_config),
        "run" => (RUN_USAGE, RUN_FLAGS, run_config),
        "oracle" => (ORACLE_USAGE, ORACLE_FLAGS, oracle_config),
        other => {
            return Err(usage_error(
                &format!("unknown command {other:?} (expected synth, run or oracle)"),
                USAGE,
            ))
        }
    };
    match Flags::parse(rest, specs) {
        Ok(None) => Ok(Command::Help(usage)),
        Ok(Some(flags)) => build(&flags).map_err(|m| usage_error(&m, usage)),
        Err(m) => Err(usage_error(&m, usage)),
    }
}

fn usage_error(message: &str, usage: &'static str) -> UsageError {
    UsageError {
        message: message.to_string(),
        usage,
    }
}

/// Builds a command's configuration from its flags.
type Builder = fn(&Flags) -> Result<Command, String>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arity {
    /// A switch: present or not.
    Switch,
    /// One value, at most once.
    Value,
    /// One value, any number of times.
    Repeated,
}

const SYNTH_FLAGS: &[(&str, Arity)] = &[
    ("--seed", Arity::Value),
    ("--tenants", Arity::Value),
    ("--sessions", Arity::Value),
    ("--system-tokens", Arity::Value),
    ("--user-tokens", Arity::Value),
    ("--output-tokens", Arity::Value),
    ("--max-turns", Arity::Value),
    ("--zipf", Arity::Value),
    ("--session-rate", Arity::Value),
    ("--think-ms", Arity::Value),
    ("--response-ms", Arity::Value),
];

const RUN_FLAGS: &[(&str, Arity)] = &[
    ("--trace", Arity::Value),
    ("--target", Arity::Repeated),
    ("--spread", Arity::Value),
    ("--turns", Arity::Value),
    ("--key-mode", Arity::Value),
    ("--key-header", Arity::Value),
    ("--speed", Arity::Value),
    ("--stream", Arity::Switch),
    ("--timeout-ms", Arity::Value),
    ("--max-inflight", Arity::Value),
    ("--seed", Arity::Value),
    ("--out", Arity::Value),
    ("--summary", Arity::Value),
    ("--block-tokens", Arity::Value),
    ("--blocks-as", Arity::Value),
    ("--model", Arity::Value),
    ("--limit", Arity::Value),
    ("--dp-size", Arity::Value),
];

const ORACLE_FLAGS: &[(&str, Arity)] = &[
    ("--trace", Arity::Value),
    ("--block-tokens", Arity::Value),
    ("--blocks-as", Arity::Value),
    ("--model", Arity::Value),
    ("--limit", Arity::Value),
];

/// Flags given on the command line, by name.
#[derive(Debug, Default)]
struct Flags {
    values: HashMap<&'static str, Vec<String>>,
}

impl Flags {
    /// `Ok(None)` when help was asked for. Accepts `--flag value` and
    /// `--flag=value`.
    fn parse(args: &[String], specs: &[(&'static str, Arity)]) -> Result<Option<Flags>, String> {
        let mut flags = Flags::default();
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            if arg == "-h" || arg == "--help" {
                return Ok(None);
            }
            let (name, inline) = match arg.split_once('=') {
                Some((name, value)) if name.starts_with("--") => (name, Some(value.to_string())),
                _ => (arg.as_str(), None),
            };
            let Some(&(name, arity)) = specs.iter().find(|(n, _)| *n == name) else {
                return Err(if name.starts_with('-') {
                    format!("unknown flag {name}")
                } else {
                    format!("unexpected argument {name:?}")
                });
            };
            let value = match (arity, inline) {
                (Arity::Switch, Some(_)) => return Err(format!("{name} takes no value")),
                (Arity::Switch, None) => String::new(),
                (_, Some(value)) => value,
                (_, None) => args
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("{name} needs a value"))?,
            };
            let seen = flags.values.entry(name).or_default();
            if arity != Arity::Repeated && !seen.is_empty() {
                return Err(format!("{name} given twice"));
            }
            seen.push(value);
        }
        Ok(Some(flags))
    }

    fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.values
            .get(name)
            .and_then(|v| v.last())
            .map(String::as_str)
    }

    fn all(&self, name: &str) -> &[String] {
        self.values.get(name).map_or(&[], Vec::as_slice)
    }

    /// The parsed value of `name`, or `default` when absent.
    fn num<T: FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| format!("{name}: invalid number {v:?}")),
        }
    }

    /// An integer in `min..=max`.
    fn int<T>(&self, name: &str, default: T, min: T, max: T) -> Result<T, String>
    where
        T: FromStr + PartialOrd + Copy + std::fmt::Display,
    {
        let v = self.num(name, default)?;
        if v < min || v > max {
            return Err(format!("{name}: {v} is out of range {min}..={max}"));
        }
        Ok(v)
    }

    /// A finite number `>= min` (`> min` when `strict`).
    fn real(&self, name: &str, default: f64, min: f64, strict: bool) -> Result<f64, String> {
        let v: f64 = self.num(name, default)?;
        let ok = v.is_finite() && if strict { v > min } else { v >= min };
        if !ok {
            let bound = if strict { ">" } else { ">=" };
            return Err(format!("{name}: {v} must be a finite number {bound} {min}"));
        }
        Ok(v)
    }

    fn required(&self, name: &str) -> Result<String, String> {
        self.get(name)
            .map(str::to_string)
            .ok_or_else(|| format!("{name} is required"))
    }

    fn limit(&self) -> Result<Option<usize>, String> {
        self.get("--limit")
            .map(|_| self.num("--limit", 0usize))
            .transpose()
    }

    fn block_tokens(&self) -> Result<u32, String> {
        self.int("--block-tokens", DEFAULT_BLOCK_TOKENS, 1, MAX_BLOCK_TOKENS)
    }

    /// `--blocks-as`: whether block-id prompts go out as a one-message chat.
    fn blocks_as_chat(&self) -> Result<bool, String> {
        match self.get("--blocks-as").unwrap_or("text") {
            "text" => Ok(false),
            "chat" => Ok(true),
            other => Err(format!("--blocks-as: {other:?} is not one of text, chat")),
        }
    }

    fn model(&self) -> String {
        self.get("--model").unwrap_or(DEFAULT_MODEL).to_string()
    }
}

fn synth_config(f: &Flags) -> Result<Command, String> {
    let d = synth::Config::default();
    const BIG: u64 = 1_000_000;
    Ok(Command::Synth(synth::Config {
        seed: f.num("--seed", d.seed)?,
        tenants: f.int("--tenants", d.tenants, 1, BIG)?,
        sessions: f.int("--sessions", d.sessions, 1, BIG)?,
        system_tokens: f.int("--system-tokens", d.system_tokens, 0, BIG)?,
        user_tokens: f.int("--user-tokens", d.user_tokens, 1, BIG)?,
        output_tokens: f.int("--output-tokens", d.output_tokens, 1, BIG)?,
        max_turns: f.int("--max-turns", d.max_turns, 1, 10_000)?,
        zipf: f.real("--zipf", d.zipf, 0.0, false)?,
        session_rate: f.real("--session-rate", d.session_rate, 0.0, true)?,
        think_ms: f.real("--think-ms", d.think_ms, 0.0, false)?,
        response_ms: f.real("--response-ms", d.response_ms, 0.0, false)?,
    }))
}

fn run_config(f: &Flags) -> Result<Command, String> {
    let targets = f
        .all("--target")
        .iter()
        .map(|url| Target::parse(url).map_err(|e| format!("--target {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    if targets.is_empty() {
        return Err("--target is required".into());
    }
    let key_mode = match f.get("--key-mode").unwrap_or("header") {
        "header" => run::KeyMode::Header,
        "body" => run::KeyMode::Body,
        "none" => run::KeyMode::None,
        other => {
            return Err(format!(
                "--key-mode: {other:?} is not one of header, body, none"
            ))
        }
    };
    let spread = match f.get("--spread").unwrap_or("random") {
        "random" => run::SpreadMode::Random,
        "session" => run::SpreadMode::Session,
        other => return Err(format!("--spread: {other:?} is not one of random, session")),
    };
    let turns = match f.get("--turns").unwrap_or("in-order") {
        "in-order" => run::TurnOrder::InOrder,
        "open" => run::TurnOrder::Open,
        other => return Err(format!("--turns: {other:?} is not one of in-order, open")),
    };
    let key_header = f
        .get("--key-header")
        .unwrap_or("x-smg-routing-key")
        .to_ascii_lowercase();
    if !http::valid_header_name(&key_header) {
        return Err(format!("--key-header: {key_header:?} is not a header name"));
    }
    let dp_size = f
        .get("--dp-size")
        .map(|_| f.int("--dp-size", 1, 1, MAX_DP_SIZE))
        .transpose()?;
    Ok(Command::Run(run::Config {
        trace: f.required("--trace")?,
        targets,
        key_mode,
        key_header,
        speed: f.real("--speed", 1.0, 0.0, true)?,
        stream: f.has("--stream"),
        timeout: Duration::from_millis(f.int("--timeout-ms", 60_000, 1, u64::MAX)?),
        max_inflight: f.int("--max-inflight", 1024, 1, MAX_INFLIGHT)?,
        spread,
        turns,
        seed: f.num("--seed", 1)?,
        out: f.get("--out").map(str::to_string),
        summary: f.get("--summary").map(str::to_string),
        block_tokens: f.block_tokens()?,
        blocks_as_chat: f.blocks_as_chat()?,
        model: f.model(),
        limit: f.limit()?,
        dp_size,
    }))
}

fn oracle_config(f: &Flags) -> Result<Command, String> {
    Ok(Command::Oracle(oracle::Config {
        trace: f.required("--trace")?,
        block_tokens: f.block_tokens()?,
        blocks_as_chat: f.blocks_as_chat()?,
        model: f.model(),
        limit: f.limit()?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, UsageError> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    fn err(args: &[&str]) -> String {
        match parse(args) {
            Err(e) => e.message,
            Ok(c) => panic!("{args:?} must fail, got {c:?}"),
        }
    }

    #[test]
    fn help_everywhere() {
        assert_eq!(parse(&["-h"]), Ok(Command::Help(USAGE)));
        assert_eq!(parse(&["run", "--help"]), Ok(Command::Help(RUN_USAGE)));
        assert_eq!(
            parse(&["synth", "--seed", "3", "-h"]),
            Ok(Command::Help(SYNTH_USAGE))
        );
        assert_eq!(parse(&["oracle", "-h"]), Ok(Command::Help(ORACLE_USAGE)));
    }

    #[test]
    fn synth_defaults_and_flags() {
        assert_eq!(
            parse(&["synth"]),
            Ok(Command::Synth(synth::Config::default()))
        );
        let Ok(Command::Synth(cfg)) = parse(&[
            "synth",
            "--seed=9",
            "--tenants",
            "2",
            "--zipf",
            "0",
            "--session-rate=0.5",
            "--think-ms",
            "0",
        ]) else {
            panic!("synth")
        };
        assert_eq!((cfg.seed, cfg.tenants, cfg.zipf), (9, 2, 0.0));
        assert_eq!((cfg.session_rate, cfg.think_ms), (0.5, 0.0));
    }

    #[test]
    fn run_defaults_and_flags() {
        let Ok(Command::Run(cfg)) = parse(&["run", "--trace", "t.jsonl", "--target", "http://a:1"])
        else {
            panic!("run")
        };
        assert_eq!(cfg.key_mode, run::KeyMode::Header);
        assert_eq!(cfg.key_header, "x-smg-routing-key");
        assert_eq!(cfg.spread, run::SpreadMode::Random);
        assert_eq!(cfg.turns, run::TurnOrder::InOrder);
        assert_eq!(cfg.speed, 1.0);
        assert!(!cfg.stream);
        assert_eq!(cfg.timeout, Duration::from_secs(60));
        assert_eq!(cfg.max_inflight, 1024);
        assert_eq!((cfg.block_tokens, cfg.model.as_str()), (16, "mock-model"));
        assert!(!cfg.blocks_as_chat);
        assert_eq!((cfg.limit, cfg.dp_size, cfg.out), (None, None, None));
        let Ok(Command::Run(cfg)) = parse(&[
            "run",
            "--trace=t",
            "--target",
            "http://a:1",
            "--target=http://b:2/x",
            "--key-mode",
            "body",
            "--key-header",
            "X-Key",
            "--spread",
            "session",
            "--turns",
            "open",
            "--stream",
            "--speed",
            "2.5",
            "--dp-size",
            "4",
            "--limit",
            "10",
            "--summary",
            "s.json",
            "--blocks-as",
            "chat",
        ]) else {
            panic!("run")
        };
        assert_eq!(cfg.targets.len(), 2);
        assert_eq!(cfg.targets[1].base, "/x");
        assert_eq!(cfg.key_mode, run::KeyMode::Body);
        assert_eq!(cfg.key_header, "x-key");
        assert_eq!(cfg.spread, run::SpreadMode::Session);
        assert_eq!(cfg.turns, run::TurnOrder::Open);
        assert!(cfg.stream);
        assert_eq!(
            (cfg.speed, cfg.dp_size, cfg.limit),
            (2.5, Some(4), Some(10))
        );
        assert_eq!(cfg.summary.as_deref(), Some("s.json"));
        assert!(cfg.blocks_as_chat);
    }

    #[test]
    fn errors_name_the_flag() {
        let run = |extra: &[&str]| {
            let mut args = vec!["run", "--trace", "t", "--target", "http://a:1"];
            args.extend_from_slice(extra);
            err(&args)
        };
        assert!(err(&[]).contains("missing command"));
        assert!(err(&["bogus"]).contains("unknown command"));
        assert!(err(&["run", "--target", "http://a:1"]).contains("--trace is required"));
        assert!(err(&["run", "--trace", "t"]).contains("--target is required"));
        assert!(run(&["--target", "a:1"]).contains("--target"));
        assert!(run(&["--blocks-as", "json"]).contains("--blocks-as"));
        assert!(run(&["--speed", "0"]).contains("--speed"));
        assert!(run(&["--speed", "x"]).contains("--speed: invalid number"));
        assert!(run(&["--speed", "1", "--speed", "2"]).contains("--speed given twice"));
        assert!(run(&["--key-mode", "cookie"]).contains("--key-mode"));
        assert!(run(&["--spread", "rr"]).contains("--spread"));
        assert!(run(&["--key-header", "bad header"]).contains("--key-header"));
        assert!(run(&["--max-inflight", "0"]).contains("--max-inflight"));
        assert!(run(&["--dp-size", "0"]).contains("--dp-size"));
        assert!(run(&["--block-tokens", "0"]).contains("--block-tokens"));
        assert!(run(&["--stream=1"]).contains("--stream takes no value"));
        assert!(run(&["--timeout-ms"]).contains("--timeout-ms needs a value"));
        assert!(run(&["--tenants", "2"]).contains("unknown flag --tenants"));
        assert!(run(&["stray"]).contains("unexpected argument"));
        assert!(err(&["synth", "--zipf", "-1"]).contains("--zipf"));
        assert!(err(&["synth", "--session-rate", "0"]).contains("--session-rate"));
        assert!(err(&["synth", "--max-turns", "0"]).contains("--max-turns"));
        assert!(err(&["oracle"]).contains("--trace is required"));
        assert_eq!(
            parse(&["oracle", "--bogus"]).map_err(|e| e.usage),
            Err(ORACLE_USAGE)
        );
    }
}
