#!/usr/bin/env python3
"""Writes envoy/envoy.yaml for another number of ranks, or other rank addresses.

The shipped envoy/envoy.yaml serves 4 ranks on 127.0.0.1:18000..18003. Going to N ranks takes
four edits that must agree: the plugin's `dp_size`, one `dp-rank-<r>` cluster per rank (the
filter's `target.cluster_template`), every rank in the fallback cluster `dp-all`, and the rank of
each address in `learn.upstream_addresses`. This makes all four from the shipped file, changing
nothing else (every other setting, the listener and the routes stay as shipped):

    scripts/envoy-for-ranks.py 8 > envoy-8.yaml                  # 127.0.0.1:18000..18007
    scripts/envoy-for-ranks.py 8 --base-port 30000 --host 10.0.0.5 > envoy-8.yaml
    scripts/envoy-for-ranks.py --endpoints 10.0.0.5:8000,10.0.0.6:8000 > envoy-2.yaml
    scripts/envoy-for-ranks.py 4 --listen-port 10001 --admin-port 9902 > replica-2.yaml

The last is a second Envoy replica on the same machine (run it with `--base-id 1` or
`--disable-hot-restart`, so the two Envoys' hot-restart regions do not clash); replicas share
nothing, and each places a conversation the same way (README, "Prefix placement").

Rank r is the r-th address. Comments of the shipped file are not kept. `RANKS=8 make run` uses
it; `make validate` has Envoy validate an 8-rank copy. Needs PyYAML (.tools/venv/bin/python).
"""
import argparse
import copy
import json
import os
import sys

try:
    import yaml
except ImportError:  # pragma: no cover - message for a bare python3
    sys.exit("envoy-for-ranks: PyYAML missing; run with .tools/venv/bin/python (make tools)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "envoy", "envoy.yaml")
WASM_FILTER = "envoy.filters.http.wasm"
MAX_RANKS = 4096  # the filter's dp_size bound
FALLBACK = "dp-all"  # the cluster route 2 balances over when the filter decides nothing


def parse_endpoint(text):
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not host:port: {text!r}")
    return host.strip("[]"), int(port)


def plugin_config(doc):
    """The Wasm filter's embedded plugin configuration: (the StringValue dict, its parsed JSON)."""
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for hf in f["typed_config"].get("http_filters", []):
                    if hf["name"] == WASM_FILTER:
                        holder = hf["typed_config"]["config"]["configuration"]
                        return holder, json.loads(holder["value"])
    raise ValueError("no Wasm filter in the shipped config")


def endpoint_of(host, port):
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def set_port(address_holder, port):
    address_holder["address"]["socket_address"]["port_value"] = port


def for_ranks(doc, endpoints, listen_port=None, admin_port=None):
    """A copy of `doc` (the shipped config, parsed) serving one rank per endpoint, listening on
    `listen_port` and `admin_port` when given."""
    doc = copy.deepcopy(doc)
    if listen_port is not None:
        for listener in doc["static_resources"]["listeners"]:
            set_port(listener, listen_port)
    if admin_port is not None:
        set_port(doc["admin"], admin_port)
    holder, cfg = plugin_config(doc)
    template = cfg["target"]["cluster_template"]
    clusters = doc["static_resources"]["clusters"]
    by_name = {c["name"]: c for c in clusters}
    rank_cluster, fallback = by_name.get(template.replace("{rank}", "0")), by_name.get(FALLBACK)
    if rank_cluster is None or fallback is None:
        raise ValueError(f"the config has no cluster {template.replace('{rank}', '0')!r} or {FALLBACK!r} to copy")
    others = [c for c in clusters if c is not fallback and not c["name"].startswith(template.split("{rank}")[0])]
    ranks = []
    for r, (host, port) in enumerate(endpoints):
        c = copy.deepcopy(rank_cluster)
        c["name"] = template.replace("{rank}", str(r))
        c["load_assignment"]["cluster_name"] = c["name"]
        c["load_assignment"]["endpoints"] = [{"lb_endpoints": [endpoint_of(host, port)]}]
        ranks.append(c)
    fallback["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [endpoint_of(host, port) for host, port in endpoints]}
    ]
    doc["static_resources"]["clusters"] = ranks + [fallback] + others
    cfg["dp_size"] = len(endpoints)
    cfg.setdefault("learn", {})["upstream_addresses"] = {
        (f"[{host}]:{port}" if ":" in host else f"{host}:{port}"): r for r, (host, port) in enumerate(endpoints)
    }
    holder["value"] = json.dumps(cfg, indent=2) + "\n"
    return doc


class BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (the plugin configuration) as literal blocks, as shipped."""


BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ranks", nargs="?", type=int, help="number of ranks (addresses host:base-port+r)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--base-port", type=int, default=18000)
    ap.add_argument("--endpoints", help="comma-separated host:port of each rank, in rank order")
    ap.add_argument("--listen-port", type=int, help="the listener's port (default: as shipped, 10000)")
    ap.add_argument("--admin-port", type=int, help="the admin port (default: as shipped, 9901)")
    ap.add_argument("--config", default=SHIPPED, help="the config to start from (default: the shipped one)")
    args = ap.parse_args()
    if (args.ranks is None) == (args.endpoints is None):
        ap.error("give a number of ranks or --endpoints, not both")
    try:
        if args.endpoints is not None:
            endpoints = [parse_endpoint(e.strip()) for e in args.endpoints.split(",") if e.strip()]
        else:
            if args.base_port + args.ranks > 65536 or args.base_port < 1:
                raise ValueError(f"ports {args.base_port}..{args.base_port + args.ranks - 1} out of range")
            endpoints = [(args.host, args.base_port + r) for r in range(args.ranks)]
        if not 1 <= len(endpoints) <= MAX_RANKS:
            raise ValueError(f"need 1..{MAX_RANKS} ranks, got {len(endpoints)}")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError("an address is given for two ranks")
        for name, port in (("--listen-port", args.listen_port), ("--admin-port", args.admin_port)):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} {port} out of range")
    except ValueError as e:
        ap.error(str(e))
    with open(args.config) as f:
        doc = yaml.safe_load(f)
    try:
        out = for_ranks(doc, endpoints, args.listen_port, args.admin_port)
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"envoy-for-ranks: {args.config}: {e}")
    sys.stdout.write(f"# Generated by scripts/envoy-for-ranks.py from {os.path.relpath(args.config, ROOT)}: "
                     f"{len(endpoints)} ranks.\n")
    yaml.dump(out, sys.stdout, Dumper=BlockDumper, sort_keys=False, width=100)


if __name__ == "__main__":
    main()
