#!/usr/bin/env python3
"""Checks scripts/convert-trace.py on small hand-made traces (run by `make unit`)."""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

if not __debug__:  # python -O strips every assert: the checks would pass unseen
    raise SystemExit(f"{__file__}: run without -O (its checks are asserts)")

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("convert_trace", os.path.join(HERE, "convert-trace.py"))
ct = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ct)


def lines(*rows):
    return [json.dumps(r) + "\n" for r in rows]


def test_blocks_are_split_and_prefixes_kept():
    rows = ct.convert(lines(
        {"timestamp": 1000, "hash_ids": [0, 1], "output_length": 500},
        {"timestamp": 1500, "hash_ids": [0, 2], "output_length": 3},
    ), block_tokens=64, requests=0, skip=0, max_output=32)
    assert [r["timestamp"] for r in rows] == [0, 500], rows
    a, b = rows[0]["hash_ids"], rows[1]["hash_ids"]
    assert len(a) == len(b) == 8, rows
    assert a[:4] == b[:4] and a[4] != b[4], "one shared 64-token block is four shared 16-token blocks"
    assert len(set(a) | set(b)) == 12
    assert [r["output_length"] for r in rows] == [32, 3]
    assert all("key" not in r for r in rows)


def test_a_partial_last_block_is_cut_to_the_input_length():
    trace = lines(
        {"timestamp": 0, "hash_ids": [0, 1], "input_length": 70, "output_length": 1},
        {"timestamp": 1, "hash_ids": [0, 2], "input_length": 128, "output_length": 1},
        {"timestamp": 2, "hash_ids": [0, 3], "input_length": 500, "output_length": 1},
    )
    rows = ct.convert(trace, block_tokens=64, requests=0, skip=0, max_output=0)
    # 70 tokens: 5 blocks of 16 (the last partial); 128: all 8; more than the ids hold: all 8.
    assert [len(r["hash_ids"]) for r in rows] == [5, 8, 8], rows
    assert rows[0]["hash_ids"] == [0, 1, 2, 3, 4]
    whole = ct.convert(trace, block_tokens=64, requests=0, skip=0, max_output=0, whole_blocks=True)
    assert [len(r["hash_ids"]) for r in whole] == [8, 8, 8], whole


def test_rows_are_sorted_then_cut():
    rows = ct.convert(lines(
        {"timestamp": 30, "hash_ids": [3], "output_length": 1},
        {"timestamp": 10, "hash_ids": [1], "output_length": 1},
        {"timestamp": 20, "hash_ids": [2], "output_length": 1},
    ), block_tokens=16, requests=1, skip=1, max_output=0)
    assert rows == [{"timestamp": 0, "hash_ids": [2], "output_length": 1}], rows


def test_chat_chains_name_their_root():
    rows = ct.convert(lines(
        {"timestamp": 0, "hash_ids": [1], "chat_id": 7, "parent_chat_id": -1},
        {"timestamp": 1, "hash_ids": [1, 2], "chat_id": 9, "parent_chat_id": 7},
        {"timestamp": 2, "hash_ids": [1, 2, 3], "chat_id": 12, "parent_chat_id": 9},
        {"timestamp": 3, "hash_ids": [5], "chat_id": 13, "parent_chat_id": -1},
    ), block_tokens=16, requests=0, skip=0, max_output=32)
    assert [r["key"] for r in rows] == ["chat-7", "chat-7", "chat-7", "chat-13"], rows


def test_bad_input_is_refused_with_its_line():
    for bad in ['{"timestamp": 0}', '{"timestamp": "x", "hash_ids": [1]}', "not json"]:
        try:
            ct.convert([bad + "\n"], block_tokens=16, requests=0, skip=0, max_output=32)
        except ValueError as e:
            assert "line 1" in str(e), e
        else:
            raise AssertionError(f"accepted {bad!r}")
    for blocks, requests, skip, why in [(24, 0, 0, "multiple of 16"), (0, 0, 0, "multiple of 16"),
                                        (-16, 0, 0, "multiple of 16"), (16, -1, 0, "negative"),
                                        (16, 0, -1, "negative")]:
        try:
            ct.convert([], block_tokens=blocks, requests=requests, skip=skip, max_output=32)
        except ValueError as e:
            assert why in str(e), e
        else:
            raise AssertionError(f"accepted blocks {blocks}, requests {requests}, skip {skip}")


def test_command_line_writes_jsonl():
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(lines({"timestamp": 5, "hash_ids": [4], "output_length": 9, "key": "s1"}))
        path = f.name
    try:
        out = subprocess.run([sys.executable, os.path.join(HERE, "convert-trace.py"), path,
                              "--block-tokens", "32"], capture_output=True, text=True, check=True).stdout
        assert [json.loads(x) for x in out.splitlines()] == [
            {"timestamp": 0, "hash_ids": [8, 9], "output_length": 9, "key": "s1"}], out
        bad = subprocess.run([sys.executable, os.path.join(HERE, "convert-trace.py"), path,
                              "--block-tokens", "20"], capture_output=True, text=True)
        assert bad.returncode != 0 and "multiple of 16" in bad.stderr, bad
    finally:
        os.unlink(path)


if __name__ == "__main__":
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        t()
    print(f"test-convert-trace: {len(tests)} tests passed")
