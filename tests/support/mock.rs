//! A `mock-rank` child process on 127.0.0.1: one simulated DP rank, or (engine
//! mode) one engine holding several internal ranks.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

use super::http::{self, Request};
use super::paths;

const READY_TIMEOUT: Duration = Duration::from_secs(10);

pub struct MockRank {
    rank: u32,
    port: u16,
    /// `--rank N`, or `--engine --dp-size N`.
    mode_args: Vec<String>,
    extra_args: Vec<String>,
    log_path: PathBuf,
    child: Option<Child>,
}

impl MockRank {
    /// Starts rank `rank` on a free port; `extra_args` go straight to the CLI
    /// (e.g. `["--stream-interval-ms", "200"]`). Logs go to `dir`.
    pub fn start(rank: u32, extra_args: &[&str], dir: &Path) -> MockRank {
        let mut mock = MockRank {
            rank,
            port: 0,
            mode_args: vec!["--rank".into(), rank.to_string()],
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            log_path: dir.join(format!("mock-rank-{rank}.log")),
            child: None,
        };
        mock.spawn();
        mock
    }

    /// Starts one engine-mode mock (`--engine --dp-size N`) on a free port: it
    /// serves internal rank `x-data-parallel-rank` if the request names one, else
    /// round robin. `extra_args` e.g. `["--delay-ms-rank", "1=300"]`.
    pub fn start_engine(dp_size: u32, extra_args: &[&str], dir: &Path) -> MockRank {
        let mut mock = MockRank {
            rank: 0,
            port: 0,
            mode_args: vec!["--engine".into(), "--dp-size".into(), dp_size.to_string()],
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            log_path: dir.join("mock-engine.log"),
            child: None,
        };
        mock.spawn();
        mock
    }

    /// The mock's counters since start or the last `reset_stats`:
    /// `{"per_rank":[{"rank","requests","inflight","max_inflight"}...]}`.
    pub fn stats(&self) -> Value {
        let response = http::send(self.addr(), &Request::get("/mock/stats"));
        assert_eq!(response.status, 200, "GET /mock/stats: {}", response.text());
        response.json()
    }

    pub fn reset_stats(&self) {
        let response = http::send(self.addr(), &Request::post("/mock/reset-stats"));
        assert!(
            (200..300).contains(&response.status),
            "POST /mock/reset-stats: {} {}",
            response.status,
            response.text()
        );
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Stops the rank (the "rank died" case); the port stays reserved in `self`
    /// so `restart` brings it back where Envoy's cluster expects it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the rank again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn spawn(&mut self) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap_or_else(|e| panic!("open {}: {e}", self.log_path.display()));
        let mut child = Command::new(paths::mock_bin())
            .args(&self.mode_args)
            .args(["--port", &self.port.to_string()])
            .args(["--host", "127.0.0.1"])
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn mock-rank: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let announced = wait_for_listening(stdout);
        match announced {
            Some(port) => self.port = port,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "mock-rank {} did not print `listening 127.0.0.1:PORT` within {READY_TIMEOUT:?}; log: {}",
                    self.mode_args.join(" "),
                    std::fs::read_to_string(&self.log_path).unwrap_or_default()
                );
            }
        }
        self.child = Some(child);
    }
}

impl Drop for MockRank {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Reads stdout on a thread until the readiness line, then keeps draining it so a
/// chatty mock never blocks on (or dies of) a full or closed pipe.
fn wait_for_listening(stdout: ChildStdout) -> Option<u16> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(port) = parse_listening(&line) {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(port);
                }
            }
        }
    });
    rx.recv_timeout(READY_TIMEOUT).ok()
}

/// `listening 127.0.0.1:PORT` → PORT.
fn parse_listening(line: &str) -> Option<u16> {
    let addr = line.trim().strip_prefix("listening ")?;
    addr.parse::<SocketAddr>().ok().map(|a| a.port())
}
