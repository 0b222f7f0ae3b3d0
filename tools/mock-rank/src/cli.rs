//! Command-line parsing. Hand-rolled to keep the mock dependency-free apart
//! from serde_json; the surface is a handful of flags.

pub const USAGE: &str = "\
usage: mock-rank --rank N [--port P] [--host 127.0.0.1] [--delay-ms D] [--stream-interval-ms I]
                 [ENGINE MODEL OPTIONS]
       mock-rank --engine[=KIND] --dp-size N [--engine-kind KIND] [--prefill-dp-size N]
                 [--port P] [--host 127.0.0.1] [--delay-ms D] [--delay-ms-rank R=D]...
                 [--stream-interval-ms I] [ENGINE MODEL OPTIONS]

Mock data-parallel rank server for dp-affinity tests.

  --rank N                rank reported in the x-dp-rank header and the answers
  --engine                stand for one engine with internal data parallelism
                          (SGLang --dp-size): requests pick an internal rank with
                          header x-data-parallel-rank, else round robin
  --dp-size N             number of internal ranks in --engine mode (1..=4096)
  --engine-kind KIND      --engine only (or --engine=KIND): which engine's rank
                          rules to follow. generic (default): the header on
                          every LLM path. sglang: the header on the OpenAI paths
                          (/v1/chat/completions, /v1/completions, /v1/responses,
                          /v1/messages; a non-integer is a 400), winning
                          over body routed_dp_rank / data_parallel_rank; on
                          /generate the header is IGNORED, only the body fields
                          count, and without one a bootstrap_room goes to
                          bootstrap_room % dp-size. vllm: the header on the
                          OpenAI paths (a non-integer is ignored), no body field,
                          /generate is 404. Out of range is a 400
  --prefill-dp-size N     --engine-kind sglang: the prefill DP size a decode leg
                          assumes; answers to requests with bootstrap_room report
                          mock.pd.prefill_dp_rank = disagg_prefill_dp_rank, else
                          bootstrap_room % N (default: --dp-size)
  --port P                TCP port to listen on; 0 (default) picks a free port
  --host H                address to bind (default 127.0.0.1)
  --delay-ms D            sleep D ms before answering LLM endpoints (default 0)
  --delay-ms-rank R=D     --engine only, repeatable: internal rank R sleeps D ms
                          instead of --delay-ms
  --stream-interval-ms I  gap between SSE events (default 100)
  --model-path P          model_path reported by /server_info, /model_info and
                          /v1/models (default: none). A model gateway loads its
                          tokenizer from the path a worker reports, so give a
                          local directory, never a model hub id
  -h, --help              print this help

Engine model (per rank; in --engine mode every internal rank has its own):
  --block-tokens N        tokens per KV block of the prefix cache (default 16);
                          a prompt is 1 token per 4 bytes of text, or its ids
  --cache-blocks N        prefix cache capacity in blocks, LRU; 0 (default) is
                          unlimited. Hits show in usage and /mock/stats
  --prefill-us-per-token F  service time per uncached prompt token, in
                          microseconds, before the first byte (default 0)
  --decode-us-per-token F   time per output token (default 0); when > 0 it
                          paces SSE events instead of --stream-interval-ms and
                          max_tokens counts up to 4096 instead of 50
  --max-concurrency N     requests served at once; later ones queue in arrival
                          order (default 0: unlimited)

LLM answers report usage.prompt_tokens / prompt_tokens_details.cached_tokens
(SGLang: meta_info), the same in headers x-mock-prompt-tokens,
x-mock-cached-tokens, plus x-mock-queue-us. GET /mock/stats shows per-rank
counters; POST /mock/reset-stats (alias /mock/reset) zeroes them and empties
the caches.

Exactly one of --rank and --engine is required.
On readiness prints one line `listening HOST:PORT` to stdout.
";

/// Largest `--dp-size`, the same bound the filter puts on its `dp_size`.
pub const MAX_DP_SIZE: u32 = 4096;
/// Largest per-token time (one second): keeps every simulated duration far
/// from `Duration` overflow.
pub const MAX_US_PER_TOKEN: f64 = 1e6;

pub use crate::engine::Kind;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One rank, reported as `rank`.
    Rank(u32),
    /// One engine with `dp_size` internal ranks 0..dp_size.
    Engine { dp_size: u32 },
}

// Not `Eq`: the per-token times are floats.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub mode: Mode,
    pub host: String,
    pub port: u16,
    pub delay_ms: u64,
    /// `--delay-ms-rank` overrides in command-line order (the last one for a
    /// rank wins).
    pub rank_delay_ms: Vec<(u32, u64)>,
    pub stream_interval_ms: u64,
    /// Tokens per prefix-cache block, >= 1.
    pub block_tokens: u32,
    /// Prefix-cache capacity of each rank in blocks, 0 = unlimited.
    pub cache_blocks: usize,
    /// Service time per uncached prompt token, microseconds.
    pub prefill_us_per_token: f64,
    /// Service time per output token, microseconds.
    pub decode_us_per_token: f64,
    /// Requests each rank serves at once, 0 = unlimited.
    pub max_concurrency: usize,
    /// `model_path` of the SGLang info endpoints; `None` reports none.
    pub model_path: Option<String>,
    /// Engine mode: whose rank rules the mock follows.
    pub engine_kind: Kind,
    /// Engine mode, SGLang: the prefill DP size a PD decode leg assumes (0: `dp_size`).
    pub prefill_dp_size: u32,
}

impl Config {
    /// Config for `mode` with every other setting at its default.
    pub fn new(mode: Mode) -> Self {
        Config {
            mode,
            host: "127.0.0.1".to_string(),
            port: 0,
            delay_ms: 0,
            rank_delay_ms: Vec::new(),
            stream_interval_ms: 100,
            block_tokens: 16,
            cache_blocks: 0,
            prefill_us_per_token: 0.0,
            decode_us_per_token: 0.0,
            max_concurrency: 0,
            model_path: None,
            engine_kind: Kind::Generic,
            prefill_dp_size: 0,
        }
    }

    /// The prefill DP size a decode leg assumes (`--prefill-dp-size`, else `--dp-size`).
    pub fn prefill_dp_size(&self) -> u32 {
        match self.prefill_dp_size {
            0 => self.dp_size(),
            n => n,
        }
    }

    /// Number of ranks this process serves: 1 for `--rank`.
    pub fn dp_size(&self) -> u32 {
        match self.mode {
            Mode::Rank(_) => 1,
            Mode::Engine { dp_size } => dp_size,
        }
    }

    /// Time-to-first-byte delay of an LLM request served by `rank`.
    pub fn delay_for(&self, rank: u32) -> u64 {
        self.rank_delay_ms
            .iter()
            .rev()
            .find(|(r, _)| *r == rank)
            .map_or(self.delay_ms, |(_, ms)| *ms)
    }
}

#[derive(Debug, PartialEq)]
pub enum Command {
    Run(Config),
    Help,
}

/// Parses the arguments after the program name. Accepts both `--flag value`
/// and `--flag=value` so scripts can use either style.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Command, String> {
    let mut rank = None;
    let mut engine = false;
    let mut kind = None;
    let mut dp_size = None;
    let mut cfg = Config::new(Mode::Rank(0));
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag.to_string(), Some(value.to_string())),
            None => (arg, None),
        };
        if flag == "--engine" {
            if let Some(value) = inline {
                kind = Some(engine_kind(&value)?);
            }
            engine = true;
            continue;
        }
        let value = match inline.or_else(|| args.next()) {
            Some(value) => value,
            None => return Err(format!("{flag} needs a value")),
        };
        match flag.as_str() {
            "--rank" => rank = Some(number(&flag, &value)?),
            "--dp-size" => dp_size = Some(number(&flag, &value)?),
            "--port" => cfg.port = number(&flag, &value)?,
            "--host" => cfg.host = value,
            "--delay-ms" => cfg.delay_ms = number(&flag, &value)?,
            "--delay-ms-rank" => cfg.rank_delay_ms.push(rank_delay(&value)?),
            "--stream-interval-ms" => cfg.stream_interval_ms = number(&flag, &value)?,
            "--block-tokens" => cfg.block_tokens = block_tokens(&value)?,
            "--cache-blocks" => cfg.cache_blocks = number(&flag, &value)?,
            "--prefill-us-per-token" => cfg.prefill_us_per_token = per_token_us(&flag, &value)?,
            "--decode-us-per-token" => cfg.decode_us_per_token = per_token_us(&flag, &value)?,
            "--max-concurrency" => cfg.max_concurrency = number(&flag, &value)?,
            "--model-path" => cfg.model_path = Some(value),
            "--engine-kind" => kind = Some(engine_kind(&value)?),
            "--prefill-dp-size" => cfg.prefill_dp_size = prefill_dp_size(&value)?,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    cfg.mode = match (rank, engine) {
        (Some(_), true) => return Err("--rank and --engine are mutually exclusive".into()),
        (None, false) => return Err("--rank N or --engine --dp-size N is required".into()),
        (Some(rank), false) => {
            if dp_size.is_some() {
                return Err("--dp-size needs --engine".into());
            }
            if !cfg.rank_delay_ms.is_empty() {
                return Err("--delay-ms-rank needs --engine (use --delay-ms)".into());
            }
            if kind.is_some() || cfg.prefill_dp_size != 0 {
                return Err("--engine-kind and --prefill-dp-size need --engine".into());
            }
            Mode::Rank(rank)
        }
        (None, true) => {
            let dp_size: u32 = dp_size.ok_or("--engine needs --dp-size N")?;
            if !(1..=MAX_DP_SIZE).contains(&dp_size) {
                return Err(format!("--dp-size must be in 1..={MAX_DP_SIZE}"));
            }
            if let Some((r, _)) = cfg.rank_delay_ms.iter().find(|(r, _)| *r >= dp_size) {
                return Err(format!(
                    "--delay-ms-rank: rank {r} is not below --dp-size {dp_size}"
                ));
            }
            cfg.engine_kind = kind.unwrap_or(Kind::Generic);
            if cfg.prefill_dp_size != 0 && cfg.engine_kind != Kind::Sglang {
                return Err("--prefill-dp-size needs --engine-kind sglang".into());
            }
            Mode::Engine { dp_size }
        }
    };
    Ok(Command::Run(cfg))
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("{flag}: invalid number {value:?}"))
}

/// `--engine-kind` / `--engine=KIND`.
fn engine_kind(value: &str) -> Result<Kind, String> {
    Kind::from_name(value)
        .ok_or_else(|| format!("--engine-kind: expected generic, sglang or vllm, got {value:?}"))
}

/// `--prefill-dp-size`: 1..=MAX_DP_SIZE.
fn prefill_dp_size(value: &str) -> Result<u32, String> {
    const FLAG: &str = "--prefill-dp-size";
    match number(FLAG, value)? {
        n @ 1..=MAX_DP_SIZE => Ok(n),
        _ => Err(format!("{FLAG} must be in 1..={MAX_DP_SIZE}")),
    }
}

/// `--block-tokens`: a block holds at least one token.
fn block_tokens(value: &str) -> Result<u32, String> {
    const FLAG: &str = "--block-tokens";
    match number(FLAG, value)? {
        0 => Err(format!("{FLAG} must be at least 1")),
        n => Ok(n),
    }
}

/// A per-token time in microseconds: finite, in 0..=MAX_US_PER_TOKEN.
fn per_token_us(flag: &str, value: &str) -> Result<f64, String> {
    let us: f64 = number(flag, value)?;
    if !(0.0..=MAX_US_PER_TOKEN).contains(&us) {
        return Err(format!(
            "{flag}: expected microseconds in 0..={MAX_US_PER_TOKEN}, got {value:?}"
        ));
    }
    Ok(us)
}

/// `R=D` of `--delay-ms-rank`.
fn rank_delay(value: &str) -> Result<(u32, u64), String> {
    const FLAG: &str = "--delay-ms-rank";
    let (rank, ms) = value
        .split_once('=')
        .ok_or_else(|| format!("{FLAG}: expected RANK=MS, got {value:?}"))?;
    Ok((number(FLAG, rank)?, number(FLAG, ms)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, String> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    fn run(args: &[&str]) -> Config {
        match parse(args) {
            Ok(Command::Run(cfg)) => cfg,
            other => panic!("expected run for {args:?}, got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let cfg = run(&["--rank", "3"]);
        assert_eq!(cfg.mode, Mode::Rank(3));
        assert_eq!(cfg.host, "127.0.0.1");
        assert_eq!(cfg.port, 0);
        assert_eq!(cfg.delay_ms, 0);
        assert!(cfg.rank_delay_ms.is_empty());
        assert_eq!(cfg.stream_interval_ms, 100);
        assert_eq!(cfg.dp_size(), 1);
        assert_eq!(cfg.block_tokens, 16);
        assert_eq!(cfg.cache_blocks, 0);
        assert_eq!(cfg.prefill_us_per_token, 0.0);
        assert_eq!(cfg.decode_us_per_token, 0.0);
        assert_eq!(cfg.max_concurrency, 0);
        assert_eq!(cfg.model_path, None);
    }

    #[test]
    fn all_flags_both_styles() {
        let cmd = parse(&[
            "--rank=1",
            "--port",
            "18001",
            "--host=0.0.0.0",
            "--delay-ms",
            "5",
            "--stream-interval-ms=7",
            "--block-tokens",
            "32",
            "--cache-blocks=1000",
            "--prefill-us-per-token",
            "2.5",
            "--decode-us-per-token=40",
            "--max-concurrency",
            "8",
            "--model-path=/models/tiny",
        ]);
        let expected = Config {
            mode: Mode::Rank(1),
            host: "0.0.0.0".into(),
            port: 18001,
            delay_ms: 5,
            rank_delay_ms: Vec::new(),
            stream_interval_ms: 7,
            block_tokens: 32,
            cache_blocks: 1000,
            prefill_us_per_token: 2.5,
            decode_us_per_token: 40.0,
            max_concurrency: 8,
            model_path: Some("/models/tiny".into()),
            engine_kind: Kind::Generic,
            prefill_dp_size: 0,
        };
        assert_eq!(cmd, Ok(Command::Run(expected)));
    }

    #[test]
    fn engine_mode() {
        let cfg = run(&[
            "--engine",
            "--dp-size",
            "4",
            "--delay-ms=10",
            "--delay-ms-rank",
            "2=500",
            "--delay-ms-rank=3=0",
            "--delay-ms-rank=2=600",
        ]);
        assert_eq!(cfg.mode, Mode::Engine { dp_size: 4 });
        assert_eq!(cfg.dp_size(), 4);
        assert_eq!(cfg.delay_for(0), 10);
        assert_eq!(cfg.delay_for(2), 600, "last override wins");
        assert_eq!(cfg.delay_for(3), 0);
        // Flag order does not matter.
        assert_eq!(
            run(&["--dp-size=1", "--port", "9", "--engine"]).mode,
            Mode::Engine { dp_size: 1 }
        );
        assert_eq!(
            run(&["--engine", "--dp-size", "4096"]).mode,
            Mode::Engine { dp_size: 4096 }
        );
    }

    #[test]
    fn engine_mode_errors() {
        let err = |args: &[&str]| parse(args).expect_err(&format!("{args:?} must fail"));
        assert!(err(&["--rank", "1", "--engine", "--dp-size", "2"]).contains("mutually exclusive"));
        assert!(err(&["--engine", "--rank", "0"]).contains("mutually exclusive"));
        assert!(err(&["--engine"]).contains("--dp-size"));
        assert!(err(&["--engine=1", "--dp-size", "2"]).contains("generic, sglang or vllm"));
        assert!(err(&["--rank", "1", "--engine-kind", "vllm"]).contains("need --engine"));
        assert!(err(&["--engine", "--dp-size=2", "--prefill-dp-size=2"]).contains("sglang"));
        err(&["--engine=sglang", "--dp-size=2", "--prefill-dp-size=0"]);
        err(&["--engine", "--dp-size=2", "--engine-kind=tgi"]);
        assert!(err(&["--rank", "1", "--dp-size", "2"]).contains("needs --engine"));
        assert!(err(&["--rank", "1", "--delay-ms-rank", "1=5"]).contains("needs --engine"));
        err(&["--engine", "--dp-size", "0"]);
        err(&["--engine", "--dp-size", "4097"]);
        err(&["--engine", "--dp-size", "-1"]);
        err(&["--engine", "--dp-size"]);
        assert!(err(&["--engine", "--dp-size", "4", "--delay-ms-rank", "4=1"]).contains("rank 4"));
        for bad in ["1", "=5", "1=", "a=5", "1=x", "-1=5", "1=-5"] {
            err(&["--engine", "--dp-size", "4", "--delay-ms-rank", bad]);
        }
    }

    #[test]
    fn engine_kinds() {
        let kind = |args: &[&str]| run(args).engine_kind;
        assert_eq!(kind(&["--engine", "--dp-size=2"]), Kind::Generic);
        assert_eq!(kind(&["--engine=sglang", "--dp-size=2"]), Kind::Sglang);
        assert_eq!(
            kind(&["--engine", "--dp-size=2", "--engine-kind", "vllm"]),
            Kind::Vllm
        );
        let pd = run(&["--engine=sglang", "--dp-size=4", "--prefill-dp-size=2"]);
        assert_eq!((pd.prefill_dp_size(), pd.dp_size()), (2, 4));
        assert_eq!(
            run(&["--engine=sglang", "--dp-size=4"]).prefill_dp_size(),
            4
        );
    }

    #[test]
    fn engine_model_flags() {
        let cfg = run(&[
            "--engine",
            "--dp-size=2",
            "--prefill-us-per-token=0",
            "--decode-us-per-token",
            "1e6",
            "--block-tokens=1",
        ]);
        assert_eq!(cfg.prefill_us_per_token, 0.0);
        assert_eq!(cfg.decode_us_per_token, 1e6);
        assert_eq!(cfg.block_tokens, 1);
        assert_eq!(
            run(&["--rank=0", "--prefill-us-per-token=.25"]).prefill_us_per_token,
            0.25
        );
    }

    #[test]
    fn engine_model_flag_errors() {
        let err = |args: &[&str]| parse(args).expect_err(&format!("{args:?} must fail"));
        assert!(err(&["--rank", "0", "--block-tokens", "0"]).contains("at least 1"));
        err(&["--rank", "0", "--block-tokens", "-1"]);
        err(&["--rank", "0", "--block-tokens", "1.5"]);
        err(&["--rank", "0", "--cache-blocks", "-1"]);
        err(&["--rank", "0", "--max-concurrency", "x"]);
        for flag in ["--prefill-us-per-token", "--decode-us-per-token"] {
            for bad in ["-1", "nan", "inf", "1e7", "x", ""] {
                err(&["--rank", "0", flag, bad]);
            }
        }
    }

    #[test]
    fn errors_and_help() {
        assert_eq!(parse(&["--help"]), Ok(Command::Help));
        assert_eq!(parse(&["--rank", "1", "-h"]), Ok(Command::Help));
        assert!(parse(&[]).is_err());
        assert!(parse(&["--rank"]).is_err());
        assert!(parse(&["--rank", "-1"]).is_err());
        assert!(parse(&["--rank", "1", "--port", "70000"]).is_err());
        assert!(parse(&["--rank", "1", "--bogus", "1"]).is_err());
    }
}
