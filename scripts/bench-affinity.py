#!/usr/bin/env python3
"""What affinity buys: prefix-cache hit rate, balance and latency of each routing policy on the
same multi-turn workload, through a real Envoy in front of mock ranks that simulate a prefix cache.

For every configuration (4 ranks, 8 ranks, 4 ranks behind 2 Envoy replicas) and every policy:
fresh mock ranks (empty caches) are started, Envoy with the policy's config in front of them, and
`dp-replay run` replays the workload's trace open-loop (same trace, same arrival times for every
policy). The offline oracle (`dp-replay oracle`: one unlimited cache shared by every request, the
upper bound of any placement) gives the denominator of "hit rate / oracle".

Writes results/affinity-<UTC>.md (the report, also printed), .json (every figure) and .svg (the
chart), with traces, per-request records and Envoy logs under results/affinity-<UTC>/.

  scripts/bench-affinity.py            # the full comparison (`make bench` runs it)
  scripts/bench-affinity.py --quick    # 4 ranks, 3 policies, a short workload (`make bench-quick`)
  scripts/bench-affinity.py --quick --check
      # the smoke test of `make test`: fails (exit 1) unless every run completed without errors
      # and the filter's token hit rate beats Envoy round robin. Never a timing assertion.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import envoy_gen  # noqa: E402
import report_svg  # noqa: E402

TAG = "bench-affinity"

# Policies: (name, description, plugin `assign` section or None for Envoy without the filter).
UNBOUNDED = {"mode": "hash", "load_factor": 100, "pinned_load_factor": 100}
POLICIES = {
    "filter-learn": ("dp_affinity: Envoy picks new keys (LEAST_REQUEST), filter learns + pins", {"mode": "envoy"}),
    "filter-hash": ("dp_affinity: rendezvous hash of the key, no load bound", UNBOUNDED),
    "filter-hash-bounded": (
        "dp_affinity: rendezvous hash + bounded load (c = 1.25, floor 4 = the engine's batch)",
        {"mode": "hash", "min_capacity": 4},
    ),
    "envoy-rr": ("Envoy ROUND_ROBIN over all ranks", None),
    "envoy-lr": ("Envoy LEAST_REQUEST over all ranks", None),
    "envoy-hash": ("Envoy weighted_clusters + use_hash_policy on the key header", None),
}
ALL = list(POLICIES)

# The mock ranks' engine model, the same for every run: 16-token blocks; prefill 50 us per uncached
# prompt token, decode 3 ms per output token; 4 requests served at once per rank (more queue); a
# per-rank cache sized from the workload (see cache_blocks). Scaled down from a real engine so a
# run takes seconds, with the same shape: a cache hit saves prefill time, an overloaded rank queues.
BLOCK_TOKENS = 16
MOCK_MODEL = ["--prefill-us-per-token", "50", "--decode-us-per-token", "3000", "--max-concurrency", "4"]


def workload(ranks, quick):
    """`dp-replay synth` flags. Sessions and their arrival rate scale with the rank count, so each
    rank sees the same load whatever the configuration."""
    sessions = (16 if quick else 40) * ranks
    return [
        "--seed", "7",
        "--tenants", str(ranks),
        "--sessions", str(sessions),
        "--session-rate", str(4.0 * ranks),
        "--max-turns", "12",
        "--zipf", "0.8",
        "--system-tokens", "1000",
        "--user-tokens", "120",
        "--output-tokens", "48",
        "--think-ms", "500",
        "--response-ms", "200",
    ]


def configurations(quick):
    """(label, ranks, Envoy replicas, cache scale, policies). Cache scale 1: the ranks together can
    hold every distinct block once (see cache_blocks); 0.25: a quarter of that (cache pressure)."""
    if quick:
        return [("4 ranks", 4, 1, 1.0, ["filter-hash-bounded", "filter-learn", "envoy-rr"])]
    return [
        ("4 ranks", 4, 1, 1.0, ALL),
        ("8 ranks", 8, 1, 1.0, ALL),
        ("4 ranks, 2 Envoy replicas", 4, 2, 1.0, ["filter-learn", "filter-hash-bounded", "envoy-lr"]),
        ("4 ranks, caches 1/4 the size", 4, 1, 0.25, ["filter-hash-bounded", "envoy-lr", "envoy-rr"]),
    ]


def replay(args, capture=True):
    r = subprocess.run([bc.REPLAY, *args], capture_output=capture, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dp-replay {args[0]} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r.stdout


def make_trace(workdir, ranks, quick):
    path = os.path.join(workdir, f"trace-{ranks}ranks.jsonl")
    with open(path, "w") as f:
        f.write(replay(["synth", *workload(ranks, quick)]))
    oracle = json.loads(replay(["oracle", "--trace", path, "--block-tokens", str(BLOCK_TOKENS)]))
    return path, oracle


def cache_blocks(oracle, ranks, scale):
    """Per-rank cache capacity: the ranks together hold the workload's distinct blocks (everything
    ever computed) once. A policy that keeps each prefix on one rank has room for it; one that
    copies prefixes to several ranks evicts. BENCH_CACHE_BLOCKS overrides it (0 = unlimited)."""
    if os.environ.get("BENCH_CACHE_BLOCKS"):
        return int(os.environ["BENCH_CACHE_BLOCKS"])  # 0 = unlimited (for exploring, not reported)
    distinct = max(1, (oracle["prompt_tokens"] - oracle["oracle_cached_tokens"]) // BLOCK_TOKENS)
    return max(64, int(distinct * scale) // ranks + 1)


def run_policy(children, workdir, label, ranks, replicas, policy, trace, capacity):
    name = f"{label.replace(' ', '').replace(',', '-')}-{policy}"
    mock_args = ["--block-tokens", str(BLOCK_TOKENS), "--cache-blocks", str(capacity), *MOCK_MODEL]
    mocks, ports = [], []
    for r in range(ranks):
        proc, port = bc.start_mock(children, ["--rank", str(r), *mock_args], os.path.join(workdir, f"{name}-rank{r}.log"))
        mocks.append(proc)
        ports.append(port)
    assign = POLICIES[policy][1]
    plugin = envoy_gen.filter_config(ranks, assign) if assign else None
    envoys, targets = [], []
    for i in range(replicas):
        listen, admin = bc.free_port(), bc.free_port()
        text = envoy_gen.envoy_config(policy, ports, listen, admin, bc.WASM, plugin)
        proc, admin = bc.start_envoy(children, text, workdir, f"{name}-envoy{i}")
        envoys.append((proc, admin))
        targets += ["--target", f"http://127.0.0.1:{listen}"]
    summary_path = os.path.join(workdir, f"{name}.summary.json")
    started = time.time()
    replay([
        "run", "--trace", trace, *targets, "--key-mode", "header",
        "--key-header", envoy_gen.ROUTING_KEY_HEADER, "--dp-size", str(ranks),
        "--block-tokens", str(BLOCK_TOKENS), "--seed", "1",
        "--out", os.path.join(workdir, f"{name}.requests.jsonl"), "--summary", summary_path,
    ])
    with open(summary_path) as f:
        summary = json.load(f)
    summary["wall_s"] = time.time() - started
    counters = {}
    for _, admin in envoys:
        for k, v in bc.filter_counters(admin).items():
            counters[k] = counters.get(k, 0) + v
    summary["filter_counters"] = counters
    for proc, _ in envoys:
        children.stop(proc)
    for proc in mocks:
        children.stop(proc)
    return summary


def goal_met(row):
    return row["hit_share"] is not None and row["hit_share"] >= 0.97 and row["max_mean_requests"] <= 1.15


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def markdown(results, meta):
    lines = [
        f"## Affinity comparison ({meta['mode']})",
        "",
        f"- date: {meta['date']}; machine: {meta['machine']}",
        f"- Envoy: `{bc.ENVOY}`; wasm: `{bc.WASM}`",
        f"- mock engine: {BLOCK_TOKENS}-token blocks, `{' '.join(MOCK_MODEL)}`, per-rank cache as listed",
        f"- command: `{meta['command']}`; total {meta['total_s']:.0f} s; raw data in `{meta['workdir_rel']}`",
        "- hit rate = cached prompt tokens / prompt tokens over all requests (from the mocks' `usage`);",
        "  oracle = one unlimited cache shared by all requests (every prefix computed once: the upper",
        "  bound of any placement); session oracle = one unlimited cache per session.",
        "- goal: hit rate ≥ 0.97 × oracle with max/mean requests per rank ≤ 1.15, in one configuration.",
        "",
    ]
    for cfg in results:
        o = cfg["oracle"]
        lines += [
            f"### {cfg['label']}",
            "",
            f"Workload: `dp-replay synth {' '.join(cfg['workload'])}` — {o['requests']} requests, "
            f"{o['prompt_tokens']} prompt tokens; oracle hit rate {o['oracle_hit_rate']:.3f}, "
            f"session oracle {o['session_oracle_hit_rate']:.3f}; cache {cfg['cache_blocks']} blocks per rank.",
            "",
            "| policy | token hit rate | ÷ oracle | max/mean req | max/mean tokens | TTFB p50 | TTFB p99 | total p50 | errors | goal |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in cfg["rows"]:
            lines.append(
                f"| {row['policy']} | {fmt(row['hit_rate'], '.3f')} | {fmt(row['hit_share'], '.3f')} "
                f"| {fmt(row['max_mean_requests'], '.2f')} | {fmt(row['max_mean_tokens'], '.2f')} "
                f"| {fmt(row['ttfb_p50_ms'], '.1f')} ms | {fmt(row['ttfb_p99_ms'], '.1f')} ms "
                f"| {fmt(row['total_p50_ms'], '.1f')} ms | {row['errors']} "
                f"| {'**met**' if goal_met(row) else ''} |"
            )
        lines.append(
            f"| oracle (offline) | {o['oracle_hit_rate']:.3f} | 1.000 | — | — | — | — | — | — | |"
        )
        lines.append("")
    lines += ["Policies:", ""]
    for name, (desc, _) in POLICIES.items():
        lines.append(f"- `{name}`: {desc}")
    lines.append("")
    return "\n".join(lines)


def row_of(policy, summary, oracle):
    hit = summary.get("token_hit_rate")
    o = oracle["oracle_hit_rate"] or 0

    def get(*path):
        v = summary
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    def ms(*path):
        v = get(*path)
        return None if v is None else v / 1000.0

    return {
        "policy": policy,
        "hit_rate": hit,
        "hit_share": (hit / o) if (hit is not None and o > 0) else None,
        "max_mean_requests": get("requests_per_rank", "max_over_mean"),
        "max_mean_tokens": get("prompt_tokens_per_rank", "max_over_mean"),
        "ttfb_p50_ms": ms("ttfb_us", "p50"),
        "ttfb_p99_ms": ms("ttfb_us", "p99"),
        "total_p50_ms": ms("total_us", "p50"),
        "errors": summary.get("errors", 0),
        "requests": summary.get("requests"),
        "summary": summary,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 ranks, 3 policies, short workload")
    ap.add_argument("--check", action="store_true", help="smoke test: fail unless the filter beats round robin")
    ap.add_argument("--out", default=os.path.join(bc.ROOT, "results"), help="results folder")
    ap.add_argument("--policies", help="comma-separated subset of the policies to run")
    ap.add_argument("--ranks", type=int, help="run only the configurations with this many ranks")
    args = ap.parse_args()
    bc.require([
        ("envoy", bc.ENVOY, "make tools"), ("wasm", bc.WASM, "make build"),
        ("mock-rank", bc.MOCK, "make build"), ("dp-replay", bc.REPLAY, "make build"),
    ])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    workdir = os.path.join(args.out, f"affinity-{stamp}")
    os.makedirs(workdir, exist_ok=True)
    meta = {
        "mode": "quick" if args.quick else "full",
        "date": stamp,
        "machine": bc.machine_line(),
        "command": "scripts/bench-affinity.py" + (" --quick" if args.quick else ""),
        "workdir_rel": os.path.relpath(workdir, bc.ROOT),
    }
    began = time.time()
    results = []
    with bc.Children() as children:
        traces = {}
        for label, ranks, replicas, scale, policies in configurations(args.quick):
            if args.ranks and ranks != args.ranks:
                continue
            if args.policies:
                policies = [p for p in policies if p in args.policies.split(",")]
            if ranks not in traces:
                bc.log(TAG, f"workload for {ranks} ranks: synth + oracle")
                traces[ranks] = make_trace(workdir, ranks, args.quick)
            trace, oracle = traces[ranks]
            capacity = cache_blocks(oracle, ranks, scale)
            cfg = {"label": label, "ranks": ranks, "replicas": replicas, "oracle": oracle,
                   "workload": workload(ranks, args.quick), "cache_blocks": capacity, "rows": []}
            for policy in policies:
                bc.log(TAG, f"{label}: {policy}")
                summary = run_policy(children, workdir, label, ranks, replicas, policy, trace, capacity)
                row = row_of(policy, summary, oracle)
                bc.log(TAG, f"  hit rate {fmt(row['hit_rate'], '.3f')} (÷ oracle {fmt(row['hit_share'], '.3f')}), "
                       f"max/mean {fmt(row['max_mean_requests'], '.2f')}, errors {row['errors']}, "
                       f"{summary['wall_s']:.0f} s")
                cfg["rows"].append(row)
            results.append(cfg)
    meta["total_s"] = time.time() - began
    report = markdown(results, meta)
    base = os.path.join(args.out, f"affinity-{stamp}")
    with open(base + ".md", "w") as f:
        f.write(report)
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "configurations": results}, f, indent=1)
    groups = [
        (cfg["label"], [(r["policy"], r["hit_share"], r["max_mean_requests"], r["policy"].startswith("filter"))
                        for r in cfg["rows"]])
        for cfg in results
    ]
    with open(base + ".svg", "w") as f:
        f.write(report_svg.chart(groups, f"dp-affinity: hit rate and balance per policy ({meta['mode']})"))
    print(report)
    bc.log(TAG, f"report: {base}.md, chart: {base}.svg, total {meta['total_s']:.0f} s")
    if args.check:
        sys.exit(check(results))


def check(results):
    """The smoke test: every run answered every request, and the filter beats round robin."""
    failures = []
    for cfg in results:
        rows = {r["policy"]: r for r in cfg["rows"]}
        for r in cfg["rows"]:
            if r["errors"] or not r["requests"]:
                failures.append(f"{cfg['label']} {r['policy']}: {r['errors']} errors of {r['requests']} requests")
        rr = rows.get("envoy-rr")
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
