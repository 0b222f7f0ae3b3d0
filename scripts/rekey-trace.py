#!/usr/bin/env python3
"""Gives the requests of a bench trace keys that name more than one conversation, as clients
that send an end user's id (OpenAI's `user`) or an application's `prompt_cache_key` do, so
`scripts/bench-affinity.py --suite kv --trace FILE` shows what such keys do to each policy.

Input: a bench trace whose requests carry their session's `key` (the kv suite writes one per
run, `results/affinity-<UTC>/trace-kv-<R>ranks.jsonl`; `scripts/convert-trace.py` makes one of
a public trace). Output: the same requests, every `key` replaced by `--key` (one key for
everything), or by one of `--users N` keys, `user-0` .. `user-<N-1>`, the same for every request
of a session (chosen by a stable hash of its key, so a session never changes user). Each row
keeps its conversation as `session` (its old key), so `dp-replay run` still sends a
conversation's turns one after the other, and other conversations sharing the key meanwhile.

  scripts/rekey-trace.py results/affinity-<UTC>/trace-kv-4ranks.jsonl --key benchmark > one-key.jsonl
  scripts/rekey-trace.py results/affinity-<UTC>/trace-kv-4ranks.jsonl --users 3 > three-users.jsonl
"""
import argparse
import hashlib
import json
import sys


def user_of(key, users):
    """One of `users` keys for a session key, the same on every run."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return f"user-{int.from_bytes(digest[:8], 'big') % users}"


def rekey(rows, key=None, users=None):
    """The rows with their keys replaced; a row without a key is an error (it names no session)."""
    out = []
    for i, row in enumerate(rows, 1):
        if not isinstance(row.get("key"), str):
            raise ValueError(f"request {i} has no session key to replace")
        new = dict(row)
        new.setdefault("session", row["key"])
        new["key"] = key if key is not None else user_of(row["key"], users)
        out.append(new)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", help="one key for every request")
    which.add_argument("--users", type=int, help="this many keys, one per session's user")
    args = ap.parse_args()
    if args.users is not None and args.users < 1:
        ap.error("--users must be at least 1")
    with open(args.trace, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    try:
        out = rekey(rows, args.key, args.users)
    except ValueError as e:
        print(f"rekey-trace: {e}", file=sys.stderr)
        return 1
    for row in out:
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
