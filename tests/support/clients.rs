//! Real client libraries as the tests' clients: a script under `tests/clients/`, run with the
//! tools venv's Python, reads a JSON plan on stdin and prints one JSON line per call.
//!
//! A missing Python or library fails the test (the script exits non-zero, its stderr is in the
//! panic message): `make test` installs them, and a skipped client test would prove nothing.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::paths;

/// Longer than any plan the tests send takes (a few seconds), short enough that a hung client
/// fails the test instead of hanging it.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `tests/clients/<script>` with `args`, `plan` on stdin; returns its JSON output lines.
/// The environment is emptied first: no proxy variable, API key or base URL of the machine's
/// can steer the client anywhere but where `args` say.
pub fn run_client(script: &str, args: &[&str], plan: &Value) -> Vec<Value> {
    let path = paths::repo_root().join("tests/clients").join(script);
    assert!(path.is_file(), "client script {} missing", path.display());
    let mut child = Command::new(paths::python_bin())
        .arg(&path)
        .args(args)
        .env_clear()
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONNOUSERSITE", "1")
        .env("PYTHONIOENCODING", "utf-8")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", path.display()));
    let input = serde_json::to_vec(plan).expect("a plan serialises");
    if let Some(mut stdin) = child.stdin.take() {
        // A client that died at once (no SDK) closes stdin: its stderr tells why, below.
        let _ = stdin.write_all(&input);
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let status = wait_or_kill(&mut child, &path);
    let out = stdout.join().unwrap_or_default();
    let err = stderr.join().unwrap_or_default();
    assert!(
        status.success(),
        "{} failed ({status}):\n{err}\nstdout so far:\n{out}",
        path.display()
    );
    out.lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{}: output line {line:?}: {e}", path.display()))
        })
        .collect()
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

/// Waits for the client; one still running after [`CLIENT_TIMEOUT`] is killed and fails the test.
fn wait_or_kill(child: &mut Child, path: &Path) -> std::process::ExitStatus {
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{} still running after {CLIENT_TIMEOUT:?}: killed",
                    path.display()
                );
            }
            Err(e) => panic!("wait for {}: {e}", path.display()),
        }
    }
}
