//! dp-replay: the load generator of dp-affinity. It writes synthetic
//! multi-turn workloads (`synth`), replays traces open-loop through Envoy and
//! measures what prefix-cache affinity is for — token hit rate, per-rank
//! balance, latency (`run`) — and computes the best hit rate a trace allows
//! (`oracle`) to read those measurements against.
//!
//! std + serde_json only (plus mock-rank's engine model, shared so the oracle
//! hashes prompts exactly as the mock ranks do). `dp-replay -h` for the CLI.

mod cli;
mod http;
mod jsonl;
mod oracle;
mod rng;
mod run;
mod stats;
mod synth;
mod text;
mod trace;
mod usage;

use std::io::{self, Write};
use std::process::ExitCode;

use cli::Command;

fn main() -> ExitCode {
    let command = match cli::parse_args(std::env::args().skip(1)) {
        Ok(command) => command,
        Err(err) => {
            let first_line = err.usage.lines().next().unwrap_or("");
            eprintln!("dp-replay: {}\n{first_line}\n(-h for help)", err.message);
            return ExitCode::from(2);
        }
    };
    let result = match command {
        Command::Help(text) => print_stdout(text.trim_end()),
        Command::Synth(cfg) => write_synth(&cfg),
        Command::Run(cfg) => run::main(&cfg),
        Command::Oracle(cfg) => oracle::main(&cfg),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("dp-replay: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn write_synth(cfg: &synth::Config) -> Result<(), String> {
    let workload = synth::generate(cfg);
    let mut out = io::BufWriter::new(io::stdout().lock());
    match workload.write(&mut out) {
        // `dp-replay synth | head` is not a failure.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        result => result.map_err(|e| format!("writing the trace: {e}")),
    }
}

/// Prints `text` and a newline; a failing stdout is an error, not a panic,
/// and a reader that stopped early (`| head`) is no error at all.
pub fn print_stdout(text: &str) -> Result<(), String> {
    let mut out = io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        result => result.map_err(|e| format!("writing to stdout: {e}")),
    }
}
