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
  scripts/replica-moves.py --placements FILE # why the other replica moved a turn (see below)

`--placements` reads the filter's decisions from the run's Envoy logs (`<run>-envoy<i>.log` beside
`<run>.requests.jsonl`; the run needs `BENCH_ENVOY_LOG=debug`, which logs one `placed:` line per
request: rank, prefix choice, anchor, prompt blocks) and splits the turns the other replica
moved by cause: the same anchor on both replicas (the same home pair, a different choice within
it: the two load views disagreed) or another anchor (the replicas' indexes knew different
shared prefixes, so the conversation was named past a different depth). Same-anchor moves are
then split by why each of the two turns' homes was its rank, as the filter logged it: the
first choice (`-`), or its second because the first was given clearly more work
(`home_second_work`) or had a queue forming (`home_second_queue`), or the first was full
(`home_full`): the replica whose view of the load sent its turn away. A log line is joined
to its request by replica, rank and prompt size (`--block-bytes`, 4 bytes per token as the
bench's prompts), in send order; requests that find no line are counted as not joined.

A trace without keys (Mooncake's) names no sessions; `--trace` (the JSONL the run replayed)
infers them from its prompts: a request continues the latest earlier one whose prompt, all but
its last `--tail-ids` block ids, begins its own (a trace's last block is partial and hashed
anew once the next turn extends it: 32 of the bench's 16-token ids for Mooncake's 512-token
blocks) and reaches past that many ids (so a shared opening block alone makes no session).

Nothing is started; it only reads the files.
"""
import argparse
import collections
import glob
import json
import re
import sys

# The filter's debug line for a placement on a rank (src/host/mod.rs): the plan's target, the
# prefix stage's choice, the anchor naming the home, the prompt's size in blocks.
# Since the `home_*` counters it ends with why the home is its rank when the request went home
# (`home_second_work`, `home_second_queue`, `home_full`; `-` otherwise); older logs lack it.
# A keyed request the filter pins logs `Pinned { hash: …, rank: N, write_pin: … }` instead.
PLACED = re.compile(r"placed: (?:Direct \{ rank: (?P<rank>\d+) \}|Pinned \{ hash: \d+, rank: (?P<pinned>\d+)[^}]*\}) "
                    r"\(prefix (?:None|Some\((?P<choice>\w+)[^)]*\)), "
                    r"anchor (?:Some\((?P<anchor>\d+)\)|None), (?P<blocks>\d+) blocks(?:, home (?P<home>[\w-]+))?\)")
# Prompt bytes per token in the bench's requests (dp-replay's text.rs, BYTES_PER_TOKEN).
BYTES_PER_TOKEN = 4
# How far past the earliest unjoined log line a request's line may be (requests sent together
# are placed in any order by Envoy's workers).
JOIN_WINDOW = 64


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


def repeated_not_cached(before, after):
    """The prompt tokens a turn repeats of the one before it (its prompt, at most) that its rank
    did not have cached."""
    return max(0, min(before["prompt_tokens"], after["prompt_tokens"]) - after["cached_tokens"])


def transitions(by_key):
    """(counts, lost tokens) per class: same|other replica, stayed|moved."""
    counts, lost = collections.Counter(), collections.Counter()
    for turns in by_key.values():
        for before, after in zip(turns, turns[1:]):
            replica = "same replica" if before["target"] == after["target"] else "other replica"
            moved = "moved" if before["rank"] != after["rank"] else "stayed"
            cls = (replica, moved)
            counts[cls] += 1
            lost[cls] += repeated_not_cached(before, after)
    return counts, lost


def placed_lines(log_path):
    """The `placed:` lines of one Envoy log, in order: dicts rank, choice, anchor, blocks."""
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            m = PLACED.search(line)
            if m:
                out.append({"rank": int(m.group("rank") or m.group("pinned")), "choice": m.group("choice"),
                            "anchor": m.group("anchor"), "blocks": int(m.group("blocks")),
                            "home": m.group("home")})
    return out


def join_placements(records, logs, block_bytes):
    """Adds `placement` (a `placed_lines` dict, or None) to every record: per replica (`logs`:
    target -> its lines), in send order, the first unjoined line within JOIN_WINDOW with the
    record's rank and prompt size. Returns how many records found none."""
    unjoined = 0
    for target, lines in logs.items():
        used, start, last = [False] * len(lines), 0, 0
        mine = sorted((r for r in records if r.get("target") == target),
                      key=lambda r: r["scheduled_ms"] + r.get("lateness_us", 0) / 1000)
        for r in mine:
            blocks = r["prompt_tokens"] * BYTES_PER_TOKEN // block_bytes
            r["placement"] = None
            for j in range(start, min(len(lines), start + JOIN_WINDOW)):
                p = lines[j]
                if not used[j] and p["rank"] == r["rank"] and abs(p["blocks"] - blocks) <= 1:
                    used[j], r["placement"], last = True, p, j
                    break
            else:
                unjoined += 1
            # A line no answered request claims (a failed one's) must not hold the window back.
            while start < len(lines) and (used[start] or start < last - JOIN_WINDOW):
                start += 1
    unjoined += sum(1 for r in records if r.get("target") not in logs)
    return unjoined


def envoy_logs(path):
    """target -> `placed_lines` of the Envoy logs written beside a run's requests file."""
    base = path[: -len(".requests.jsonl")] if path.endswith(".requests.jsonl") else path
    logs = {}
    for log in glob.glob(glob.escape(base) + "-envoy*.log"):
        m = re.search(r"-envoy(\d+)\.log$", log)
        if m:
            logs[int(m.group(1))] = placed_lines(log)
    return logs


def moved_by_other_replica(by_key):
    """The (earlier, later) turn pairs whose later turn went through the other replica and
    reached another rank."""
    for turns in by_key.values():
        for before, after in zip(turns, turns[1:]):
            if before["target"] != after["target"] and before["rank"] != after["rank"]:
                yield before, after


def tally(pairs, classify):
    """(counts, lost tokens) of `pairs` by `classify(earlier placement, later placement)`; a
    pair it classifies as None is left out."""
    counts, lost = collections.Counter(), collections.Counter()
    for before, after in pairs:
        cls = classify(before.get("placement"), after.get("placement"))
        if cls is not None:
            counts[cls] += 1
            lost[cls] += repeated_not_cached(before, after)
    return counts, lost


def same_anchor(a, b):
    return a is not None and b is not None and a["anchor"] is not None and a["anchor"] == b["anchor"]


def other_replica_causes(by_key):
    """(counts, lost tokens) of the turns the other replica moved, by cause: same anchor (the
    load views chose differently within one home pair), another anchor, or not joined."""
    def cause(a, b):
        if a is None or b is None:
            return "not joined"
        return "same anchor, other choice in its home pair" if same_anchor(a, b) else "another anchor"
    return tally(moved_by_other_replica(by_key), cause)


def same_anchor_home_reasons(by_key):
    """(counts, lost tokens) of the same-anchor turns the other replica moved, by the homes'
    reasons on the earlier and the later turn (`?` where the log line does not say)."""
    def reasons(a, b):
        return (a.get("home") or "?", b.get("home") or "?") if same_anchor(a, b) else None
    return tally(moved_by_other_replica(by_key), reasons)


def report(path, show_sessions, inferred, block_bytes=None):
    by_key = sessions(path, inferred)
    counts, lost = transitions(by_key)
    if block_bytes:
        logs = envoy_logs(path)
        if not any(logs.values()):
            raise ValueError("no `placed:` lines in the Envoy logs beside it (run with BENCH_ENVOY_LOG=debug)")
        unjoined = join_placements([r for turns in by_key.values() for r in turns], logs, block_bytes)
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
    if block_bytes:
        causes, causes_lost = other_replica_causes(by_key)
        print(f"\nTurns the other replica moved, by cause ({unjoined} requests not joined to a log line):\n")
        print("| cause | turns | repeated tokens not cached | share of all prompt tokens |")
        print("|---|---:|---:|---:|")
        for cause in ("same anchor, other choice in its home pair", "another anchor", "not joined"):
            share = f"{causes_lost[cause] / total:.3f}" if total else "—"
            print(f"| {cause} | {causes[cause]} | {causes_lost[cause]} | {share} |")
        reasons, reasons_lost = same_anchor_home_reasons(by_key)
        if reasons:
            print("\nSame-anchor moves by why each turn's home was its rank (earlier turn / later turn):\n")
            print("| earlier turn's home | later turn's home | turns | repeated tokens not cached |")
            print("|---|---|---:|---:|")
            for (a, b), n in reasons.most_common():
                print(f"| {a} | {b} | {n} | {reasons_lost[(a, b)]} |")
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
    ap.add_argument("--placements", action="store_true",
                    help="split the other replica's moves by cause, from the run's Envoy debug logs")
    ap.add_argument("--block-bytes", type=int, default=512,
                    help="prefix.block_bytes of the run's filter, to join log lines (default 512)")
    ap.add_argument("--tail-ids", type=int, default=32,
                    help="trailing block ids of a prompt its next turn may not repeat (default 32)")
    args = ap.parse_args()
    if args.block_bytes <= 0:
        sys.exit("--block-bytes must be positive")
    try:
        inferred = trace_sessions(args.trace, args.tail_ids) if args.trace else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"{args.trace}: {e}")
    for path in args.files:
        try:
            report(path, args.sessions, inferred, args.block_bytes if args.placements else None)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"{path}: {e}")


if __name__ == "__main__":
    main()
