#!/usr/bin/env python3
"""Checks scripts/rekey-trace.py on a small hand-made trace (run by `make unit`)."""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

if not __debug__:  # python -O strips every assert: the checks would pass unseen
    raise SystemExit(f"{__file__}: run without -O (its checks are asserts)")

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("rekey_trace", os.path.join(HERE, "rekey-trace.py"))
rk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rk)

ROWS = [{"timestamp": t, "hash_ids": [1, t], "key": f"s{t % 5}"} for t in range(40)]


def test_one_key_for_everything():
    out = rk.rekey(ROWS, key="benchmark")
    assert {r["key"] for r in out} == {"benchmark"}
    assert [dict(r, key=None, session=None) for r in out] == [dict(r, key=None, session=None) for r in ROWS], \
        "only keys change"
    assert [r["session"] for r in out] == [r["key"] for r in ROWS], "each row keeps its conversation"


def test_users_keep_their_sessions_whole():
    out = rk.rekey(ROWS, users=3)
    user_of_session = {}
    for before, after in zip(ROWS, out):
        assert user_of_session.setdefault(before["key"], after["key"]) == after["key"], "a session changed user"
    assert set(user_of_session.values()) <= {"user-0", "user-1", "user-2"}
    assert len(set(user_of_session.values())) >= 2, "five sessions all on one of three users"
    assert rk.rekey(ROWS, users=3) == out, "the same users on every run"


def test_a_row_without_a_key_is_refused():
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"timestamp": 0, "hash_ids": [1]}) + "\n")
        bad = subprocess.run([sys.executable, os.path.join(HERE, "rekey-trace.py"), path, "--key", "k"],
                             capture_output=True, text=True)
        assert bad.returncode == 1 and "no session key" in bad.stderr, bad
    finally:
        os.unlink(path)


if __name__ == "__main__":
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        t()
    print(f"test-rekey-trace: {len(tests)} tests passed")
