#!/usr/bin/env python3
"""What affinity buys: prefix-cache hit rate, balance and latency of each routing policy on the
same multi-turn workload, through a real Envoy in front of mock ranks that simulate a prefix cache.

For every configuration and every policy: fresh mock ranks (empty caches) are started, Envoy with
the policy's config in front of them (or, for the `gateway-*` peers, the SGLang model gateway
`smg`), and `dp-replay run` replays the workload's trace open-loop (same trace, same arrival times
for every policy). The offline oracle (`dp-replay oracle`: one unlimited cache shared by every
request, the upper bound of any placement) gives the denominator of "hit rate / oracle".

The peer router: the SGLang model gateway (PyPI `sglang-router`, pinned in
scripts/install-tools.sh, installed by `scripts/install-tools.sh --bench`) in front of the same
mock ranks, with its cache-aware policy (no key) and its manual policy (the session key in
`x-smg-routing-key`). It runs offline: a tokenizer made locally (bench_common), no model id
anywhere (BENCHMARKS.md says how that was checked).

Suites:
  keyed   every request carries its session's routing key (header): 4 ranks, 8 ranks, 4 ranks
          behind 2 Envoy replicas, 4 ranks with small caches
  prefix  no routing key at all: the shipped filter and its prompt-prefix index vs session keys
          vs round robin, on the synthetic chat workload (4 and 8 ranks, one and 2 Envoy replicas)
          and on a block-id trace (4 ranks)
  kv      the shape of public multi-turn KV-cache traces (one shared 2 KiB system prompt, long
          one- and two-turn sessions, a few long conversations, shared documents), with and
          without session keys, at 4 and 8 ranks and behind 2 Envoy replicas (not in `all`);
          streamed answers, replayed at the arrival rate that keeps the ranks about 80 % busy
          under Envoy round robin (see `load_speed`), so time to first byte is a latency at load

Writes results/affinity-<UTC>.md (the report, also printed), .json (every figure) and .svg (the
chart), with traces, per-request records and Envoy logs under results/affinity-<UTC>/.

  scripts/bench-affinity.py                  # both suites (`make bench` runs this)
  scripts/bench-affinity.py --suite keyed    # one suite
  scripts/bench-affinity.py --quick          # 4 ranks, 4 policies (one keyless), a short workload
  scripts/bench-affinity.py --quick --check
      # the smoke test of `make test`: fails (exit 1) unless every run completed without errors
      # and the filter's token hit rate beats Envoy round robin. Never a timing assertion.
  scripts/bench-affinity.py --suite prefix --trace FILE
      # the prefix suite on your own JSONL trace (e.g. a public block-id KV-cache trace)
"""

import argparse
import collections
import datetime
import json
import os
import random
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import envoy_gen  # noqa: E402
import report_svg  # noqa: E402

TAG = "bench-affinity"


def shipped_plugin(ranks):
    """envoy/envoy.yaml's plugin configuration (JSON text) for `ranks` ranks; its
    learn.upstream_addresses name the shipped ports, not the run's, so they go (the filter
    places every request itself, so nothing is learned from addresses)."""
    import yaml
    with open(os.path.join(bc.ROOT, "envoy", "envoy.yaml")) as f:
        cfg = yaml.safe_load(f)
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net in chain["filters"]:
                for http in net["typed_config"].get("http_filters", []):
                    conf = http.get("typed_config", {}).get("config", {}).get("configuration", {})
                    if "value" in conf:
                        plugin = json.loads(conf["value"])
                        plugin["dp_size"] = ranks
                        plugin.setdefault("learn", {})["upstream_addresses"] = {}
                        return json.dumps(plugin)
    raise RuntimeError("envoy/envoy.yaml: no wasm plugin configuration found")


def policy(desc, assign=None, keys="header", prefix=None, gateway=None, gateway_args=()):
    """assign: the plugin's `assign` section (None: Envoy without the filter); keys: how
    dp-replay sends the routing key (header | none); prefix: the plugin's `prefix` section;
    gateway: the SGLang model gateway's `--policy`, in place of Envoy, with `gateway_args`."""
    return {"desc": desc, "assign": assign, "keys": keys, "prefix": prefix, "gateway": gateway,
            "gateway_args": list(gateway_args)}


BOUNDED = {"mode": "hash", "min_capacity": 4}
# Key-only placements: the prompt-prefix index (on by default) off.
NO_PREFIX = {"enabled": False}
# The plugin configuration of envoy/envoy.yaml as shipped (read from the file at run time, with
# the run's dp_size): what a user gets without changing anything.
SHIPPED = "shipped"
POLICIES = {
    "filter-shipped": policy(
        "dp_affinity exactly as in the shipped envoy/envoy.yaml (the defaults: hash homes, prompt prefix), NO routing key",
        SHIPPED, keys="none"),
    "filter-shipped-keyed": policy(
        "dp_affinity exactly as in the shipped envoy/envoy.yaml, with session keys", SHIPPED),
    "filter-learn": policy("dp_affinity: Envoy picks new keys (LEAST_REQUEST), the filter learns and pins",
                           {"mode": "envoy"}, prefix=NO_PREFIX),
    "filter-hash": policy("dp_affinity: rendezvous hash of the key, no load bound",
                          {"mode": "hash", "load_factor": 100, "pinned_load_factor": 100}, prefix=NO_PREFIX),
    "filter-hash-bounded": policy(
        "dp_affinity: rendezvous hash + bounded load (c = 1.25, floor 4 = the engine's batch)", BOUNDED,
        prefix=NO_PREFIX),
    "filter-prefix": policy(
        "dp_affinity, NO routing key: prompt-prefix index + bounded load (c = 1.25, floor 4)",
        BOUNDED, keys="none", prefix={"enabled": True}),
    "filter-prefix-keyed": policy(
        "dp_affinity with session keys AND the prompt-prefix index (bounded hash)",
        BOUNDED, keys="header", prefix={"enabled": True}),
    "envoy-rr": policy("Envoy ROUND_ROBIN over all ranks"),
    "envoy-lr": policy("Envoy LEAST_REQUEST over all ranks"),
    "envoy-hash": policy("Envoy weighted_clusters + use_hash_policy on the key header"),
    "gateway-cache-aware": policy(
        f"SGLang model gateway (sglang-router {bc.SMG_VERSION}) `--policy cache_aware`, NO routing key: "
        "its approximate radix tree of the prompts each worker was sent, balanced by load", keys="none",
        gateway="cache_aware"),
    # The gateway balances by load only once a worker has `--balance-abs-threshold` (default 64)
    # more requests than another and 1.5 times as many, which ranks serving 4 at a time never
    # reach: this variant sets it to the mock's 4 slots, so its load balancing can act here.
    "gateway-cache-aware-4": policy(
        f"SGLang model gateway (sglang-router {bc.SMG_VERSION}) `--policy cache_aware "
        "--balance-abs-threshold 4`, NO routing key: balancing by load from a difference "
        "of one rank's slots", keys="none", gateway="cache_aware",
        gateway_args=["--balance-abs-threshold", "4"]),
    "gateway-manual": policy(
        f"SGLang model gateway (sglang-router {bc.SMG_VERSION}) `--policy manual`: the session key in "
        f"`{envoy_gen.ROUTING_KEY_HEADER}`, a new key to a random worker, then pinned", gateway="manual"),
}
# For exploring knobs (never in a reported run): BENCH_PREFIX_SET='{"assign": {...}, "prefix": {...}}'
# is merged into filter-prefix's sections.
if os.environ.get("BENCH_PREFIX_SET"):
    for section, extra in json.loads(os.environ["BENCH_PREFIX_SET"]).items():
        POLICIES["filter-prefix"][section] = {**(POLICIES["filter-prefix"][section] or {}), **extra}
KEYED_ALL = ["filter-learn", "filter-hash", "filter-hash-bounded", "envoy-rr", "envoy-lr", "envoy-hash"]
# The SGLang model gateway as a peer: keyless (cache-aware) and keyed (manual).
GATEWAY = ["gateway-cache-aware", "gateway-manual"]
PREFIX_ALL = ["filter-shipped", "filter-prefix", "filter-hash-bounded", "envoy-rr", *GATEWAY]
PREFIX_SHORT = ["filter-shipped", "filter-prefix", "envoy-rr", "gateway-cache-aware"]
# The KV-cache-trace suite: keyless and keyed placements, Envoy's own policies and the gateway.
KV_ALL = ["filter-shipped", "filter-shipped-keyed", "filter-prefix", "filter-prefix-keyed", "filter-hash-bounded",
          "envoy-hash", "envoy-lr", "envoy-rr", *GATEWAY, "gateway-cache-aware-4"]
KV_AGENT = ["filter-shipped", "filter-shipped-keyed", "envoy-hash", "envoy-rr", "gateway-cache-aware",
            "gateway-cache-aware-4"]
KV_REPLICAS = ["filter-shipped", "filter-shipped-keyed", "filter-prefix", "filter-prefix-keyed",
               "filter-hash-bounded", "envoy-rr", *GATEWAY, "gateway-cache-aware-4"]

# The mock ranks' engine model, the same for every run: 16-token blocks; prefill 50 us per uncached
# prompt token, decode 3 ms per output token; 4 requests served at once per rank (more queue); a
# per-rank cache sized from the workload (see cache_blocks). Scaled down from a real engine so a
# run takes seconds, with the same shape: a cache hit saves prefill time, an overloaded rank queues.
BLOCK_TOKENS = 16
# How dp-replay sends block-id prompts (`--blocks-as`): a completions prompt, or one user message.
BLOCKS_AS = "text"
PREFILL_US, DECODE_US, SLOTS = 50, 3000, 4
# The tuned gateway's threshold is one rank's slots.
assert POLICIES["gateway-cache-aware-4"]["gateway_args"] == ["--balance-abs-threshold", str(SLOTS)]
MOCK_MODEL = ["--prefill-us-per-token", str(PREFILL_US), "--decode-us-per-token", str(DECODE_US),
              "--max-concurrency", str(SLOTS)]
# The kv suite's load: Envoy round robin keeps the ranks this busy (see load_speed).
# BENCH_KV_BUSY overrides it (for exploring other loads, not reported).
KV_BUSY = float(os.environ.get("BENCH_KV_BUSY", "0.8"))
# A public trace in the kv suite (`--suite kv --trace FILE`): the keyless policies, and the keyed
# ones when every request of the trace names its session.
KV_TRACE_KEYLESS = ["filter-shipped", "envoy-lr", "envoy-rr", "gateway-cache-aware", "gateway-cache-aware-4"]
KV_TRACE_KEYED = ["filter-shipped-keyed", "envoy-hash", "gateway-manual"]


def trace_has_keys(path):
    """Whether every request of a JSONL trace has a session key."""
    with open(path) as f:
        return all("key" in json.loads(line) for line in f if line.strip())


def chat_workload(ranks, quick):
    """`dp-replay synth` flags. Sessions and their arrival rate scale with the rank count, so each
    rank sees the same load whatever the configuration. `BENCH_CHAT_SYSTEM_TOKENS` (default 1000)
    sets the system prompts' size: 0 gives chats without one, whose first turns are often shorter
    than a prefix block."""
    return [
        "--seed", "7",
        "--tenants", str(ranks),
        "--sessions", str((16 if quick else 32) * ranks),
        "--session-rate", str(4.0 * ranks),
        "--max-turns", "12",
        "--zipf", "0.8",
        "--system-tokens", os.environ.get("BENCH_CHAT_SYSTEM_TOKENS", "1000"),
        "--user-tokens", "120",
        "--output-tokens", "48",
        "--think-ms", "400",
        "--response-ms", "150",
    ]


def id_source():
    """fresh(n): the next n block ids, never used before in this trace."""
    next_id = [1]

    def fresh(n):
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    return fresh


def block_trace(path, ranks, seed=11):
    """A block-id trace in the shape of public KV-cache traces (Mooncake: `timestamp`, `hash_ids`,
    `output_length`), written deterministically: per session a system prompt of 48 blocks shared by
    its tenant, often one of 12 shared documents (Zipf-like popularity, 24-96 blocks), then turns
    that each append 6-12 new blocks. No routing key: sharing is visible only in the blocks."""
    rng = random.Random(seed)
    fresh = id_source()

    tenants = [fresh(48) for _ in range(ranks)]
    docs = [fresh(rng.randint(24, 96)) for _ in range(12)]
    doc_weights = [1.0 / (i + 1) for i in range(len(docs))]
    lines, start = [], 0.0
    # 64 sessions per rank (~600 requests on 4 ranks): most sessions are one or two turns, and a
    # shorter trace would leave the max/mean balance figure to chance (±10 % per rank at 75
    # requests per rank).
    for s in range(64 * ranks):
        start += rng.expovariate(4.0 * ranks) * 1000.0
        prefix = list(rng.choice(tenants))
        if rng.random() < 0.7:
            prefix += rng.choices(docs, doc_weights)[0]
        t = start
        for _ in range(min(12, int(rng.paretovariate(1.2)))):
            prefix += fresh(rng.randint(6, 12))
            lines.append({"timestamp": round(t, 1), "hash_ids": list(prefix), "output_length": 48,
                          "key": f"b-s{s}"})
            prefix += fresh(3)  # the answer, resent in the next turn
            t += 550.0 + rng.expovariate(1 / 400.0)
    write_trace(path, lines)


def add_session(lines, rng, fresh, key, prompt, start, turns, added, gap):
    """Appends a session's turns to `lines`: each resends the prompt so far, then adds the answer
    (4 blocks) and the next message (`added`: a block-count range); turns are `gap[0]` ms plus an
    exponential of mean `gap[1]` ms apart."""
    prompt, t = list(prompt), start
    for _ in range(turns):
        lines.append({"timestamp": round(t, 1), "hash_ids": list(prompt), "output_length": 32,
                      "key": key})
        prompt += fresh(4)  # the answer, resent in the next turn
        prompt += fresh(rng.randint(*added))
        t += gap[0] + rng.expovariate(1 / gap[1])


def write_trace(path, lines):
    """Writes a block-id trace (one JSON object a line) in arrival order."""
    lines.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def kv_trace(path, ranks, seed=None):
    """A block-id trace in the shape of public multi-turn KV-cache traces, harder on placement
    than `block_trace`: ONE system prompt of 32 blocks (2 KiB of text) opens every request, so
    a prefix match on it says nothing about where a conversation belongs; most sessions are one
    or two turns whose first prompt is long (150-700 blocks, 10-45 KiB); a few conversations go
    on for 6-20 turns; 15 % of sessions open with one of 8 shared documents (40-160 blocks). The
    arrival rate scales with the rank count. The seed is 23 unless `BENCH_KV_SEED` says
    otherwise (another sample of the same shape, to tell a rule's effect from one trace's luck)."""
    rng = random.Random(int(os.environ.get("BENCH_KV_SEED", "23")) if seed is None else seed)
    fresh = id_source()

    system = fresh(32)
    docs = [fresh(rng.randint(40, 160)) for _ in range(8)]
    lines, start = [], 0.0
    for s in range(48 * ranks):
        start += rng.expovariate(1.5 * ranks) * 1000.0
        prompt = list(system)
        if rng.random() < 0.15:
            prompt += rng.choice(docs)
        prompt += fresh(rng.randint(150, 700))
        u = rng.random()
        turns = 1 if u < 0.55 else 2 if u < 0.85 else 3 if u < 0.94 else rng.randint(6, 20)
        add_session(lines, rng, fresh, f"kv-s{s}", prompt, start, turns, added=(8, 40),
                    gap=(800.0, 600.0))
    write_trace(path, lines)


def agent_trace(path, ranks, seed=None):
    """A block-id trace of agent loops behind one long shared prompt: every request opens with the
    same 96 KiB (1536 blocks: the instructions and tool definitions of a coding agent, ~24k
    tokens), then its session's own task (0.5-4 KiB); each of a session's 3-12 turns adds the
    model's answer and a tool result (1-8 KiB), 0.3-2 s apart. What it tests: a shared prefix
    longer than many a router hashes, and conversations whose own part is a small tail behind it.
    The seed is 7 unless `BENCH_KV_SEED` says otherwise."""
    rng = random.Random(int(os.environ.get("BENCH_KV_SEED", "7")) if seed is None else seed)
    fresh = id_source()
    system = fresh(1536)
    lines, start = [], 0.0
    for s in range(24 * ranks):
        start += rng.expovariate(0.8 * ranks) * 1000.0
        prompt = system + fresh(rng.randint(8, 64))
        add_session(lines, rng, fresh, f"ag-s{s}", prompt, start, rng.randint(3, 12),
                    added=(16, 128), gap=(300.0, 700.0))
    write_trace(path, lines)


def configurations(suite, quick, trace):
    """Dicts: label, ranks, replicas, cache scale (1: the ranks together can hold every distinct
    block once; 0.25: a quarter of that), workload (chat | blocks | a trace file), policies, goal
    (hit share of the oracle, the largest max/mean, of which figure)."""
    # Keyed: the first affinity issue's mark (requests per rank). Without a key: the placement
    # issue's (≥ 0.98 × oracle at ≤ 1.10 max/mean prompt tokens per rank).
    keyed_goal, prefix_goal = (0.97, 1.15, "max_mean_requests"), (0.98, 1.10, "max_mean_tokens")

    def cfg(label, ranks, policies, goal, replicas=1, scale=1.0, workload="chat", busy=None):
        """busy: replay at the speed that keeps the ranks this busy under Envoy round robin,
        with streamed answers (time to first byte = queue + prefill); None: the trace's own
        arrival times, answers not streamed."""
        return {"label": label, "ranks": ranks, "replicas": replicas, "scale": scale,
                "workload": workload, "policies": policies, "goal": goal, "busy": busy}

    if quick:
        return [cfg("4 ranks", 4, ["filter-hash-bounded", "filter-learn", "filter-prefix", "envoy-rr"], keyed_goal)]
    out = []
    if suite in ("keyed", "all"):
        # Every policy at 4 ranks; at 8 ranks, with replicas and with small caches the ones whose
        # figures move there (the others repeat a 4-rank row): make bench stays under 10 minutes.
        out += [
            cfg("4 ranks", 4, KEYED_ALL, keyed_goal),
            cfg("8 ranks", 8, ["filter-learn", "filter-hash-bounded", "envoy-lr", "envoy-hash"], keyed_goal),
            cfg("4 ranks, 2 Envoy replicas", 4, ["filter-learn", "filter-hash-bounded"], keyed_goal, replicas=2),
            cfg("4 ranks, caches 1/4 the size", 4, ["filter-hash-bounded", "envoy-lr"], keyed_goal, scale=0.25),
        ]
    if suite in ("prefix", "all"):
        if trace:
            # The shipped filter with the trace's own keys too, when it has them (a key per
            # session, or one many sessions share: scripts/rekey-trace.py).
            keyed = ["filter-shipped-keyed"] if trace_has_keys(trace) else []
            out.append(cfg(f"4 ranks, {os.path.basename(trace)}", 4, PREFIX_ALL + keyed, prefix_goal,
                           workload=trace))
            out.append(cfg(f"4 ranks, 2 Envoy replicas, {os.path.basename(trace)}", 4,
                           ["filter-shipped", *keyed, "envoy-rr"], prefix_goal, replicas=2, workload=trace))
        else:
            out += [
                cfg("no routing key, 4 ranks", 4, PREFIX_ALL, prefix_goal),
                cfg("no routing key, 8 ranks", 8, PREFIX_SHORT, prefix_goal),
                # Chat conversations reach either replica at random: a conversation's anchor must
                # be the same on both (see README, "Prefix placement").
                cfg("no routing key, 4 ranks, 2 Envoy replicas", 4, ["filter-shipped", "filter-prefix", "envoy-rr"],
                    prefix_goal, replicas=2),
                cfg("no routing key, 8 ranks, 2 Envoy replicas", 8, ["filter-shipped", "envoy-rr", "gateway-cache-aware"],
                    prefix_goal, replicas=2),
                cfg("no routing key, block-id trace, 4 ranks", 4, PREFIX_ALL, prefix_goal, workload="blocks"),
            ]
    # A public block-id trace (see scripts/convert-trace.py) replayed the way the kv suite
    # replays its own: at 80 % load, 4 and 8 ranks, one and two replicas.
    if suite == "kv" and trace:
        name = os.path.basename(trace)
        policies = KV_TRACE_KEYLESS + (KV_TRACE_KEYED if trace_has_keys(trace) else [])
        for ranks, replicas in [(4, 1), (8, 1), (4, 2), (8, 2)]:
            label = f"{name}, {ranks} ranks" + (f", {replicas} Envoy replicas" if replicas > 1 else "")
            out.append(cfg(label, ranks, policies, prefix_goal, replicas=replicas, workload=trace,
                           busy=KV_BUSY))
    # Not part of "all" (make bench stays under 10 minutes): `--suite kv`, ~15 minutes.
    if suite == "kv" and not trace:
        out += [
            cfg("kv-cache trace, 4 ranks", 4, KV_ALL, prefix_goal, workload="kv", busy=KV_BUSY),
            cfg("kv-cache trace, 8 ranks", 8, KV_ALL, prefix_goal, workload="kv", busy=KV_BUSY),
            cfg("kv-cache trace, 4 ranks, 2 Envoy replicas", 4, KV_REPLICAS, prefix_goal, replicas=2,
                workload="kv", busy=KV_BUSY),
            cfg("kv-cache trace, 8 ranks, 2 Envoy replicas", 8, KV_REPLICAS, prefix_goal, replicas=2,
                workload="kv", busy=KV_BUSY),
            cfg("agent loops behind a 96 KiB shared prompt, 4 ranks", 4, KV_AGENT, prefix_goal,
                workload="agent", busy=KV_BUSY),
            cfg("agent loops behind a 96 KiB shared prompt, 4 ranks, 2 Envoy replicas", 4, KV_AGENT,
                prefix_goal, replicas=2, workload="agent", busy=KV_BUSY),
            # At the trace's own rate nothing queues: what keeps a long shared prompt from pulling
            # every new conversation onto its first holder is then the recent work alone.
            cfg("agent loops behind a 96 KiB shared prompt, 4 ranks, the trace's own rate", 4,
                KV_AGENT, prefix_goal, workload="agent"),
        ]
    return out


def replay(args):
    r = subprocess.run([bc.REPLAY, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dp-replay {args[0]} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r.stdout


def make_trace(workdir, c, quick):
    """(trace path, description, oracle) of a configuration's workload."""
    kind, ranks = c["workload"], c["ranks"]
    if kind == "chat":
        flags = chat_workload(ranks, quick)
        path = os.path.join(workdir, f"trace-chat-{ranks}ranks.jsonl")
        with open(path, "w") as f:
            f.write(replay(["synth", *flags]))
        desc = f"`dp-replay synth {' '.join(flags)}`"
    elif kind == "kv":
        path = os.path.join(workdir, f"trace-kv-{ranks}ranks.jsonl")
        kv_trace(path, ranks)
        desc = "KV-cache-trace shape (`kv_trace()` in this script: one shared 2 KiB system prompt, long one- and two-turn sessions, a few long conversations, shared documents)"
    elif kind == "agent":
        path = os.path.join(workdir, f"trace-agent-{ranks}ranks.jsonl")
        agent_trace(path, ranks)
        desc = "agent loops (`agent_trace()` in this script: one shared 96 KiB prompt, sessions of 3-12 turns each adding a tool result of 1-8 KiB)"
    elif kind == "blocks":
        path = os.path.join(workdir, f"trace-blocks-{ranks}ranks.jsonl")
        block_trace(path, ranks)
        desc = "block-id trace (`block_trace()` in this script: tenant prompts, shared documents, growing turns)"
    else:
        path, desc = kind, f"trace `{kind}`"
    if BLOCKS_AS != "text":
        desc += f", block-id prompts sent as `--blocks-as {BLOCKS_AS}`"
    oracle = json.loads(replay(["oracle", "--trace", path, "--block-tokens", str(BLOCK_TOKENS),
                                "--blocks-as", BLOCKS_AS]))
    return path, desc, oracle


def cache_blocks(oracle, ranks, scale):
    """Per-rank cache capacity: the ranks together hold the workload's distinct blocks (everything
    ever computed) `scale` times. With scale 1 a policy that keeps each prefix on one rank has room
    for it; one that copies prefixes to several ranks evicts. BENCH_CACHE_BLOCKS overrides it
    (0 = unlimited; for exploring, not reported)."""
    if os.environ.get("BENCH_CACHE_BLOCKS"):
        return int(os.environ["BENCH_CACHE_BLOCKS"])
    distinct = max(1, (oracle["prompt_tokens"] - oracle["oracle_cached_tokens"]) // BLOCK_TOKENS)
    return max(64, int(distinct * scale) // ranks + 1)


def read_trace(path):
    """(arrival ms, block ids, output tokens) of every request of a block-id trace, in order."""
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows.append((r["timestamp"], r["hash_ids"], r.get("output_length", 0)))
    rows.sort(key=lambda r: r[0])
    return rows


def round_robin_work_us(rows, ranks, capacity):
    """Slot time (µs) the ranks spend on `rows` when Envoy round robin places them: request i on
    rank i mod `ranks`, each rank with an LRU prefix cache of `capacity` blocks (0 = unlimited)
    as the mock keeps it; a request holds a slot for the prefill of its uncached tokens and the
    decode of its output tokens (the mock's engine model)."""
    caches = [collections.OrderedDict() for _ in range(ranks)]
    work = 0.0
    for i, (_, ids, output) in enumerate(rows):
        cache, chain, cached, matching = caches[i % ranks], 0, 0, True
        for block in ids:
            chain = hash((chain, block))
            if matching and chain in cache:
                cached += 1
            else:
                matching = False
            cache[chain] = True
            cache.move_to_end(chain)
        while capacity and len(cache) > capacity:
            cache.popitem(last=False)
        work += (len(ids) - cached) * BLOCK_TOKENS * PREFILL_US + output * DECODE_US
    return work


def load_speed(trace, ranks, capacity, busy):
    """(dp-replay --speed, busy at the trace's own rate): the time compression at which Envoy
    round robin keeps the ranks' slots `busy` (0..1) of the trace's span. Computed from the trace
    and the engine model, not measured: the same trace and speed for every policy, and the
    envoy-rr row's measured `busy` checks it."""
    rows = read_trace(trace)
    span_us = max(1.0, (rows[-1][0] - rows[0][0]) * 1000.0)
    own = round_robin_work_us(rows, ranks, capacity) / (ranks * SLOTS * span_us)
    return busy / own, own


def answered_records(requests_path):
    """dp-replay's per-request records of the requests answered 200, read once per run for the
    figures below."""
    with open(requests_path) as f:
        return [r for r in map(json.loads, f) if r.get("status") == 200]


def measured_busy(answered, ranks, span_us):
    """Mean share of the ranks' slots in use over `span_us` (the replayed span): every answered
    request's time on its rank (total minus the wait for a slot), as dp-replay recorded it."""
    used = sum(r["total_us"] - (r.get("queue_us") or 0) for r in answered if r.get("total_us") is not None)
    return used / (ranks * SLOTS * span_us)


def mean_slot_wait_ms(answered):
    """Mean wait of the answered requests for a slot on their rank (the mock's `queue_us`, as
    dp-replay recorded it): the part of the time to first byte that placement spends on queues,
    beside the prefill it saves or costs."""
    waits = [r["queue_us"] for r in answered if r.get("queue_us") is not None]
    return sum(waits) / len(waits) / 1000.0 if waits else None


def start_routers(children, workdir, tag, c, spec, name, ports, tokenizer):
    """The router processes of one run, one per replica: Envoy (with or without the filter) or
    the SGLang model gateway. Returns (Envoy admin ports, the URLs dp-replay sends to)."""
    if spec["gateway"]:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        targets = []
        for i in range(c["replicas"]):
            _, port = bc.start_gateway(children, spec["gateway"], urls, workdir, f"{tag}-smg{i}", tokenizer,
                                       extra=spec["gateway_args"])
            targets.append(f"http://127.0.0.1:{port}")
        return [], targets
    if spec["assign"] == SHIPPED:
        plugin = shipped_plugin(c["ranks"])
    elif spec["assign"]:
        plugin = envoy_gen.filter_config(c["ranks"], spec["assign"], spec["prefix"])
    else:
        plugin = None
    kind = "filter" if spec["assign"] else name
    admins, targets = [], []
    for i in range(c["replicas"]):
        listen, admin = bc.free_port(), bc.free_port()
        text = envoy_gen.envoy_config(kind, ports, listen, admin, bc.WASM, plugin)
        _, admin = bc.start_envoy(children, text, workdir, f"{tag}-envoy{i}")
        admins.append(admin)
        targets.append(f"http://127.0.0.1:{listen}")
    return admins, targets


def run_policy(children, workdir, c, name, trace, capacity, speed=1.0, tokenizer=None):
    """One policy on one configuration: fresh mocks, its routers, one replay. Every process it
    starts is stopped before it returns; one that does not start raises."""
    ranks, spec = c["ranks"], POLICIES[name]
    tag = f"{c['label'].replace(' ', '').replace(',', '-').replace('/', '')}-{name}"
    mock_args = ["--block-tokens", str(BLOCK_TOKENS), "--cache-blocks", str(capacity), *MOCK_MODEL]
    if spec["gateway"]:
        # The gateway loads a tokenizer from the model_path each worker reports: a local one.
        mock_args += ["--model-path", os.path.dirname(tokenizer)]
    started_procs = len(children.procs)
    ports = []
    for r in range(ranks):
        _, port = bc.start_mock(children, ["--rank", str(r), *mock_args], os.path.join(workdir, f"{tag}-rank{r}.log"))
        ports.append(port)
    admins, targets = start_routers(children, workdir, tag, c, spec, name, ports, tokenizer)
    summary_path = os.path.join(workdir, f"{tag}.summary.json")
    requests_path = os.path.join(workdir, f"{tag}.requests.jsonl")
    extra = ["--speed", f"{speed:.4f}", "--stream"] if c.get("busy") else []
    started = time.time()
    replay([
        "run", "--trace", trace, *(a for t in targets for a in ("--target", t)), "--key-mode", spec["keys"],
        "--key-header", envoy_gen.ROUTING_KEY_HEADER, "--dp-size", str(ranks),
        "--block-tokens", str(BLOCK_TOKENS), "--blocks-as", BLOCKS_AS, "--seed", "1", *extra,
        "--out", requests_path, "--summary", summary_path,
    ])
    with open(summary_path) as f:
        summary = json.load(f)
    summary["wall_s"] = time.time() - started
    answered = answered_records(requests_path)
    if c.get("busy"):
        rows = read_trace(trace)
        span_us = (rows[-1][0] - rows[0][0]) * 1000.0 / speed
        summary["busy"] = measured_busy(answered, ranks, span_us)
        # Turns that wait for their session's previous answer stretch the replay; far past the
        # planned span the load is not the one the speed was computed for (a trace whose key
        # names no conversation chains its requests unless rows carry their `session`).
        ends = [r["scheduled_ms"] * 1000 + r.get("lateness_us", 0) + r.get("turn_wait_us", 0) + r["total_us"]
                for r in answered if r.get("total_us") is not None]
        stretch = max(ends, default=0) / span_us if span_us else 1.0
        summary["stretch"] = stretch
        if stretch > 1.5:
            bc.log(TAG, f"  WARNING: the replay took {stretch:.1f}x its planned span (turns waiting for "
                f"their session's previous answer): the load was lower than planned, busy is "
                f"over the planned span")
    summary["slot_wait_ms"] = mean_slot_wait_ms(answered)
    counters = {}
    if admins:
        time.sleep(1.1)  # the filter flushes its counters once a second
        for admin in admins:
            for k, v in bc.filter_counters(admin).items():
                counters[k] = counters.get(k, 0) + v
    summary["filter_counters"] = counters
    # Routers first (the last started), then the mocks.
    for proc, _ in list(reversed(children.procs[started_procs:])):
        children.stop(proc)
    return summary


def goal_met(row, goal):
    """A filter row with no failed request, at least the goal's hit share and at most its
    max/mean of the goal's figure."""
    share, most, figure = goal
    return (row["policy"].startswith("filter") and row["errors"] == 0
            and row["hit_share"] is not None and row["hit_share"] >= share
            and row[figure] is not None and row[figure] <= most)


def fmt(v, spec, unit=""):
    return "—" if v is None else format(v, spec) + unit


def key_label(name):
    spec = POLICIES[name]
    if spec["assign"] is None and spec["gateway"] is None:
        return ""
    return "session key" if spec["keys"] == "header" else "no key"


def markdown(results, meta):
    lines = [
        f"## Affinity comparison ({meta['mode']})",
        "",
        f"- date: {meta['date']}; machine: {meta['machine']}",
        f"- mock engine: {BLOCK_TOKENS}-token blocks, `{' '.join(MOCK_MODEL)}`, per-rank cache as listed",
        f"- command: `{meta['command']}`; total {meta['total_s']:.0f} s; raw data in `{meta['workdir_rel']}`",
        "- hit rate = cached prompt tokens / prompt tokens over all requests (from the mocks' `usage`);",
        "  oracle = one unlimited cache shared by all requests (every prefix computed once: the upper",
        "  bound of any placement); session oracle = one unlimited cache per session.",
        "- max/mean tokens = the busiest rank's prompt tokens over the mean; max/mean computed = the",
        "  same over the tokens each rank computed (prompt minus cached: its prefill work).",
        "- slot wait = the mean wait of a request for one of its rank's slots (the mocks' `queue_us`):",
        "  the part of the time to first byte that placement spends on queues.",
        "- goals: keyed, hit rate ≥ 0.97 × oracle with max/mean requests per rank ≤ 1.15; without any",
        "  routing key (prefix index), ≥ 0.98 × oracle at max/mean prompt tokens ≤ 1.10; no request",
        "  failed. Marked on filter rows.",
        "",
    ]
    for cfg in results:
        o = cfg["oracle"]
        lines += [
            f"### {cfg['label']}",
            "",
            f"Workload: {cfg['workload_desc']} — {o['requests']} requests, "
            f"{o['prompt_tokens']} prompt tokens; oracle hit rate {fmt(o['oracle_hit_rate'], '.3f')}, "
            f"session oracle {fmt(o['session_oracle_hit_rate'], '.3f')}; cache {cfg['cache_blocks']} blocks per rank"
            f"{'; ' + str(cfg['replicas']) + ' router replicas (Envoy or gateway), each request to one at random' if cfg['replicas'] > 1 else ''}.",
        ]
        if cfg.get("busy"):
            lines += [
                "",
                f"Load: replayed {cfg['speed']:.2f}× faster than the trace's own arrival times (`dp-replay --speed`), "
                f"where Envoy round robin keeps the ranks' slots {cfg['busy']:.0%} busy by the engine model "
                f"({cfg['own_busy']:.0%} at the trace's own rate); answers streamed, so TTFB = wait for a slot + "
                "prefill of the uncached tokens. busy = measured share of the ranks' slots in use. "
                "A session's turn leaves at its (compressed) time but never before the previous turn's "
                "answer has ended, as a client's does (`dp-replay --turns in-order`).",
            ]
        lines += [
            "",
            "| policy | key | token hit rate | ÷ oracle | max/mean req | max/mean tokens | max/mean computed | TTFB p50 | TTFB p90 | TTFB p99 | slot wait | total p50 | busy | errors | goal |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in cfg["rows"]:
            lines.append(
                f"| {row['policy']} | {key_label(row['policy'])} | {fmt(row['hit_rate'], '.3f')} | {fmt(row['hit_share'], '.3f')} "
                f"| {fmt(row['max_mean_requests'], '.2f')} | {fmt(row['max_mean_tokens'], '.2f')} "
                f"| {fmt(row['max_mean_computed'], '.2f')} "
                f"| {fmt(row['ttfb_p50_ms'], '.1f', ' ms')} | {fmt(row['ttfb_p90_ms'], '.1f', ' ms')} | {fmt(row['ttfb_p99_ms'], '.1f', ' ms')} "
                f"| {fmt(row['slot_wait_ms'], '.1f', ' ms')} | {fmt(row['total_p50_ms'], '.1f', ' ms')} | {fmt(row['busy'], '.0%')} | {row['errors']} "
                f"| {'**met**' if goal_met(row, cfg['goal']) else ''} |"
            )
        lines.append(
            f"| oracle (offline) | | {fmt(o['oracle_hit_rate'], '.3f')} | 1.000 | — | — | — | — | — | — | — | — | — | — | |"
        )
        lines.append("")
    lines += ["Policies:", ""]
    used = {r["policy"] for cfg in results for r in cfg["rows"]}
    for name, spec in POLICIES.items():
        if name in used:
            lines.append(f"- `{name}`: {spec['desc']}")
    lines.append("")
    return "\n".join(lines)


def computed_balance(summary, ranks):
    """max/mean over the ranks of the prompt tokens they computed (prompt minus cached): the
    prefill work each rank did, which is what its queue and the time to first byte follow. A
    rank holding long conversations gets many prompt tokens, most of them cached; max/mean
    prompt tokens counts them as work, this does not. Over all `ranks`, a rank that served
    nothing counting as zero."""
    computed = [0] * ranks
    for p in summary.get("per_rank") or []:
        rank = p.get("rank")
        if isinstance(rank, int) and 0 <= rank < ranks:
            computed[rank] = p.get("prompt_tokens", 0) - p.get("cached_tokens", 0)
    if sum(computed) <= 0:
        return None
    return max(computed) / (sum(computed) / ranks)


def row_of(name, summary, oracle, ranks):
    hit = summary.get("token_hit_rate")
    o = oracle.get("oracle_hit_rate") or 0

    def get(*path):
        v = summary
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    def ms(*path):
        v = get(*path)
        return None if v is None else v / 1000.0

    return {
        "policy": name,
        "hit_rate": hit,
        "hit_share": (hit / o) if (hit is not None and o > 0) else None,
        "max_mean_requests": get("requests_per_rank", "max_over_mean"),
        "max_mean_tokens": get("prompt_tokens_per_rank", "max_over_mean"),
        "max_mean_computed": computed_balance(summary, ranks),
        "ttfb_p50_ms": ms("ttfb_us", "p50"),
        "ttfb_p90_ms": ms("ttfb_us", "p90"),
        "ttfb_p99_ms": ms("ttfb_us", "p99"),
        "busy": summary.get("busy"),
        "slot_wait_ms": summary.get("slot_wait_ms"),
        "total_p50_ms": ms("total_us", "p50"),
        "errors": summary.get("errors", 0),
        "requests": summary.get("requests"),
        "summary": summary,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 ranks, a few policies, short workload")
    ap.add_argument("--check", action="store_true", help="smoke test: fail unless the filter beats round robin")
    ap.add_argument("--suite", choices=["keyed", "prefix", "kv", "all"], default="all")
    ap.add_argument("--trace", help="replay this JSONL trace instead of the built-in workloads: with the prefix "
                    "suite at its own rate on 4 ranks, one and two replicas, with the kv suite at 80 %% load on 4 and 8 ranks, one and "
                    "two replicas (a public trace: see scripts/convert-trace.py)")
    ap.add_argument("--out", default=os.path.join(bc.ROOT, "results"), help="results folder")
    ap.add_argument("--policies", help="comma-separated subset of the policies to run")
    ap.add_argument("--ranks", type=int, help="run only the configurations with this many ranks")
    ap.add_argument("--replicas", type=int, help="run only the configurations with this many router replicas")
    ap.add_argument("--blocks-as", choices=["text", "chat"], default="text",
                    help="send block-id prompts as a completions prompt (text) or as a chat of one user message "
                    "holding the whole text (chat: clients that fold a conversation into one message)")
    args = ap.parse_args()
    global BLOCKS_AS
    BLOCKS_AS = args.blocks_as
    bc.require([
        ("envoy", bc.ENVOY, "make tools"), ("wasm", bc.WASM, "make build"),
        ("mock-rank", bc.MOCK, "make build"), ("dp-replay", bc.REPLAY, "make build"),
    ])
    chosen = args.policies.split(",") if args.policies else None
    unknown = [p for p in chosen or [] if p not in POLICIES]
    if unknown:
        sys.exit(f"unknown policies {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    plan = [c for c in configurations(args.suite, args.quick, args.trace)
            if (not args.ranks or c["ranks"] == args.ranks)
            and (not args.replicas or c["replicas"] == args.replicas)]
    for c in plan:
        c["policies"] = [p for p in c["policies"] if not chosen or p in chosen]
    if any(POLICIES[p]["gateway"] for c in plan for p in c["policies"]):
        bc.require_gateway()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    workdir = os.path.join(args.out, f"affinity-{stamp}")
    os.makedirs(workdir, exist_ok=True)
    argv = " ".join(sys.argv[1:])
    # Settings read from the environment change what runs: they belong to the command line.
    default_wasm = os.path.join(bc.ROOT, "target/wasm32-wasip1/release/dp_affinity.wasm")
    settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                        if k.startswith("BENCH_")
                        or (k == "DP_AFFINITY_WASM" and os.path.abspath(v) != default_wasm))
    meta = {
        "mode": "quick" if args.quick else f"suite {args.suite}",
        "date": stamp,
        "machine": bc.machine_line(),
        "command": f"{settings} scripts/bench-affinity.py {argv}".strip(),
        "workdir_rel": os.path.relpath(workdir, bc.ROOT),
    }
    began = time.time()
    results, traces = [], {}
    tokenizer = bc.write_local_tokenizer(os.path.join(workdir, "tokenizer"))
    with bc.Children() as children:
        for c in plan:
            policies = c["policies"]
            key = (c["workload"], c["ranks"])
            if key not in traces:
                bc.log(TAG, f"workload {c['workload']} for {c['ranks']} ranks: trace + oracle")
                traces[key] = make_trace(workdir, c, args.quick)
            trace, desc, oracle = traces[key]
            capacity = cache_blocks(oracle, c["ranks"], c["scale"])
            out = dict(c, oracle=oracle, workload_desc=desc, cache_blocks=capacity, rows=[])
            speed = 1.0
            if c["busy"]:
                speed, out["own_busy"] = load_speed(trace, c["ranks"], capacity, c["busy"])
                out["speed"] = speed
                bc.log(TAG, f"{c['label']}: round robin is {out['own_busy']:.0%} busy at the trace's rate; "
                       f"replaying {speed:.2f}x faster for {c['busy']:.0%}")
            for name in policies:
                bc.log(TAG, f"{c['label']}: {name}")
                summary = run_policy(children, workdir, c, name, trace, capacity, speed, tokenizer)
                row = row_of(name, summary, oracle, c["ranks"])
                bc.log(TAG, f"  hit rate {fmt(row['hit_rate'], '.3f')} (÷ oracle {fmt(row['hit_share'], '.3f')}), "
                       f"max/mean {fmt(row['max_mean_requests'], '.2f')}, errors {row['errors']}, "
                       f"{summary['wall_s']:.0f} s")
                out["rows"].append(row)
            results.append(out)
    meta["total_s"] = time.time() - began
    write_outputs(args.out, stamp, results, meta)
    if args.check:
        sys.exit(check(results))


def write_outputs(out_dir, stamp, results, meta):
    report = markdown(results, meta)
    base = os.path.join(out_dir, f"affinity-{stamp}")
    with open(base + ".md", "w") as f:
        f.write(report)
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "configurations": results}, f, indent=1)
    groups = [
        (cfg["label"], [(f"{r['policy']}{' (' + key_label(r['policy']) + ')' if key_label(r['policy']) else ''}",
                         r["hit_share"], r["max_mean_requests"], r["policy"].startswith("filter"))
                        for r in cfg["rows"]])
        for cfg in results
    ]
    with open(base + ".svg", "w") as f:
        f.write(report_svg.chart(groups, f"dp-affinity: hit rate and balance per policy ({meta['mode']})"))
    print(report)
    bc.log(TAG, f"report: {base}.md, chart: {base}.svg, total {meta['total_s']:.0f} s")


def check(results):
    """The smoke test: every run answered every request, and the filter beats round robin."""
    failures = [] if results else ["no run at all"]
    for cfg in results:
        rows = {r["policy"]: r for r in cfg["rows"]}
        for r in cfg["rows"]:
            if r["errors"] or not r["requests"]:
                failures.append(f"{cfg['label']} {r['policy']}: {r['errors']} errors of {r['requests']} requests")
        rr = rows.get("envoy-rr")
        filters = [r for r in cfg["rows"] if r["policy"].startswith("filter")]
        if not rr or not filters:
            # Nothing to compare: the check would pass without checking anything.
            failures.append(f"{cfg['label']}: needs an envoy-rr row and a filter row, got {sorted(rows)}")
        for r in cfg["rows"]:
            if r["policy"].startswith("filter") and rr and not (r["hit_rate"] or 0) > (rr["hit_rate"] or 0):
                failures.append(f"{cfg['label']} {r['policy']}: hit rate {r['hit_rate']} not above round robin {rr['hit_rate']}")
    for f in failures:
        bc.log(TAG, f"CHECK FAILED: {f}")
    if not failures:
        bc.log(TAG, "check passed: every request answered, the filter's hit rate beats round robin")
    return 1 if failures else 0


if __name__ == "__main__":
    main()
