#!/usr/bin/env python3
"""How busy the rank a request went to was when it was sent, from a benchmark run's records.

Reads `dp-replay run` records (`<run>/*.requests.jsonl` of scripts/bench-affinity.py) and, for
each answered request, counts the requests in flight on every rank at the moment it was sent
(from each record's send time — scheduled time + lateness + turn wait — and its total time).
The request is then put in a class by how much of its prompt its rank had cached (fresh: under
30 %, part: under 80 %, cont: the rest) and by how many more requests its rank had in flight
than the least loaded rank (0, 1-2, 3+), with the class's mean wait for a slot (`queue_us`).

A placement that sends prompts it must compute anyway to a rank with a queue pays that queue in
its time to first token; this shows how often each policy does.

  scripts/load-at-placement.py <run>/<workload>-<policy>.requests.jsonl [...]
"""

import collections
import heapq
import json
import sys

FRESH, PART = 0.3, 0.8


def send_times(records):
    """(send µs, end µs) per answered record, in send order."""
    out = []
    for r in records:
        if r.get("status") != 200 or r.get("rank") is None or r.get("total_us") is None:
            continue
        sent = r["scheduled_ms"] * 1000 + (r.get("lateness_us") or 0) + (r.get("turn_wait_us") or 0)
        out.append((sent, sent + r["total_us"], r))
    out.sort(key=lambda x: x[0])
    return out


def cached_class(record):
    share = record["cached_tokens"] / max(1, record["prompt_tokens"])
    return "fresh" if share < FRESH else ("part" if share < PART else "cont")


def excess_class(excess):
    return "0" if excess == 0 else ("1-2" if excess < 3 else "3+")


def classify(records):
    """{(cached class, excess class): (requests, mean slot wait ms)}."""
    timed = send_times(records)
    ranks = 1 + max((r["rank"] for _, _, r in timed), default=0)
    counts, waits = collections.Counter(), collections.Counter()
    # Requests sent earlier and not ended yet, by end time: sends come in order, so one that has
    # ended before this send has ended before every later one too.
    running, inflight = [], [0] * ranks
    for sent, end, record in timed:
        while running and running[0][0] <= sent:
            inflight[heapq.heappop(running)[1]] -= 1
        key = (cached_class(record), excess_class(inflight[record["rank"]] - min(inflight)))
        counts[key] += 1
        waits[key] += (record.get("queue_us") or 0) / 1000
        heapq.heappush(running, (end, record["rank"]))
        inflight[record["rank"]] += 1
    return {k: (counts[k], waits[k] / counts[k]) for k in counts}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        table = classify(records)
        print(f"{path}: {sum(n for n, _ in table.values())} answered requests")
        print("| cached | in flight beyond the least loaded rank | requests | mean slot wait |")
        print("|---|---|---:|---:|")
        for (cached, excess), (n, wait) in sorted(table.items()):
            print(f"| {cached} | {excess} | {n} | {wait:.0f} ms |")


if __name__ == "__main__":
    main()
