#!/usr/bin/env python3
"""Checks scripts/balance-bound.py on small hand-made traces (run by `make unit`)."""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

if not __debug__:  # python -O strips every assert: the checks would pass unseen
    raise SystemExit(f"{__file__}: run without -O (its checks are asserts)")

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("balance_bound", os.path.join(HERE, "balance-bound.py"))
bb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bb)


def row(t, key, blocks):
    return {"timestamp": t, "key": key, "hash_ids": list(range(blocks))}


# Two one-block sessions, then a two-block one: the online rule has spread the first two and
# must stack the third on one of them; hindsight pairs the small ones.
ROWS = [row(0, "a", 1), row(1, "b", 1), row(2, "c", 2)]


def test_hindsight_beats_the_online_rule():
    out = bb.report(ROWS, 2)
    assert out["sessions"] == 3
    assert out["largest session share"] == 0.5
    assert out["hindsight"] == 1.0, out
    assert out["least so far"] == 1.5, out
    assert 1.0 <= out["blind p50"] <= out["blind p90"] <= 2.0, out


def test_a_session_stays_where_its_first_request_went():
    # "a" comes back after "b" opened on the other rank: its later blocks join its first rank.
    rows = [row(0, "a", 1), row(1, "b", 1), row(2, "a", 3)]
    assert bb.least_so_far(rows, 2) == 4 / 2.5


def test_measured_reads_a_runs_records():
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "w") as f:
            for rank, tokens, status in [(0, 300, 200), (1, 100, 200), (1, 900, 503)]:
                f.write(json.dumps({"rank": rank, "prompt_tokens": tokens, "status": status}) + "\n")
        assert bb.measured(path, 2) == 1.5, "failed requests are not counted"
    finally:
        os.unlink(path)


def test_the_kv_suites_trace_is_built_as_the_bench_builds_it():
    rows = bb.kv_rows(23, 4)
    assert len(rows) == 426, len(rows)  # the kv suite's 4-rank trace (BENCHMARKS.md)
    assert bb.report(rows, 4)["hindsight"] < 1.01


def test_a_row_without_a_key_is_refused():
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"timestamp": 0, "hash_ids": [1]}) + "\n")
        run = subprocess.run(
            [sys.executable, os.path.join(HERE, "balance-bound.py"), path, "--ranks", "2"],
            capture_output=True,
            text=True,
        )
        assert run.returncode != 0 and "needs a session" in run.stderr, run.stderr
    finally:
        os.unlink(path)


if __name__ == "__main__":
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
    print("balance-bound: ok")
