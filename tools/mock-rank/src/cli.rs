//! Command-line parsing. Hand-rolled to keep the mock dependency-free apart
//! from serde_json; the surface is five flags.

pub const USAGE: &str = "\
usage: mock-rank --rank N [--port P] [--host 127.0.0.1] [--delay-ms D] [--stream-interval-ms I]

Mock data-parallel rank server for dp-affinity tests.

  --rank N                rank reported in the x-dp-rank header and the answers (required)
  --port P                TCP port to listen on; 0 (default) picks a free port
  --host H                address to bind (default 127.0.0.1)
  --delay-ms D            sleep D ms before answering LLM endpoints (default 0)
  --stream-interval-ms I  gap between SSE events (default 100)
  -h, --help              print this help

On readiness prints one line `listening HOST:PORT` to stdout.
";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub rank: u32,
    pub host: String,
    pub port: u16,
    pub delay_ms: u64,
    pub stream_interval_ms: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    Run(Config),
    Help,
}

/// Parses the arguments after the program name. Accepts both `--flag value`
/// and `--flag=value` so scripts can use either style.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Command, String> {
    let mut rank = None;
    let mut cfg = Config {
        rank: 0,
        host: "127.0.0.1".to_string(),
        port: 0,
        delay_ms: 0,
        stream_interval_ms: 100,
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag.to_string(), Some(value.to_string())),
            None => (arg, None),
        };
        let value = match inline.or_else(|| args.next()) {
            Some(value) => value,
            None => return Err(format!("{flag} needs a value")),
        };
        match flag.as_str() {
            "--rank" => rank = Some(number(&flag, &value)?),
            "--port" => cfg.port = number(&flag, &value)?,
            "--host" => cfg.host = value,
            "--delay-ms" => cfg.delay_ms = number(&flag, &value)?,
            "--stream-interval-ms" => cfg.stream_interval_ms = number(&flag, &value)?,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    cfg.rank = rank.ok_or("--rank is required")?;
    Ok(Command::Run(cfg))
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("{flag}: invalid number {value:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, String> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn defaults() {
        let Ok(Command::Run(cfg)) = parse(&["--rank", "3"]) else {
            panic!("expected run");
        };
        assert_eq!(cfg.rank, 3);
        assert_eq!(cfg.host, "127.0.0.1");
        assert_eq!(cfg.port, 0);
        assert_eq!(cfg.delay_ms, 0);
        assert_eq!(cfg.stream_interval_ms, 100);
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
        ]);
        let expected = Config {
            rank: 1,
            host: "0.0.0.0".into(),
            port: 18001,
            delay_ms: 5,
            stream_interval_ms: 7,
        };
        assert_eq!(cmd, Ok(Command::Run(expected)));
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
