"""Shared plumbing of the Python benchmark drivers (scripts/bench-affinity.py,
scripts/bench-overhead.py): where the binaries are, free ports, child processes that are always
stopped, Envoy start-up and its admin endpoints, and the SGLang model gateway (`smg`) as a peer
router, kept off the network. Standard library only: the drivers run with the system python3 on
a fresh machine.
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
# The SGLang model gateway, installed for benchmarks only by `scripts/install-tools.sh --bench`.
SMG = artifact("DP_AFFINITY_SMG", ".tools/venv/bin/smg")
SMG_VERSION = "0.3.2"


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

    def start(self, argv, log_path, stdout=None, env=None):
        logf = open(log_path, "wb")
        proc = subprocess.Popen(
            argv,
            stdout=stdout if stdout is not None else logf,
            stderr=logf,
            stdin=subprocess.DEVNULL,
            env=env,
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
        "--base-id", str(random.randint(1000, 60000)),
        # BENCH_ENVOY_LOG=debug shows the filter's placements (one line per request) in the log.
        "--log-level", "warn", "--component-log-level", f"wasm:{os.environ.get('BENCH_ENVOY_LOG', 'warn')}",
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


# --- the SGLang model gateway ----------------------------------------------------------------

# Every switch the gateway or the libraries inside it read to stay offline. Its Rust hub client
# does NOT honour HF_HUB_OFFLINE (it still calls the hub for a model id), so the real guarantee is
# that no model id ever reaches it: --tokenizer-path is a local file and the mock ranks report a
# local --model-path (the gateway loads a tokenizer from the path each worker reports).
GATEWAY_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "OTEL_SDK_DISABLED": "true",
}


def _byte_level_alphabet():
    """The 256 printable characters byte-level BPE tokenizers map bytes to (GPT-2's table):
    printable Latin-1 bytes stand for themselves, the others are shifted past 255."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in kept]
    chars = {b: chr(b) for b in kept}
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return [chars[b] for b in range(256)]


def write_local_tokenizer(directory):
    """Writes `directory/tokenizer.json`: a byte-level tokenizer with one token per byte (256
    tokens, no merges), in the Hugging Face `tokenizers` format the gateway reads. Made here so
    the gateway never fetches one; the mock counts tokens itself, so its ids never matter."""
    os.makedirs(directory, exist_ok=True)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": {c: i for i, c in enumerate(_byte_level_alphabet())},
            "merges": [],
        },
    }
    path = os.path.join(directory, "tokenizer.json")
    with open(path, "w") as f:
        json.dump(tokenizer, f)
    return path


def require_gateway():
    """Exits with the install command unless the pinned gateway is installed."""
    if not os.path.exists(SMG):
        sys.exit(f"smg (sglang-router=={SMG_VERSION}) not found at {SMG}: run `scripts/install-tools.sh --bench`")


def gateway_argv(policy, worker_urls, port, metrics_port, tokenizer, extra=()):
    """The `smg launch` command line of one gateway on 127.0.0.1:`port` routing to `worker_urls`
    with `policy`. Its Prometheus listener (default 0.0.0.0:29000) is moved to 127.0.0.1 on a free
    port, so two gateways can run side by side; the worker check runs every second instead of
    every 30 s; retries stay at the gateway's defaults (the bench counts an answer, not a try)."""
    return [
        SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy,
        "--tokenizer-path", tokenizer,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1",
        "--log-level", "warn", *extra,
    ]


def start_gateway(children, policy, worker_urls, workdir, name, tokenizer, env=None, extra=()):
    """Starts one gateway and waits until it lists every worker as healthy (GET /workers).
    Raises, with the log's path, when it exits or does not get there in 60 s: a peer that fails
    to start must fail the run, never drop out of the table. `env`: extra variables."""
    port, metrics = free_port(), free_port()
    argv = gateway_argv(policy, worker_urls, port, metrics, tokenizer, extra)
    log_path = os.path.join(workdir, f"{name}.log")
    with open(os.path.join(workdir, f"{name}.cmd"), "w") as f:
        f.write(" ".join(argv) + "\n")
    proc = children.start(argv, log_path, env={**os.environ, **GATEWAY_OFFLINE_ENV, **(env or {})})
    deadline = time.time() + 60
    healthy = 0
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}; see {log_path}")
        status, body = http_get(f"http://127.0.0.1:{port}/workers", timeout=1)
        if status == 200:
            workers = json.loads(body).get("workers", [])
            healthy = sum(1 for w in workers if w.get("is_healthy"))
            if healthy == len(worker_urls):
                return proc, port
        time.sleep(0.2)
    children.stop(proc)
    raise RuntimeError(f"smg has {healthy} of {len(worker_urls)} workers healthy after 60 s; see {log_path}")
