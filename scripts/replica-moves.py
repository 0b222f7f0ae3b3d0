#!/usr/bin/env python3
"""Where a conversation's turns went, from `dp-replay`'s per-request records.

For every pair of consecutive turns of a session (same `key`, in send order) it says whether the
two went through the same router replica (`target`: which Envoy or gateway of the run) and
whether they reached the same rank, and how many prompt tokens the later turn could have found
cached but did not (the earlier turn's prompt, which it repeats, minus what the rank had cached).
Behind two replicas this tells the loss of a placement apart: a turn moved by its own replica
(load, bounds) or a turn that the other replica placed differently.

  scripts/replica-moves.py results/affinity-<UTC>/*2Envoyreplicas*filter-shipped.requests.jsonl
  scripts/replica-moves.py --sessions FILE   # also list the sessions that moved, turn by turn
  scripts/replica-moves.py --trace T FILE    # a keyless trace: sessions from the prompts of T

A trace without keys (Mooncake's) names no sessions; `--trace` (the JSONL the run replayed)
infers them from its prompts: a request continues the latest earlier one whose prompt, all but
its last `--tail-ids` block ids, begins its own (a trace's last block is partial and hashed
anew once the next turn extends it: 32 of the bench's 16-token ids for Mooncake's 512-token
blocks) and reaches past that many ids (so a shared opening block alone makes no session).

Nothing is started; it only reads the files.
"""
import argparse
import collections
import json
import sys


def trace_sessions(path, tail):
    """Trace line (1-based) -> inferred session, for the trace's rows without a key."""
    ends, session = {}, {}  # chain hash of a prompt cut 0..tail ids short -> its line
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("key") is not None:
                continue
            ids, chain, parent = row["hash_ids"], 0, None
            prefixes = []
            for depth, block in enumerate(ids, 1):
                chain = hash((chain, block))
                prefixes.append(chain)
                if depth > tail and chain in ends:
                    parent = ends[chain]
            session[line_no] = session[parent] if parent else f"line-{line_no}"
            for cut in range(min(tail, len(prefixes) - 1) + 1):
                ends[prefixes[len(prefixes) - 1 - cut]] = line_no
    return session


def sessions(path, inferred=None):
    """Records of answered requests grouped by session key (for keyless requests, the
    `inferred` session of their trace line when given), each list in send order."""
    inferred = inferred or {}
    by_key = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if r.get("status") == 200 and r.get("rank") is not None:
                key = r["key"] if r["key"] is not None else inferred.get(r.get("line"))
                by_key[key].append(r)
    for turns in by_key.values():
        turns.sort(key=lambda r: r["scheduled_ms"])
    return by_key


def transitions(by_key):
    """(counts, lost tokens) per class: same|other replica, stayed|moved."""
    counts, lost = collections.Counter(), collections.Counter()
    for turns in by_key.values():
        for before, after in zip(turns, turns[1:]):
            replica = "same replica" if before["target"] == after["target"] else "other replica"
            moved = "moved" if before["rank"] != after["rank"] else "stayed"
            cls = (replica, moved)
            counts[cls] += 1
            repeated = min(before["prompt_tokens"], after["prompt_tokens"])
            lost[cls] += max(0, repeated - after["cached_tokens"])
    return counts, lost


def report(path, show_sessions, inferred):
    by_key = sessions(path, inferred)
    counts, lost = transitions(by_key)
    total = sum(r["prompt_tokens"] for turns in by_key.values() for r in turns)
    print(f"## {path}")
    print(f"{len(by_key)} sessions, {sum(1 for t in by_key.values() if len(t) > 1)} with more "
          f"than one turn, {total} prompt tokens")
    print("| next turn through | rank | turns | repeated tokens not cached | share of all prompt tokens |")
    print("|---|---|---:|---:|---:|")
    for replica in ("same replica", "other replica"):
        for moved in ("stayed", "moved"):
            n, miss = counts[(replica, moved)], lost[(replica, moved)]
            share = f"{miss / total:.3f}" if total else "—"
            print(f"| {replica} | {moved} | {n} | {miss} | {share} |")
    if show_sessions:
        for key, turns in by_key.items():
            if any(a["rank"] != b["rank"] for a, b in zip(turns, turns[1:])):
                print(key, " ".join(
                    f"e{r['target']}r{r['rank']}:{r['prompt_tokens']}/{r['cached_tokens']}" for r in turns))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="*.requests.jsonl written by bench-affinity.py")
    ap.add_argument("--sessions", action="store_true",
                    help="list every session whose rank changed: e<replica>r<rank>:<prompt>/<cached> per turn")
    ap.add_argument("--trace", help="the JSONL trace the run replayed: sessions of keyless requests from its prompts")
    ap.add_argument("--tail-ids", type=int, default=32,
                    help="trailing block ids of a prompt its next turn may not repeat (default 32)")
    args = ap.parse_args()
    try:
        inferred = trace_sessions(args.trace, args.tail_ids) if args.trace else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"{args.trace}: {e}")
    for path in args.files:
        try:
            report(path, args.sessions, inferred)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"{path}: {e}")


if __name__ == "__main__":
    main()
