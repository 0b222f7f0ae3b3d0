//! HTTP/2 requests through the system `curl` (h2c with prior knowledge): the
//! tests stay std-only, and curl's HTTP/2 stack is an independent client.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use super::http::{Request, Response};

/// Fails the calling test unless `curl` is on PATH and built with HTTP/2 (`curl -V` lists
/// `HTTP2`): an HTTP/2 scenario must not pass by not running. `make test` installs such a curl
/// (scripts/install-tools.sh).
pub fn require_curl_http2() {
    let output = Command::new("curl")
        .arg("-V")
        .stderr(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("curl not runnable ({e}): run scripts/install-tools.sh"));
    let version = String::from_utf8_lossy(&output.stdout);
    let http2 = version
        .lines()
        .filter(|l| l.starts_with("Features:"))
        .any(|l| l.split_whitespace().any(|f| f == "HTTP2"));
    assert!(
        output.status.success() && http2,
        "this curl has no HTTP/2 (run scripts/install-tools.sh, which installs one):\n{version}"
    );
}

/// An answer received over HTTP/2, with the protocol curl reports having used.
#[derive(Debug)]
pub struct H2Answer {
    /// The status line's protocol, e.g. `HTTP/2`.
    pub protocol: String,
    pub response: Response,
}

/// Sends `request` to `addr` over cleartext HTTP/2 with prior knowledge (no
/// upgrade dance: the first bytes are the HTTP/2 preface). Scratch files go to `dir`.
pub fn send_h2c(addr: std::net::SocketAddr, request: &Request, dir: &Path) -> H2Answer {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let head_path = dir.join(format!("h2-{n}.head"));
    let body_path = dir.join(format!("h2-{n}.body"));
    let upload_path = dir.join(format!("h2-{n}.upload"));
    let mut command = Command::new("curl");
    command
        .args(["-sS", "--http2-prior-knowledge", "--max-time", "15"])
        .args(["-X", &request.method])
        .arg("-D")
        .arg(&head_path)
        .arg("-o")
        .arg(&body_path);
    for (name, value) in &request.headers {
        command.arg("-H").arg(format!("{name}: {value}"));
    }
    if !request.body.is_empty() {
        std::fs::write(&upload_path, &request.body).expect("write curl upload");
        command
            .arg("--data-binary")
            .arg(format!("@{}", upload_path.display()));
    }
    command.arg(format!("http://{addr}{}", request.path));
    let output = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run curl: {e}"));
    assert!(
        output.status.success(),
        "curl --http2-prior-knowledge failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let head = std::fs::read_to_string(&head_path).expect("read curl headers");
    let body = std::fs::read(&body_path).unwrap_or_default();
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or("").trim().to_string();
    let mut parts = status_line.split_whitespace();
    let protocol = parts.next().unwrap_or("").to_string();
    let status = parts
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("curl status line {status_line:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    H2Answer {
        protocol,
        response: Response {
            status,
            headers,
            body,
        },
    }
}
