#!/usr/bin/env python3
"""An offline model of keyless home placement on the KV-cache-trace shape (`kv_trace()` of
scripts/bench-affinity.py, regenerated here per seed): which rule for a new conversation's home
trades hit rate against balance how, with one and with two replicas. Not the filter: each replica
knows the conversations it served (its prefix index) and keeps them on their rank; a conversation
new to a replica goes to the home the rule picks from that replica's own view of the recent work
(prompt blocks sent to each rank, decayed by 1/8 a second). A rank's cache holds what it served.
It has no timing, queues or load bounds: it isolates the home rule. Runs in seconds.

  scripts/placement-model.py            # every rule, 4 and 8 ranks, 1 and 2 replicas, 12 seeds

Rules: top1 (the first rendezvous rank), two (the less worked of the top two), margin (the second
only if it would still have less after taking the request), sig (the filter's rule: the second
only if the first's excess is beyond the request plus sqrt((first + second) x blocks)), least
(the least worked rank of all: the balance a sticky greedy placement can reach). With two
replicas each rule also runs with "one shared view": the replicas read the same recent work, as
they would if both polled one load report (the engines'), to tell how much of the two-replica
loss comes from their different views and how much from deciding at different moments.
"""
import hashlib
import math
import random


def kv_trace(ranks, seed):
    """(time s, session, turn, prompt blocks) in arrival order, the shape of kv_trace()."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for s in range(48 * ranks):
        start += rng.expovariate(1.5 * ranks)
        size = 32 + (rng.randint(40, 160) if rng.random() < 0.15 else 0) + rng.randint(150, 700)
        u = rng.random()
        turns = 1 if u < 0.55 else 2 if u < 0.85 else 3 if u < 0.94 else rng.randint(6, 20)
        t = start
        for k in range(turns):
            out.append((t, s, k, size))
            size += 4 + rng.randint(8, 40)
            t += 0.8 + rng.expovariate(1 / 0.6)
    out.sort()
    return out


def weight(key, rank):
    return hashlib.blake2b(f"{key}:{rank}".encode(), digest_size=8).digest()


def home(rule, work, order, size):
    first, second = order[0], order[1]
    if rule == "top1":
        return first
    if rule == "two":
        return second if work[second] < work[first] else first
    if rule == "margin":
        return second if work[second] + size < work[first] else first
    if rule == "sig":
        excess = work[first] - work[second] - size
        return second if excess > 0 and excess * excess > (work[first] + work[second]) * size else first
    if rule == "least":
        return min(order, key=lambda r: work[r])
    raise ValueError(rule)


def run(ranks, replicas, rule, seed, one_view=False):
    """(hit share of the oracle, max/mean prompt blocks per rank). one_view: every replica reads
    and adds to the same recent work (as if all polled one shared load report), while each still
    knows only the conversations it served."""
    rng = random.Random(seed + 1000)
    views = 1 if one_view else replicas
    work = [[0] * ranks for _ in range(views)]
    tick = [0.0] * views
    known = [dict() for _ in range(replicas)]
    cached, tokens = {}, [0] * ranks
    hit = oracle = 0
    served_before = {}
    for t, s, _, size in kv_trace(ranks, seed):
        r = rng.randrange(replicas)
        v = 0 if one_view else r
        while tick[v] + 1 <= t:
            tick[v] += 1
            work[v] = [n - math.ceil(n / 8) for n in work[v]]
        if s not in known[r]:
            order = sorted(range(ranks), key=lambda x: weight(s, x), reverse=True)
            known[r][s] = home(rule, work[v], order, size)
        rank = known[r][s]
        work[v][rank] += size
        tokens[rank] += size
        system = 32 if cached.get((rank, "system")) else 0
        hit += max(cached.get((rank, s), 0), system)
        oracle += max(served_before.get(s, 0), 32 if oracle or hit or sum(tokens) > size else 0)
        cached[(rank, "system")] = True
        cached[(rank, s)] = size
        served_before[s] = size
    return hit / oracle, max(tokens) / (sum(tokens) / ranks)


def main():
    seeds = range(23, 35)
    print("| ranks | replicas | rule | hit ÷ oracle | max/mean blocks (mean of seeds) | worst seed |")
    print("|---:|---:|---|---:|---:|---:|")
    for ranks, replicas in [(4, 1), (8, 1), (4, 2), (8, 2)]:
        for rule in ["top1", "two", "margin", "sig", "least"]:
            for one_view in [False, True] if replicas > 1 and rule != "top1" else [False]:
                res = [run(ranks, replicas, rule, seed, one_view) for seed in seeds]
                hit = sum(h for h, _ in res) / len(res)
                bal = sum(b for _, b in res) / len(res)
                label = f"{rule}, one shared view" if one_view else rule
                print(f"| {ranks} | {replicas} | {label} | {hit:.3f} | {bal:.2f} | {max(b for _, b in res):.2f} |")


if __name__ == "__main__":
    main()
