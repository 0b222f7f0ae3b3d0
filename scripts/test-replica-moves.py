#!/usr/bin/env python3
"""Checks scripts/replica-moves.py on small hand-made runs (run by `make unit`)."""
import importlib.util
import json
import os
import tempfile

if not __debug__:  # python -O strips every assert: the checks would pass unseen
    raise SystemExit(f"{__file__}: run without -O (its checks are asserts)")

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


def placed(rank, choice, anchor, blocks, home=None):
    """One `placed:` debug line as Envoy logs it (the filter's format, src/host/mod.rs; `home`
    None: the format before the home's reason was logged)."""
    prefix = f"Some({choice} {{ rank: {rank}, blocks: 4 }})" if choice else "None"
    anchor = f"Some({anchor})" if anchor is not None else "None"
    home = f", home {home}" if home is not None else ""
    return (f"[2026-12-05 17:08:26.359][22113][debug][wasm] wasm log dp_affinity: [2] placed: "
            f"Direct {{ rank: {rank} }} (prefix {prefix}, anchor {anchor}, {blocks} blocks{home})\n")


def test_the_other_replicas_moves_are_split_by_anchor():
    with tempfile.TemporaryDirectory() as d:
        # Two sessions, each moved by the other replica: "a" within its home pair (the same
        # anchor on both replicas), "b" under another anchor. 128 tokens a 512-byte block.
        run = write(d, "run.requests.jsonl", [
            {**record(None, 0, 2, 1280, 0, 0.0), "key": "a"},
            {**record(None, 0, 1, 2560, 0, 1.0), "key": "b"},
            {**record(None, 1, 5, 1536, 0, 10.0), "key": "a"},
            {**record(None, 1, 3, 2816, 512, 11.0), "key": "b"},
        ])
        with open(os.path.join(d, "run-envoy0.log"), "w") as f:
            f.write("unrelated line\n")
            # Placed in the other order than sent: the join goes by rank and size.
            f.write(placed(1, "Hit", 7, 20))
            f.write(placed(2, "Spread", 42, 10, "-"))
        with open(os.path.join(d, "run-envoy1.log"), "w") as f:
            f.write(placed(5, "Spread", 42, 12, "home_second_work"))
            f.write(placed(3, None, 9, 22))
        by_key = rm.sessions(run)
        logs = rm.envoy_logs(run)
        assert sorted(logs) == [0, 1] and len(logs[0]) == 2, logs
        unjoined = rm.join_placements([r for t in by_key.values() for r in t], logs, 512)
        assert unjoined == 0, unjoined
        assert by_key["b"][1]["placement"] == {"rank": 3, "choice": None, "anchor": "9", "blocks": 22,
                                               "home": None}
        counts, lost = rm.other_replica_causes(by_key)
        assert counts == {"same anchor, other choice in its home pair": 1, "another anchor": 1}, counts
        assert lost == {"same anchor, other choice in its home pair": 1280, "another anchor": 2048}, lost
        reasons, reasons_lost = rm.same_anchor_home_reasons(by_key)
        assert reasons == {("-", "home_second_work"): 1}, reasons
        assert reasons_lost == {("-", "home_second_work"): 1280}, reasons_lost


def test_a_pinned_keys_line_is_read_too():
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "run-envoy0.log")
        with open(log, "w") as f:
            f.write("[2026-12-08 02:32:26.104][32301][debug][wasm] wasm log dp_affinity: [3] placed: "
                    "Pinned { hash: 548138539300487740, rank: 0, write_pin: true } (prefix "
                    "Some(Spread { rank: 1, blocks: 4 }), anchor Some(548138539300487740), 69 blocks, "
                    "home home_second_work)\n")
            f.write(placed(2, "Hit", 7, 20))
        assert rm.placed_lines(log) == [
            {"rank": 0, "choice": "Spread", "anchor": "548138539300487740", "blocks": 69,
             "home": "home_second_work"},
            {"rank": 2, "choice": "Hit", "anchor": "7", "blocks": 20, "home": None},
        ]


def test_a_request_without_its_log_line_is_not_joined():
    with tempfile.TemporaryDirectory() as d:
        run = write(d, "run.requests.jsonl", [
            {**record(None, 0, 2, 1280, 0, 0.0), "key": "a"},
            {**record(None, 1, 5, 1536, 0, 10.0), "key": "a"},
        ])
        with open(os.path.join(d, "run-envoy0.log"), "w") as f:
            f.write(placed(2, "Spread", 42, 10))
        with open(os.path.join(d, "run-envoy1.log"), "w") as f:
            f.write(placed(5, "Spread", 42, 30))  # another prompt size: not this request
        by_key = rm.sessions(run)
        assert rm.join_placements([r for t in by_key.values() for r in t], rm.envoy_logs(run), 512) == 1
        counts, _ = rm.other_replica_causes(by_key)
        assert counts == {"not joined": 1}, counts


if __name__ == "__main__":
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        t()
    print(f"test-replica-moves: {len(tests)} tests passed")
