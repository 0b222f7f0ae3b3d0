#!/usr/bin/env python3
"""How even can prompt tokens per rank be, when every session stays on one rank?

A placement that keeps each conversation on one rank (what prefix affinity aims at) can balance
the prompt tokens the ranks receive only session by session, and it must choose a session's rank
at its first request, not knowing how long the session will go on. For a block-id trace with a
session `key` per row (what `scripts/bench-affinity.py` writes as `trace-*.jsonl` into its
results, or `--kv-seed` to build the kv suite's trace here), this prints the busiest rank's prompt
tokens over the mean (max/mean) for:

- hindsight: sessions assigned longest first to the least loaded rank (LPT), knowing every
  session's total — the best any whole-session placement can do, near 1.00;
- least so far: each new session to the rank sent the fewest prompt tokens so far, counted over
  the whole run by one router that sees everything — the best informed rule that cannot see the
  future;
- blind: each session to a uniformly random rank (what a hash of the session does), the median
  and the 90th percentile over 200 draws;
- measured: with `--run <requests.jsonl>` (a bench run's per-request records), the run's own
  per-rank prompt tokens, for comparison.

Prompt tokens are counted as blocks (`hash_ids`): every block has the same token count, so the
ratios are the same. Cached or not does not matter here: this is the tokens each rank is sent.

    scripts/balance-bound.py --kv-seed 23 --ranks 4
    scripts/balance-bound.py results/<run>/trace-kv-8ranks.jsonl --ranks 8 \\
        --run results/<run>/kv-cachetrace-8ranks-filter-shipped.requests.jsonl
"""
import argparse
import collections
import importlib.util
import json
import os
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def read_rows(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "key" not in row or "hash_ids" not in row:
                raise SystemExit(f"{path}:{n}: a row needs a session \"key\" and \"hash_ids\"")
            rows.append(row)
    return rows


def sessions_in_order(rows):
    """Each session's total blocks, in the order of its first request."""
    totals = collections.OrderedDict()
    for row in sorted(rows, key=lambda r: r.get("timestamp", 0)):
        totals[row["key"]] = totals.get(row["key"], 0) + len(row["hash_ids"])
    return totals


def max_over_mean(loads):
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def hindsight(totals, ranks):
    loads = [0] * ranks
    for size in sorted(totals.values(), reverse=True):
        loads[loads.index(min(loads))] += size
    return max_over_mean(loads)


def least_so_far(rows, ranks):
    loads = [0] * ranks
    home = {}
    for row in sorted(rows, key=lambda r: r.get("timestamp", 0)):
        rank = home.setdefault(row["key"], loads.index(min(loads)))
        loads[rank] += len(row["hash_ids"])
    return max_over_mean(loads)


def blind(totals, ranks, draws=200):
    rng = random.Random(1)
    results = []
    for _ in range(draws):
        loads = [0] * ranks
        for size in totals.values():
            loads[rng.randrange(ranks)] += size
        results.append(max_over_mean(loads))
    results.sort()
    return results[len(results) // 2], results[len(results) * 9 // 10]


def measured(path, ranks):
    loads = [0] * ranks
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if rec.get("status") == 200 and rec.get("rank") is not None and rec["rank"] < ranks:
                    loads[rec["rank"]] += rec.get("prompt_tokens", 0)
    return max_over_mean(loads)


def kv_rows(seed, ranks):
    spec = importlib.util.spec_from_file_location("bench_affinity", os.path.join(HERE, "bench-affinity.py"))
    bench = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, [sys.argv[0]]
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.argv = argv
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.jsonl")
        bench.kv_trace(path, ranks, seed=seed)
        return read_rows(path)


def report(rows, ranks, run=None):
    totals = sessions_in_order(rows)
    all_blocks = sum(totals.values())
    largest = max(totals.values()) / all_blocks if all_blocks else 0.0
    median, p90 = blind(totals, ranks)
    out = {
        "sessions": len(totals),
        "largest session share": round(largest, 3),
        "hindsight": round(hindsight(totals, ranks), 3),
        "least so far": round(least_so_far(rows, ranks), 3),
        "blind p50": round(median, 3),
        "blind p90": round(p90, 3),
    }
    if run:
        out["measured"] = round(measured(run, ranks), 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", help="block-id trace with a session key per row")
    ap.add_argument("--kv-seed", type=int, help="build the kv suite's trace with this seed instead")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--run", help="a bench run's requests.jsonl, for its measured max/mean")
    args = ap.parse_args()
    if args.ranks < 1:
        ap.error("--ranks must be at least 1")
    if (args.trace is None) == (args.kv_seed is None):
        ap.error("give a trace file or --kv-seed, not both")
    rows = read_rows(args.trace) if args.trace else kv_rows(args.kv_seed, args.ranks)
    if not rows:
        raise SystemExit("the trace has no rows")
    print(json.dumps(report(rows, args.ranks, args.run)))


if __name__ == "__main__":
    main()
