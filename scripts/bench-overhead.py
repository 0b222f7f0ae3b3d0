#!/usr/bin/env python3
"""What the filter costs per request, through a real Envoy against the same upstream.

One Envoy process (--concurrency 1, 127.0.0.1 only, no access log) with eight listeners. Seven of
them proxy to the same upstream (the seventh listener, U: Envoy's buffer filter reads the whole
request body, then a direct response answers 200), so every variant pays the same upstream hop
and the only difference is the filter chain in front of the router:

  A   plain Envoy: router -> upstream (the baseline of every ratio)
  N   a no-op proxy-wasm filter (scripts/bench-noop-wasm.sh): what any wasm filter costs here
  NB  the same no-op filter reading the whole body once: what any body-routing wasm filter costs
  NR  the same filter routing on the key header: reads it, sets the cluster header from a hash
      of it (Envoy picks the route again), no state: what any header-routing wasm filter costs
  B   dp_affinity (assign.mode hash, dp_size 4): the routing key from a header, or from the body
  P   dp_affinity as B with prefix placement on, sent bodies with no routing key: the prompt is
      hashed into blocks and matched against the prefix index (the keyless prefix path)
  H   Envoy's native hash routing: weighted_clusters + use_hash_policy on the key header
  G   not Envoy: the SGLang model gateway (`smg`, sglang-router pinned in install-tools.sh
      --bench) standalone, `--policy cache_aware` (its default) with listener U as its one worker,
      one tokio worker thread as Envoy has one: the per-request cost of the router users compare
      the filter with. It answers GET /v1/models itself, so it runs the body kinds only

Variants (wrk with a Lua script that every variant shares; keys from a set of 1000):
  header     GET with x-smg-routing-key            A, N, NR, B, H
  body-1k    POST a 1 KiB chat body, routing_key last (the whole body is scanned)   A, NB, B, P, G
  body-64k   the same at 64 KiB                                                     A, NB, B, P, G
  body-1m    the same at 1 MiB                                                      A, NB, B, P, G
P gets the same bodies without the routing_key member (16 distinct prompts, each resent).

Two loads, alternated in rounds (medians reported): `sat` (wrk -t1 -c16: the 2 cores saturated,
for requests/s) and `c1` (one connection: p50/p99 is the time a request takes, so B/A at p50 is
the filter's share). Ratios are to A measured in the same run: these machines are noisy.
The latency goals are judged on a third measurement, interleaved: one request in flight, the
variants of a request kind each on a keep-alive connection and sent in a shuffled order per
iteration (3000 iterations), so bursts of other work hit every variant alike; the added p50 is
the median of the per-iteration differences to A.
Goals: header path p50 <= 1.10 x A and at most 40 us added (B); 64 KiB body p50 <= 1.25 x A
(B); prefix placement at 64 KiB adds at most 100 us to plain Envoy's p50 (P).

  scripts/bench-overhead.py [--quick] [--out results]
"""

import argparse
import datetime
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from envoy_gen import cluster, wasm_filter  # noqa: E402

TAG = "bench-overhead"
KEYS = 1000
BODY_VARIANTS = 16
BODY_VARIANTS_RUN = ("A", "NB", "B", "P", "G")
SIZES = {"body-1k": 1024, "body-64k": 64 * 1024, "body-1m": 1024 * 1024}
GOALS = {"header": 1.10, "body-64k": 1.25}
# The keyless prefix path's goal: at most this much added to plain Envoy's p50, at 64 KiB.
PREFIX_GOAL_US = {"body-64k": 100}
# The placement issue's bound on the header path: at most this much added to plain Envoy's p50.
HEADER_GOAL_US = {"header": 40}
PREFIX_PLUGIN = {"dp_size": 4, "assign": {"mode": "hash"}, "prefix": {"enabled": True}}

LUA = r"""
-- args: mode (header | body), body file prefix, number of body files
local mode, bodies, nkeys = "header", {}, 1000
function init(args)
  mode = args[1]
  math.randomseed(os.time() + math.floor(os.clock() * 1e6))
  if mode == "body" then
    for i = 1, tonumber(args[3]) do
      local f = assert(io.open(args[2] .. i .. ".json", "rb"))
      bodies[i] = f:read("*a")
      f:close()
    end
  end
end
function request()
  if mode == "body" then
    return wrk.format("POST", "/v1/chat/completions",
      { ["content-type"] = "application/json" }, bodies[math.random(#bodies)])
  end
  local h = { ["x-smg-routing-key"] = "k-" .. math.random(nkeys) }
  if mode == "explicit" then h["x-data-parallel-rank"] = "1" end
  return wrk.format("GET", "/v1/models", h)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT rps=%.1f p50_us=%d p99_us=%d requests=%d errors=%d non2xx=%d\n",
    summary.requests / summary.duration * 1e6, latency:percentile(50), latency:percentile(99),
    summary.requests, e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def chat_body(size, key, conversation):
    """A chat-completions body of about `size` bytes with `routing_key` as the LAST member (none
    when `key` is None). The user text opens with the conversation's number, so prompts differ
    from their first block on."""
    head = ('{"model":"mock-model","messages":[{"role":"system","content":"You are a helpful assistant."},'
            f'{{"role":"user","content":"conversation {conversation}: ')
    tail = '"}],"max_tokens":16' + (f',"routing_key":"{key}"}}' if key is not None else "}")
    words = "the quick brown fox jumps over the lazy dog while \\\"quoted\\\" text\\n flows on "
    fill = size - len(head) - len(tail)
    text = (words * (fill // len(words) + 1))[:max(fill, 0)]
    text = text.rstrip("\\")  # never end the string on a lone backslash
    return head + text + tail


def listener(name, port, filters, routes):
    return f"""  - name: {name}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    per_connection_buffer_limit_bytes: 10485760
    enable_reuse_port: false
    connection_balance_config: {{ exact_balance: {{}} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""


def config(ports, admin, noop_wasm):
    plain = '              - match: { prefix: "/" }\n                route: { cluster: up, timeout: 0s }\n'
    filtered = (
        '              - match: { prefix: "/", headers: [ { name: x-dp-affinity-cluster, present_match: true } ] }\n'
        "                route: { cluster_header: x-dp-affinity-cluster, timeout: 0s }\n"
        "                request_headers_to_remove: [x-dp-affinity-cluster]\n" + plain
    )
    hashed = "".join(f"                    - {{ name: dp-rank-{r}, weight: 1 }}\n" for r in range(4))
    hashed = (
        '              - match: { prefix: "/" }\n                route:\n                  timeout: 0s\n'
        "                  hash_policy: [ { header: { header_name: x-smg-routing-key } } ]\n"
        "                  weighted_clusters:\n                    use_hash_policy: true\n"
        "                    clusters:\n" + hashed
    )
    upstream = (
        '              - match: { prefix: "/" }\n'
        '                direct_response: { status: 200, body: { inline_string: "{\\"ok\\":true}\\n" } }\n'
        "                response_headers_to_add: [ { header: { key: x-dp-rank, value: \"1\" } } ]\n"
    )
    buffer = """          - name: envoy.filters.http.buffer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: 4194304
"""
    # For exploring (never in a reported run): other plugin configurations for B and P.
    plugin = os.environ.get("BENCH_PLUGIN") or json.dumps({"dp_size": 4, "assign": {"mode": "hash"}})
    prefix_plugin = os.environ.get("BENCH_PREFIX_PLUGIN") or json.dumps(PREFIX_PLUGIN)
    listeners = (
        listener("plain", ports["A"], "", plain)
        + listener("noop", ports["N"], wasm_filter(noop_wasm, "{}", vm_id="noop"), plain)
        + listener("noopbody", ports["NB"], wasm_filter(noop_wasm, "body", vm_id="noopbody"), plain)
        + listener("nooproute", ports["NR"], wasm_filter(noop_wasm, "route", vm_id="nooproute"),
                   filtered)
        + listener("filter", ports["B"], wasm_filter(bc.WASM, plugin), filtered)
        + listener("prefix", ports["P"], wasm_filter(bc.WASM, prefix_plugin, vm_id="prefix"),
                   filtered)
        + listener("hash", ports["H"], "", hashed)
        + listener("upstream", ports["U"], buffer, upstream)
    )
    clusters = cluster("up", [ports["U"]]) + "".join(cluster(f"dp-rank-{r}", [ports["U"]]) for r in range(4))
    return f"""# Generated by scripts/bench-overhead.py.
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
{listeners}  clusters:
{clusters}"""


def wrk(port, mode, load, secs, workdir, body_prefix=""):
    flags = ["-t1", "-c16"] if load == "sat" else ["-t1", "-c1"]
    lua = os.path.join(workdir, "overhead.lua")
    argv = ["wrk", *flags, f"-d{secs}s", "--latency", "-s", lua, f"http://127.0.0.1:{port}",
            "--", mode, body_prefix, str(BODY_VARIANTS)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=secs + 60)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk gave no RESULT line: {out.stdout[-500:]} {out.stderr[-500:]}")
    return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def http_request(variant_mode, body, key):
    """The bytes of one request: a GET with a routing-key header, or a POSTed chat body."""
    if variant_mode == "header":
        return (f"GET /v1/models HTTP/1.1\r\nhost: bench\r\nx-smg-routing-key: {key}\r\n\r\n").encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


class Connection:
    """One keep-alive HTTP/1.1 connection; `exchange` sends a request and reads the whole answer
    (the upstream's direct response always carries content-length)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def exchange(self, request):
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, rest = self.buf.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            rest += self._recv()
        self.buf = rest[length:]
        return status

    def _recv(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise RuntimeError("connection closed by Envoy")
        return chunk

    def close(self):
        self.sock.close()


def interleaved(ports, size, keys, requests, iterations, rng):
    """Latency of each variant in `keys` (µs per request), one request in flight, the variants
    interleaved request by request in a shuffled order per iteration: a burst of other work on the
    machine hits every variant alike. Returns {variant: [µs, ...]} (index = iteration)."""
    conns = {k: Connection(ports[k]) for k in keys}
    lat = {k: [] for k in keys}
    try:
        order = list(keys)
        for i in range(iterations):
            rng.shuffle(order)
            for k in order:
                req = requests[k][i % len(requests[k])]
                t0 = time.perf_counter_ns()
                status = conns[k].exchange(req)
                lat[k].append((time.perf_counter_ns() - t0) / 1000)
                if status != 200:
                    raise RuntimeError(f"{size} {k}: status {status}")
    finally:
        for c in conns.values():
            c.close()
    return lat


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def interleaved_sets(only=None):
    """(request kind, variants) measured interleaved, for the latency goals."""
    out = [("header", ("A", "N", "NR", "B", "H"))]
    out += [(size, BODY_VARIANTS_RUN) for size in SIZES if not only or size in only]
    return out


def variants(only=None):
    out = [("header", k, os.environ.get("BENCH_HEADER_MODE", "header")) for k in ("A", "N", "NR", "B", "H")]
    for size in SIZES:
        if only and size not in only:
            continue
        out += [(size, k, "body") for k in BODY_VARIANTS_RUN]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round of short runs: for checking the harness")
    ap.add_argument("--out", default=os.path.join(bc.ROOT, "results"))
    ap.add_argument("--sizes", help="comma-separated body sizes to run besides the header path "
                    "(body-1k,body-64k,body-1m; default all)")
    args = ap.parse_args()
    bc.require([("envoy", bc.ENVOY, "make tools"), ("wasm", bc.WASM, "make build")])
    bc.require_gateway()
    if shutil.which("wrk") is None:
        bc.log(TAG, "installing wrk (apt-get)")
        subprocess.run("apt-get update -qq && apt-get install -y -qq wrk", shell=True, check=True,
                       stdout=sys.stderr)
    # Many short rounds rather than a few long ones, every variant once per round: a median over
    # rounds shrugs off the bursts of other work on the shared cores, and a variant's latency is
    # compared with plain Envoy's in the same round (paired), so slow drifts of the machine
    # cancel out.
    sat_s, c1_s, sat_rounds, c1_rounds, warm = (2, 2, 1, 1, 1) if args.quick else (2, 1, 2, 4, 1)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    workdir = os.path.join(args.out, f"overhead-{stamp}")
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "overhead.lua"), "w") as f:
        f.write(LUA)
    rng = random.Random(3)
    for name, size in SIZES.items():
        for i in range(1, BODY_VARIANTS + 1):
            key = f"conv-{rng.getrandbits(64):016x}"
            for suffix, body in (("", chat_body(size, key, i)), ("nokey-", chat_body(size, None, i))):
                json.loads(body)  # the bench must send valid JSON, or it measures the malformed path
                with open(os.path.join(workdir, f"{name}-{suffix}{i}.json"), "w") as f:
                    f.write(body)
    noop = subprocess.run(["bash", os.path.join(bc.ROOT, "scripts/bench-noop-wasm.sh")],
                          capture_output=True, text=True, check=True).stdout.strip()
    ports = {k: bc.free_port() for k in ("A", "N", "NB", "NR", "B", "P", "H", "U")}
    tokenizer = bc.write_local_tokenizer(os.path.join(workdir, "tokenizer"))
    began = time.time()
    results = []
    interleaved_results = {}
    il_iterations = 300 if args.quick else 3000
    with bc.Children() as children:
        # One worker: a request, its upstream hop and the upstream's answer all run on one thread,
        # for every variant. With two workers, whether a cluster's upstream connection was
        # accepted by the same worker as the client's is chance, and a cross-thread hop costs
        # 100-250 µs on these VMs: that chance, not the filter, decided the differences.
        proc, admin = bc.start_envoy(children, config(ports, bc.free_port(), noop), workdir, "envoy",
                                     concurrency=1)
        # The gateway's own worker check asks U for /health, /server_info and /model_info: U's
        # direct response answers them all 200 with a JSON object, which registers it.
        gateway, ports["G"] = bc.start_gateway(children, "cache_aware", [f"http://127.0.0.1:{ports['U']}"],
                                               workdir, "smg", tokenizer, env={"TOKIO_WORKER_THREADS": "1"})
        hz = os.sysconf("SC_CLK_TCK")

        def cpu(key):
            # G's requests cost the gateway and Envoy's listener U; every other variant's, Envoy.
            return cpu_ticks(proc.pid) + (cpu_ticks(gateway.pid) if key == "G" else 0)

        def run(size, key, mode, load, secs, label):
            prefix = os.path.join(workdir, f"{size}-{'nokey-' if key == 'P' else ''}") if mode == "body" else ""
            t0 = cpu(key)
            r = wrk(ports[key], mode, load, secs, workdir, prefix)
            r["cpu_us"] = (cpu(key) - t0) / hz * 1e6 / max(r["requests"], 1)
            r.update(size=size, variant=key, load=load, label=label)
            bc.log(TAG, f"{load:3} {size:8} {key} {label:7} {r['rps']:8.0f} req/s  p50 {r['p50_us']:6.0f} µs  "
                        f"p99 {r['p99_us']:6.0f} µs  cpu {r['cpu_us']:5.1f} µs/req  errors {r['errors']:.0f}")
            return r

        only = args.sizes.split(",") if args.sizes is not None else None
        for size, key, mode in variants(only):
            run(size, key, mode, "sat", warm, "warmup")
        for load, secs, rounds in (("sat", sat_s, sat_rounds), ("c1", c1_s, c1_rounds)):
            for rnd in range(rounds):
                for size, key, mode in variants(only):
                    results.append(run(size, key, mode, load, secs, f"round{rnd + 1}"))
        # The latency goals: every variant interleaved with plain Envoy, request by request.
        il_rng = random.Random(5)
        for size, keys in interleaved_sets(only):
            reqs = {}
            for k in keys:
                if size == "header":
                    reqs[k] = [http_request("header", b"", f"k-{j}") for j in range(1, KEYS + 1)]
                else:
                    stem = f"{size}-{'nokey-' if k == 'P' else ''}"
                    reqs[k] = [http_request("body", open(os.path.join(workdir, f"{stem}{j}.json"), "rb").read(), "")
                               for j in range(1, BODY_VARIANTS + 1)]
            n = il_iterations // (8 if size == "body-1m" else 1)
            t0 = time.time()
            lat = interleaved(ports, size, keys, reqs, n, il_rng)
            interleaved_results[size] = lat
            bc.log(TAG, f"interleaved {size:8} {n} × {len(keys)} requests in {time.time() - t0:.0f} s: " + "  ".join(
                f"{k} p50 {statistics.median(v):.0f} µs" for k, v in lat.items()))
        counters = bc.filter_counters(admin)
    with open(os.path.join(workdir, "interleaved.json"), "w") as f:
        json.dump(interleaved_results, f)
    report = markdown(results, counters, {
        "date": stamp, "machine": bc.machine_line(), "total_s": time.time() - began,
        "command": "scripts/bench-overhead.py" + (" --quick" if args.quick else ""),
        "runs": f"sat {sat_rounds} × {sat_s} s, c1 {c1_rounds} × {c1_s} s, interleaved {il_iterations} requests "
                f"per variant (1 MiB: {il_iterations // 8})",
        "interleaved": interleaved_results,
        "workdir": os.path.relpath(workdir, bc.ROOT),
    })
    with open(os.path.join(args.out, f"overhead-{stamp}.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, f"overhead-{stamp}.json"), "w") as f:
        json.dump({"results": results, "filter_counters": counters}, f, indent=1)
    print(report)


def median_of(results, size, key, load, field):
    vals = [r[field] for r in results if (r["size"], r["variant"], r["load"]) == (size, key, load)]
    return statistics.median(vals) if vals else None


def paired(lat, key):
    """(variant p50, median of the per-iteration ratios to A, median of the per-iteration
    differences to A, p90) of an interleaved run, in µs. Paired statistics: on a shared VM the
    latency of one request is bimodal (a descheduled vCPU wakes up late), so two variants' own
    medians can land in different modes while their per-iteration comparison stays stable."""
    mine, base = lat[key], lat["A"]
    p50 = statistics.median(mine)
    p90 = statistics.quantiles(mine, n=10)[-1]
    ratio = statistics.median(m / a for m, a in zip(mine, base) if a > 0)
    return p50, ratio, statistics.median(m - a for m, a in zip(mine, base)), p90


def noise_lines(results):
    """How far plain Envoy's own rounds differ: above 15 % the run is flagged as noisy."""
    out = []
    for load, field, what in (("sat", "rps", "req/s"), ("c1", "p50_us", "p50")):
        for size in ["header", *SIZES]:
            vals = [r[field] for r in results if (r["size"], r["variant"], r["load"]) == (size, "A", load)]
            if len(vals) < 2 or min(vals) <= 0:
                continue
            spread = max(vals) / min(vals) - 1
            if spread > 0.15:
                out.append(f"- **noisy**: plain Envoy's {what} ({load}, {size}) differs by {spread:.0%} between rounds")
    return out or ["- plain Envoy's rounds agree within 15 % (req/s and p50, every request kind)"]


NAMES = {"A": "plain Envoy", "N": "no-op wasm filter", "NB": "no-op wasm filter reading the body",
         "NR": "no-op wasm filter routing on the key header",
         "B": "dp_affinity", "P": "dp_affinity, prefix on, no key", "H": "Envoy native hash",
         "G": f"SGLang model gateway {bc.SMG_VERSION}, cache_aware"}


def markdown(results, counters, meta):
    lines = [
        "## Overhead through Envoy (same upstream)", "",
        f"- date: {meta['date']}; machine: {meta['machine']}",
        f"- command: `{meta['command']}` ({meta['runs']}); total {meta['total_s']:.0f} s; raw data in `{meta['workdir']}`",
        "- one Envoy (--concurrency 1): listeners A plain, N no-op wasm, NB no-op wasm reading the body,",
        "  NR no-op wasm setting the cluster header from a hash of the key header (no state),",
        "  B dp_affinity, P dp_affinity with prefix placement (keyless bodies), H native hash, all proxying",
        "  to listener U of the same process (buffer filter + direct response); clients on the same 2 cores",
        "- G: the SGLang model gateway standalone (`smg launch --policy cache_aware`, one tokio worker",
        "  thread), listener U its one worker; its CPU/req counts the gateway and Envoy (U)",
        "",
        "**Latency, interleaved** (the goals): one request in flight, every variant of a request kind",
        "on its own keep-alive connection, requests sent in a shuffled variant order per iteration, so a",
        "burst of other work on the machine hits all variants alike; × A and Δp50 are the medians over",
        "iterations of variant ÷ and − plain Envoy in the same iteration (the goals use these).",
        "", "| request | variant | p50 | × A | Δp50 | p90 | goal |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for size, lat in meta["interleaved"].items():
        for key in lat:
            p50, ratio, added, p90 = paired(lat, key)
            goal = ""
            if key == "B" and size in GOALS:
                goal = f"{'met' if ratio <= GOALS[size] else '**missed**'} (p50 ≤ {GOALS[size]:.2f}×)"
            if key == "B" and size in HEADER_GOAL_US:
                bound = HEADER_GOAL_US[size]
                goal += f"; {'met' if added <= bound else '**missed**'} (Δp50 ≤ {bound} µs)"
            if key == "P" and size in PREFIX_GOAL_US:
                bound = PREFIX_GOAL_US[size]
                goal = f"{'met' if added <= bound else '**missed**'} (Δp50 ≤ {bound} µs)"
            lines.append(f"| {size} | {key} {NAMES[key]} | {p50:.0f} µs | {ratio:.2f} | {added:+.0f} µs "
                         f"| {p90:.0f} µs | {goal} |")
    lines += [
        "",
        "**Throughput and tails, wrk** (alternated in rounds, medians): req/s from `wrk -t1 -c16`",
        "(saturated), p50/p99 and CPU per request from `wrk -t1 -c1`; × A = ratio to plain",
        "Envoy with the same request in the same run.",
        "", "| request | variant | req/s | × A | p50 | p99 | × A | CPU/req (Envoy; G: + gateway) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size in ["header", *SIZES]:
        base = {f: median_of(results, size, "A", l, f) for f, l in (("rps", "sat"), ("p99_us", "c1"))}
        for key in ("A", "N", "NB", "NR", "B", "P", "H", "G"):
            rps = median_of(results, size, key, "sat", "rps")
            if rps is None:
                continue
            p50 = median_of(results, size, key, "c1", "p50_us")
            p99 = median_of(results, size, key, "c1", "p99_us")
            cpu = median_of(results, size, key, "c1", "cpu_us")
            lines.append(
                f"| {size} | {key} {NAMES[key]} | {rps:.0f} | {rps / base['rps']:.2f} | {p50:.0f} µs "
                f"| {p99:.0f} µs | {p99 / base['p99_us']:.2f} | {cpu:.1f} µs |"
            )
    lines += [""] + noise_lines(results)
    lines += ["", "Filter counters over the whole run (B and P): " + ", ".join(
        f"{k} {v}" for k, v in sorted(counters.items()) if v), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
