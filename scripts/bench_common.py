"""Shared plumbing of the Python benchmark drivers (scripts/bench-affinity.py,
scripts/bench-overhead.py): where the binaries are, free ports, child processes that are always
stopped, Envoy start-up and its admin endpoints. Standard library only: the drivers run with the
system python3 on a fresh machine.
"""

import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def artifact(env, default):
    """An artifact path from the environment (the Makefile exports them) or the default."""
    path = os.environ.get(env) or os.path.join(ROOT, default)
    return os.path.abspath(path)


ENVOY = artifact("DP_AFFINITY_ENVOY", ".tools/venv/bin/envoy")
WASM = artifact("DP_AFFINITY_WASM", "target/wasm32-wasip1/release/dp_affinity.wasm")
MOCK = artifact("DP_AFFINITY_MOCK", "target/release/mock-rank")
REPLAY = artifact("DP_AFFINITY_REPLAY", "target/release/dp-replay")


def log(tag, msg):
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def require(paths):
    """Exits with a clear message when a binary the run needs is missing."""
    for name, path, hint in paths:
        if not os.path.exists(path):
            sys.exit(f"{name} not found at {path}: run `{hint}`")


def free_port():
    """A TCP port free right now on 127.0.0.1 (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_line():
    cpus = os.cpu_count()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpus} CPUs, {model or 'unknown CPU'}, Linux {platform.release()}; load average at start {load}"


class Children:
    """Every process a run starts. `stop_all` (also on SIGINT/SIGTERM and at exit via `with`)
    terminates them and waits, so no Envoy or mock outlives the driver."""

    def __init__(self):
        self.procs = []

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        self.stop_all()
        return False

    def _on_signal(self, signum, _frame):
        self.stop_all()
        sys.exit(128 + signum)

    def start(self, argv, log_path, stdout=None):
        logf = open(log_path, "wb")
        proc = subprocess.Popen(
            argv,
            stdout=stdout if stdout is not None else logf,
            stderr=logf,
            stdin=subprocess.DEVNULL,
        )
        self.procs.append((proc, logf))
        return proc

    def stop(self, proc):
        for i, (p, logf) in enumerate(self.procs):
            if p is proc:
                _terminate(p)
                logf.close()
                del self.procs[i]
                return

    def stop_all(self):
        while self.procs:
            p, logf = self.procs.pop()
            _terminate(p)
            logf.close()


def _terminate(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def http_get(url, timeout=2.0):
    """(status, body text); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


def start_mock(children, args, log_path):
    """Starts a mock rank on a free port; returns (proc, port) once it listens."""
    proc = children.start([MOCK, "--port", "0", *args], log_path, stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("listening "):
        children.stop(proc)
        raise RuntimeError(f"mock-rank did not start ({line!r}); see {log_path}")
    return proc, int(line.rsplit(":", 1)[1])


def start_envoy(children, config_text, workdir, name, concurrency=2):
    """Writes the config, starts Envoy with its own base id, waits until its admin says LIVE."""
    cfg = os.path.join(workdir, f"{name}.yaml")
    with open(cfg, "w") as f:
        f.write(config_text)
    admin = _admin_port(config_text)
    argv = [
        ENVOY, "-c", cfg, "--concurrency", str(concurrency),
        "--base-id", str(random.randint(1000, 60000)), "--log-level", "warn",
    ]
    proc = children.start(argv, os.path.join(workdir, f"{name}.log"))
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}; see {workdir}/{name}.log")
        status, body = http_get(f"http://127.0.0.1:{admin}/ready", timeout=1)
        if status == 200 and "LIVE" in body:
            return proc, admin
        time.sleep(0.1)
    children.stop(proc)
    raise RuntimeError(f"envoy not ready after 30 s; see {workdir}/{name}.log")


def _admin_port(config_text):
    # The drivers write the admin block as `port_value: N` on the line after `admin:`.
    head = config_text.split("admin:", 1)[1]
    return int(head.split("port_value:", 1)[1].split("}", 1)[0].strip())


def filter_counters(admin):
    """The filter's counters from Envoy's admin (`wasmcustom.dp_affinity.*`), by short name."""
    status, body = http_get(f"http://127.0.0.1:{admin}/stats?format=json&filter=dp_affinity")
    if status != 200:
        return {}
    out = {}
    for stat in json.loads(body).get("stats", []):
        name = stat.get("name", "")
        if "value" in stat and "dp_affinity." in name:
            out[name.split("dp_affinity.", 1)[1]] = stat["value"]
    return out
