#!/usr/bin/env python3
"""Turns a public block-id trace into the bench's trace format, so `scripts/bench-affinity.py
--suite kv --trace FILE` can replay it through Envoy into the mock ranks.

Input: one JSON object a line with `timestamp` (ms), `hash_ids` (one id per KV block of
`--block-tokens` tokens) and `output_length`, as the Mooncake traces (FAST'25 release:
`conversation_trace.jsonl`, `toolagent_trace.jsonl`, 512-token blocks) and the Qwen Bailian
usage traces (16-token blocks) write them. A session key, when the trace has one, comes from
`key`, `session_id`, or the root of a `chat_id` / `parent_chat_id` chain; without one the trace
is replayed keyless only.

Output: the same requests with every block id expanded into `block-tokens / 16` ids of the
bench's 16-token blocks (the prefix structure is kept exactly: two prompts share a prefix of k
of the input's blocks iff they share 16-token blocks), cut to the row's `input_length` (in
16-token blocks, rounded up: a prompt's last block is usually partial; `--whole-blocks` keeps
every block whole, as the figures in BENCHMARKS.md before 2026-12-08 were replayed: Mooncake's
first 2000 conversation rows are then 1.8 % longer), timestamps from 0, the first
`--requests` rows (`--skip` drops some first), output lengths capped at `--max-output` (the
bench's engine model makes uncached prefill the main cost; a trace's long answers would make
the decode of other requests the whole wait). Nothing is fetched: get the trace yourself.

  scripts/convert-trace.py conversation_trace.jsonl --block-tokens 512 --requests 2000 > t.jsonl
"""
import argparse
import json
import sys

BENCH_BLOCK_TOKENS = 16


def session_of(row, roots):
    """The row's session key, or None: `key`, `session_id`, or the root of its chat chain."""
    for field in ("key", "session_id"):
        if row.get(field) is not None:
            return str(row[field])
    chat = row.get("chat_id")
    if chat is None:
        return None
    parent = row.get("parent_chat_id")
    root = roots.get(parent, parent) if parent not in (None, -1, "") else chat
    roots[chat] = root
    return f"chat-{root}"


def convert(lines, block_tokens, requests, skip, max_output, whole_blocks=False):
    """The converted rows (dicts), in arrival order."""
    if block_tokens <= 0 or block_tokens % BENCH_BLOCK_TOKENS:
        raise ValueError(f"--block-tokens must be a positive multiple of {BENCH_BLOCK_TOKENS}")
    if requests < 0 or skip < 0 or max_output < 0:
        raise ValueError("--requests, --skip and --max-output must not be negative")
    split = block_tokens // BENCH_BLOCK_TOKENS
    rows, roots = [], {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
            ids = [int(h) for h in row["hash_ids"]]
            stamp = float(row["timestamp"])
            length = None if whole_blocks or row.get("input_length") is None else int(row["input_length"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"line {n}: not a block-id trace row ({e})") from None
        key = session_of(row, roots)
        rows.append((stamp, ids, int(row.get("output_length") or 0), key, length))
    rows.sort(key=lambda r: r[0])
    rows = rows[skip:skip + requests] if requests else rows[skip:]
    if not rows:
        return []
    start = rows[0][0]
    out = []
    for stamp, ids, output, key, length in rows:
        blocks = [h * split + i for h in ids for i in range(split)]
        if length is not None and length > 0:
            blocks = blocks[:-(-length // BENCH_BLOCK_TOKENS)]
        r = {
            "timestamp": round(stamp - start, 3),
            "hash_ids": blocks,
            "output_length": min(output, max_output) if max_output else output,
        }
        if key is not None:
            r["key"] = key
        out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="the public trace (JSONL)")
    ap.add_argument("--block-tokens", type=int, required=True,
                    help="tokens per block id in the input (Mooncake: 512; Qwen Bailian: 16)")
    ap.add_argument("--requests", type=int, default=2000, help="rows to keep (0: all); default 2000")
    ap.add_argument("--skip", type=int, default=0, help="rows to drop first; default 0")
    ap.add_argument("--max-output", type=int, default=32, help="cap on output_length (0: none); default 32")
    ap.add_argument("--whole-blocks", action="store_true",
                    help="ignore input_length: every block whole (how figures before 2026-12-08 were replayed)")
    args = ap.parse_args()
    with open(args.trace) as f:
        try:
            rows = convert(f, args.block_tokens, args.requests, args.skip, args.max_output, args.whole_blocks)
        except ValueError as e:
            sys.exit(f"convert-trace: {args.trace}: {e}")
    for r in rows:
        sys.stdout.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
