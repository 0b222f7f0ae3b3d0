#!/usr/bin/env python3
"""Checks scripts/replica-moves.py on small hand-made runs (run by `make unit`)."""
import importlib.util
import json
import os
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("replica_moves", os.path.join(HERE, "replica-moves.py"))
rm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rm)


def write(folder, name, rows):
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def record(line, target, rank, prompt, cached, ms):
    return {"line": line, "key": None, "target": target, "rank": rank, "status": 200,
            "prompt_tokens": prompt, "cached_tokens": cached, "scheduled_ms": ms}


def test_keyless_turns_are_found_by_their_prompts():
    with tempfile.TemporaryDirectory() as d:
        trace = write(d, "t.jsonl", [
            # A first turn: a shared opening block (ids 0, 1), its own block, a partial last one.
            {"hash_ids": [0, 1, 10, 11, 12, 13]},
            # Another conversation with the same opening only: not a continuation.
            {"hash_ids": [0, 1, 20, 21]},
            # The first one's next turn: its prompt but the partial last block (12, 13) hashed
            # anew, then more.
            {"hash_ids": [0, 1, 10, 11, 14, 15, 16, 17]},
            # A keyed row is left to its key.
            {"hash_ids": [0, 1, 10, 11, 14, 15, 16, 17, 18], "key": "k"},
            # The third turn, continuing the second.
            {"hash_ids": [0, 1, 10, 11, 14, 15, 16, 17, 30, 31]},
        ])
        session = rm.trace_sessions(trace, tail=2)
        assert session == {1: "line-1", 2: "line-2", 3: "line-1", 5: "line-1"}, session


def test_moves_are_counted_per_replica():
    with tempfile.TemporaryDirectory() as d:
        trace = write(d, "t.jsonl", [
            {"hash_ids": [0, 1, 10, 11]},
            {"hash_ids": [0, 1, 10, 11, 12, 13]},
            {"hash_ids": [0, 1, 10, 11, 12, 13, 14, 15]},
        ])
        run = write(d, "run.requests.jsonl", [
            record(1, 0, 2, 64, 0, 0.0),
            record(2, 1, 3, 96, 16, 10.0),   # the other replica, another rank: 48 tokens lost
            record(3, 1, 3, 128, 96, 20.0),  # the same replica, the same rank
        ])
        by_key = rm.sessions(run, rm.trace_sessions(trace, tail=2))
        assert list(by_key) == ["line-1"], by_key
        counts, lost = rm.transitions(by_key)
        assert counts == {("other replica", "moved"): 1, ("same replica", "stayed"): 1}, counts
        assert lost[("other replica", "moved")] == 48 and lost[("same replica", "stayed")] == 0, lost


if __name__ == "__main__":
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        t()
    print(f"test-replica-moves: {len(tests)} tests passed")
