#!/usr/bin/env python3
"""Validate the deployment manifests (deploy/) and the one-engine Envoy configs without a cluster.

No Kubernetes, Istio, Envoy Gateway or Docker runs on the build machines, so this checks what can
be checked here, with a real Envoy wherever Envoy config is involved:
  * every YAML/JSON file under deploy/ parses, and every manifest document has apiVersion, kind
    and metadata.name;
  * deploy/wasm-image/Dockerfile: FROM scratch, one COPY of the built filter to /plugin.wasm (the
    layout Istio and Envoy Gateway fetch), its source exists after `make build`, is a wasm
    module, and is not excluded by Dockerfile.dockerignore;
  * every embedded Envoy config is run through `envoy --mode validate` (which loads the real
    .wasm and runs the filter's on_configure, so a plugin configuration it refuses fails here):
      - Istio: a representative gateway listener is generated from the set's VirtualService and
        DestinationRule (Istio's cluster names and route shape), the EnvoyFilter patches are
        applied to it (LISTENER / HTTP_FILTER / HTTP_ROUTE, with Istio's MERGE and INSERT
        semantics), and two forms are validated: as istiod sends it (the filter fetched over ADS
        through config_discovery) and as Envoy runs it once the extension config arrived and the
        Istio agent replaced the oci:// code with a local file (the built .wasm here);
      - a WasmPlugin / EnvoyExtensionPolicy becomes the Wasm filter its control plane generates
        (without allow_on_headers_stop_iteration, which neither can set);
      - Envoy Gateway: a representative listener named <ns>/<gateway>/<listener> with routes
        from the HTTPRoutes (each route's idle_timeout as Envoy Gateway's translator sets it from
        the request timeout and a BackendTrafficPolicy's streamIdleTimeout) and the
        ClientTrafficPolicy's buffer limit; the EnvoyPatchPolicy's JSON patches (RFC 6902) are
        applied to it and the result validated;
      - envoy/envoy.sglang-dp.yaml and envoy/envoy.vllm-dp.yaml as they are;
      - envoy/envoy.yaml for 8 ranks as scripts/envoy-for-ranks.py writes it (dp_size, one
        cluster per rank, dp-all, learn.upstream_addresses agree; nothing else changed);
  * consistency: each embedded plugin configuration equals envoy/envoy.yaml's except for the
    variant's deliberate differences (header-only: no body fields, no prefix; engine: the target
    block; everywhere: no upstream_addresses); body-reading filters carry the flag and a buffer
    limit above body.max_bytes; header-only ones never read the body; one route per rank whose
    header value is cluster_template(rank), to the backend (DestinationRule subset, Service)
    selecting that rank's StatefulSet pod; all manifests name the same wasm image. Fields an
    operator is told to set (routing_key.hash_seed, assign.seed, the engine preset sglang or
    vllm) may differ. A silent rank is ended: Istio routes carry per_try_idle_timeout (merged
    by an HTTP_ROUTE EnvoyFilter), no Envoy Gateway route is left without a stream idle
    timeout. Upstream connections close idle before the engine's 5 s keep-alive (Istio's
    connectionPool.http.idleTimeout, Envoy Gateway's connectionIdleTimeout).

What this does not show: that a control plane accepts the manifests (no API server, no CRD
schemas) or generates exactly the listener modelled here. Exit 0 = valid, 1 = not.
Needs PyYAML (installed into .tools/venv by scripts/install-tools.sh).
"""

import argparse
import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:  # pragma: no cover - message for a bare python3
    sys.exit("validate-deploy: PyYAML missing; run with .tools/venv/bin/python (make tools)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
WASM_FILTER = "envoy.filters.http.wasm"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
WASM_MAGIC = b"\0asm"
DEFAULT_WASM = "target/wasm32-wasip1/release/dp_affinity.wasm"  # `make build`, relative to the root
# The one-engine configs and their engine's preset (README, "How the rank reaches the engine").
ENGINE_CONFIGS = {"envoy.sglang-dp.yaml": "sglang", "envoy.vllm-dp.yaml": "vllm"}
SET_NAMES = ("istio/ranks", "istio/engine", "envoy-gateway/ranks", "envoy-gateway/engine")

errors = []


def error(msg):
    errors.append(msg)
    print(f"  FAIL {msg}")


def ok(msg):
    print(f"  ok   {msg}")


class Invalid(Exception):
    """A manifest cannot be turned into Envoy config; reported as one error for its set."""


# --- files --------------------------------------------------------------------------------------


def load_docs(path):
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            return [json.load(f)]
        return [d for d in yaml.safe_load_all(f) if d is not None]


def parse_all(deploy):
    """Every YAML/JSON file under deploy/ -> {relative path: [documents]}; errors for the rest."""
    print("deploy/ files:")
    parsed = {}
    for dirpath, _, files in sorted(os.walk(deploy)):
        for name in sorted(files):
            if not name.endswith((".yaml", ".yml", ".json")):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, deploy)
            try:
                docs = load_docs(path)
            except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                error(f"{rel} does not parse: {exc}")
                continue
            bad = [i for i, d in enumerate(docs)
                   if not (isinstance(d, dict) and d.get("apiVersion") and d.get("kind")
                           and isinstance(d.get("metadata"), dict) and d["metadata"].get("name"))]
            if bad:
                error(f"{rel}: document(s) {bad} lack apiVersion, kind or metadata.name")
                continue
            parsed[rel] = docs
            ok(f"{rel}: {len(docs)} document(s): {', '.join(d['kind'] for d in docs)}")
    if not parsed:
        error(f"no manifests found under {deploy}")
    return parsed


# --- the OCI image ------------------------------------------------------------------------------


def dockerfile_instructions(path):
    """[(INSTRUCTION, [args])] with comments dropped and continuation lines joined."""
    out, pending = [], ""
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = pending + line, ""
            parts = line.split()
            out.append((parts[0].upper(), parts[1:]))
    if pending:
        raise ValueError("Dockerfile ends with a line continuation")
    return out


def ignore_pattern(pat):
    """A .dockerignore pattern as a regex (Go filepath.Match, plus Docker's `**`)."""
    out, i = "", 0
    while i < len(pat):
        if pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out)


def dockerignored(rel, patterns):
    """Docker's rule: the last pattern matching the path or one of its parent directories wins."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pat in patterns:
        negate = pat.startswith("!")
        rx = ignore_pattern(pat.lstrip("!").strip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def check_image(deploy, context, built_wasm):
    print("deploy/wasm-image:")
    path = os.path.join(deploy, "wasm-image", "Dockerfile")
    try:
        ins = dockerfile_instructions(path)
    except (OSError, ValueError) as exc:
        error(f"wasm-image/Dockerfile: {exc}")
        return
    froms = [a for i, a in ins if i == "FROM"]
    copies = [a for i, a in ins if i in ("COPY", "ADD")]
    others = sorted({i for i, _ in ins} - {"FROM", "COPY", "ADD", "LABEL", "ARG"})
    if froms != [["scratch"]]:
        error(f"wasm-image/Dockerfile: must be one `FROM scratch` (the module alone), got {froms}")
    if others:
        error(f"wasm-image/Dockerfile: {others} would add layers or metadata the fetchers do not use")
    if len(copies) != 1 or len([a for a in copies[0] if not a.startswith("--")]) != 2:
        error(f"wasm-image/Dockerfile: needs exactly one `COPY <built wasm> /plugin.wasm`, got {copies}")
        return
    src, dest = [a for a in copies[0] if not a.startswith("--")]
    if dest != "/plugin.wasm":
        error(f"wasm-image/Dockerfile: COPY destination {dest}: Istio and Envoy Gateway look for "
              "plugin.wasm (at the image root)")
    src_path = os.path.join(context, src)
    if not os.path.isfile(src_path):
        if src == DEFAULT_WASM and os.path.isfile(built_wasm):
            # Built elsewhere (CARGO_TARGET_DIR): `docker build` needs it at the COPY path.
            print(f"  note wasm-image/Dockerfile: {src} is not built here (the filter was built at "
                  f"{built_wasm}); `docker build` needs it there")
            return
        error(f"wasm-image/Dockerfile: COPY source {src} does not exist in the build context "
              f"{context} (run `make build`)")
        return
    with open(src_path, "rb") as f:
        if f.read(4) != WASM_MAGIC:
            error(f"wasm-image/Dockerfile: COPY source {src} is not a wasm module")
            return
    ignore = path + ".dockerignore"
    if os.path.isfile(ignore):
        with open(ignore, encoding="utf-8") as f:
            pats = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        if dockerignored(src, pats):
            error(f"wasm-image/Dockerfile: COPY source {src} is excluded by {os.path.basename(ignore)}")
            return
    ok(f"wasm-image/Dockerfile: FROM scratch, {src} (a wasm module, in the build context) -> /plugin.wasm")


# --- plugin configurations ----------------------------------------------------------------------


def hcm_of_listener(listener):
    chains = list(listener.get("filter_chains", []))
    if listener.get("default_filter_chain"):
        chains.append(listener["default_filter_chain"])
    for chain in chains:
        for flt in chain.get("filters", []):
            if flt.get("name") == HCM:
                return flt["typed_config"]
    raise Invalid(f"listener {listener.get('name')} has no {HCM}")


def wasm_filters(hcm):
    return [f for f in hcm.get("http_filters", [])
            if f.get("typed_config", {}).get("@type") == WASM_TYPE]


def plugin_of(wasm_typed_config):
    value = wasm_typed_config["config"]["configuration"]
    if value.get("@type") != STRING_VALUE:
        raise Invalid(f"plugin configuration must be a {STRING_VALUE}")
    try:
        return json.loads(value["value"])
    except json.JSONDecodeError as exc:
        raise Invalid(f"plugin configuration is not JSON: {exc}") from exc


def reference_plugin(envoy_dir):
    cfg = load_docs(os.path.join(envoy_dir, "envoy.yaml"))[0]
    hcm = hcm_of_listener(cfg["static_resources"]["listeners"][0])
    wasm = wasm_filters(hcm)[0]["typed_config"]
    return plugin_of(wasm), wasm


def expected_plugin(reference, engine, header_only, preset=None):
    """envoy/envoy.yaml's plugin configuration with a variant's deliberate differences."""
    p = copy.deepcopy(reference)
    p.setdefault("learn", {})["upstream_addresses"] = {}
    if engine and preset:
        p["target"] = {"mode": "engine", "engine": preset}
    elif engine:
        # Header-only: the preset that sets no body field (see the engine header-only files).
        p["target"] = {"mode": "engine", "engine": "vllm"}
    if header_only:
        p["explicit_rank"]["body_fields"] = []
        p["routing_key"]["body_fields"] = []
        p["prefix"]["enabled"] = False
    return p


def diff_paths(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff_paths(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}" if path else k)
        return out
    return [] if a == b and type(a) is type(b) else [path]


def reads_body(plugin):
    """Mirrors the filter's rule (decide.rs): it pauses on headers to read the body when prefix
    placement is on or any body field is wanted (missing lists mean the non-empty defaults)."""
    wants = (plugin.get("explicit_rank", {}).get("enabled", True)
             and plugin.get("explicit_rank", {}).get("body_fields", ["default"]))
    wants = wants or plugin.get("routing_key", {}).get("body_fields", ["default"])
    wants = wants or plugin.get("assign", {}).get("mode") == "bootstrap_room"
    # An engine target that writes or strips body fields (the sglang preset, paths with
    # body_fields) reads the body on those paths.
    target = plugin.get("target", {})
    wants = wants or (target.get("mode") == "engine"
                      and (target.get("engine") == "sglang"
                           or any(p.get("body_fields") for p in target.get("paths", []))))
    return bool(wants) or bool(plugin.get("prefix", {}).get("enabled", False))


# Plugin fields a deployment is told to set for itself: the secret seeds (the files say to set
# routing_key.hash_seed), and the engine preset (README: "vllm" for a vLLM engine).
OPERATOR_FIELDS = {"dp_size", "routing_key.hash_seed", "assign.seed"}


def check_plugin(where, plugin, reference, engine, header_only, preset=None):
    expected = expected_plugin(reference, engine, header_only, preset)
    if preset and plugin.get("target", {}).get("engine") in ("sglang", "vllm"):
        expected["target"]["engine"] = plugin["target"]["engine"]
    diffs = [d for d in diff_paths(plugin, expected) if d not in OPERATOR_FIELDS]
    variant = ("engine" if engine else "rank clusters") + (", headers only" if header_only else "")
    if diffs:
        error(f"{where}: plugin configuration differs from envoy/envoy.yaml's ({variant} variant) "
              f"at {', '.join(diffs)}")
    else:
        ok(f"{where}: plugin configuration = envoy/envoy.yaml's ({variant} variant)")
    if header_only and reads_body(plugin):
        error(f"{where}: this filter cannot set allow_on_headers_stop_iteration but its configuration "
              "reads the body (body_fields, prefix.enabled or bootstrap_room): requests would hang")


def check_body_filter(where, wasm_cfg, plugin, buffer_limit):
    if reads_body(plugin) and wasm_cfg.get("allow_on_headers_stop_iteration") is not True:
        error(f"{where}: allow_on_headers_stop_iteration is not true but the configuration reads "
              "the body: requests would hang")
    policy = wasm_cfg.get("failure_policy", "FAIL_CLOSED")
    if policy == "FAIL_OPEN" or wasm_cfg.get("fail_open") is True:
        error(f"{where}: fail open lets requests bypass the filter (and its header stripping)")
    body_max = int(plugin.get("body", {}).get("max_bytes", 8 * 1024 * 1024))
    if reads_body(plugin):
        if buffer_limit <= body_max:
            error(f"{where}: listener buffer limit {buffer_limit} <= body.max_bytes {body_max}: "
                  "Envoy answers 413 before the filter sees a long prompt")
        else:
            ok(f"{where}: buffer limit {buffer_limit} > body.max_bytes {body_max}")


# The label the StatefulSet controller puts on each pod (its name, ordinal last): the rank
# backends select their one pod by it.
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"


def pod_ordinal(selector):
    """The ordinal of the one StatefulSet pod `selector` names (engine-2 -> 2), None if it names
    no single pod (the fallback's backend: every rank)."""
    pod = (selector or {}).get(POD_NAME_LABEL)
    if pod is None:
        return None
    ordinal = pod.rsplit("-", 1)[-1]
    return int(ordinal) if ordinal.isdigit() else pod


def check_fallback_health(where, routes, clusters, header_of, header):
    """As envoy/envoy.yaml: the fallback (Envoy balancing over every rank) retries connection
    failures on another rank and ejects a rank that keeps failing them; a rank route does
    neither, so a pinned request's failure reaches the filter, which unpins its key."""
    by_name = {c["name"]: c for c in clusters}
    for route in routes:
        cluster = by_name.get(route["route"]["cluster"], {})
        od = cluster.get("outlier_detection")
        retry_on = (route["route"].get("retry_policy") or {}).get("retry_on", "")
        name = route.get("name") or route["route"]["cluster"]
        if header_of(route, header) is None:
            if "connect-failure" not in retry_on.split(","):
                error(f"{where}: the fallback route {name} does not retry connect failures on another "
                      f"rank (retry_on {retry_on!r}): one rank down fails balanced requests")
            elif not od or not od.get("split_external_local_origin_errors") \
                    or not od.get("consecutive_local_origin_failure"):
                error(f"{where}: the fallback's cluster {cluster.get('name')} has no outlier detection "
                      f"on local-origin failures: a rank that is down keeps its share of the retries")
            else:
                ok(f"{where}: the fallback retries connect failures elsewhere and ejects a failing rank")
        elif retry_on or od:
            error(f"{where}: the rank route {name} retries ({retry_on!r}) or has outlier detection: "
                  f"a pinned request's failure must reach the filter")


def check_rank_routes(where, routes, plugin, header_of, ordinal_of_cluster):
    """routes: Envoy routes. Rank variant: one route per rank matching cluster_header ==
    cluster_template(rank), to the backend selecting that rank's pod (ordinal_of_cluster: the
    pod ordinal each route cluster reaches, None for all), plus a fallback without it."""
    target = plugin.get("target", {})
    header = target.get("cluster_header", "x-dp-affinity-cluster")
    template = target.get("cluster_template", "dp-rank-{rank}")
    dp_size = plugin.get("dp_size", 0)
    want = {template.replace("{rank}", str(r)) for r in range(dp_size)}
    got, fallback = set(), False
    for route in routes:
        value = header_of(route, header)
        if value is None:
            fallback = True
        else:
            got.add(value)
            if header not in [h.lower() for h in route.get("request_headers_to_remove", [])]:
                error(f"{where}: the route for {value} does not remove {header} before the engine")
            reached = ordinal_of_cluster.get(route["route"]["cluster"])
            rank = next((r for r in range(dp_size) if template.replace("{rank}", str(r)) == value), None)
            if rank is not None and reached != rank:
                error(f"{where}: the route for {value} reaches pod ordinal {reached} "
                      f"({POD_NAME_LABEL}), not rank {rank}'s")
    if got != want:
        error(f"{where}: rank routes match {header} = {sorted(got)}, dp_size {dp_size} needs {sorted(want)}")
    elif not fallback:
        error(f"{where}: no fallback route without {header} (Envoy's balancer over all ranks)")
    else:
        ok(f"{where}: one route per rank ({dp_size}) on {header}, each to its rank's pod, and a fallback")


# --- Envoy --------------------------------------------------------------------------------------


DUMP_DIR = None  # --dump: keep every generated bootstrap there

# Retries go to another host than the one that failed (Istio and Envoy Gateway both add it).
PREVIOUS_HOSTS = {"name": "envoy.retry_host_predicates.previous_hosts",
                  "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host."
                                            "previous_hosts.v3.PreviousHostsPredicate"}}


def run_envoy(envoy, bootstrap, what, errors_before):
    """`envoy --mode validate` on a generated bootstrap, unless the checks of the same part already
    failed: the report then names the cause instead of Envoy's echo of it (and stays fast)."""
    if len(errors) > errors_before:
        print(f"  note {what}: `envoy --mode validate` not run: fix the problems above first")
        return
    with tempfile.TemporaryDirectory(prefix="dp-affinity-deploy-") as tmp:
        path = os.path.join(tmp, "bootstrap.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(bootstrap, f, sort_keys=False)
        if DUMP_DIR:
            kept = os.path.join(DUMP_DIR, re.sub(r"[^A-Za-z0-9.-]+", "_", what.split(":")[0]) + ".yaml")
            with open(kept, "w", encoding="utf-8") as f:
                yaml.safe_dump(bootstrap, f, sort_keys=False)
        proc = subprocess.run([envoy, "--mode", "validate", "-c", path, "--log-level", "error"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write("".join(f"       | {ln}\n" for ln in proc.stdout.splitlines()[-15:]))
        error(f"{what}: `envoy --mode validate` failed (exit {proc.returncode})")
    else:
        ok(f"{what}: `envoy --mode validate` OK")


def placeholder_cluster(name, port, lb_policy=None):
    c = {"name": name, "type": "STATIC", "connect_timeout": "1s",
         "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
             {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}
    if lb_policy:
        c["lb_policy"] = lb_policy
    return c


def listener(name, port, hcm, default_chain=False, buffer_limit=None):
    chain = {"filters": [{"name": HCM, "typed_config": hcm}]}
    out = {"name": name, "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}}}
    if buffer_limit is not None:
        out["per_connection_buffer_limit_bytes"] = buffer_limit
    if default_chain:
        out["default_filter_chain"] = chain
    else:
        out["filter_chains"] = [chain]
    return out


def hcm(stat_prefix, route_name, routes, http_filters):
    return {"@type": HCM_TYPE, "stat_prefix": stat_prefix,
            "route_config": {"name": route_name, "virtual_hosts": [
                {"name": "gateway", "domains": ["*"], "routes": routes}]},
            "http_filters": http_filters}


def local_code(wasm_typed_config, wasm_path):
    """The Wasm filter config with its code pointed at the local build (what the Istio agent or a
    mounted image volume gives Envoy)."""
    cfg = copy.deepcopy(wasm_typed_config)
    cfg["config"]["vm_config"]["code"] = {"local": {"filename": wasm_path}}
    return cfg


def insert_before_router(filters, new):
    names = [f.get("name") for f in filters]
    at = names.index(ROUTER["name"]) if ROUTER["name"] in names else len(filters)
    return filters[:at] + [new] + filters[at:]


# --- Istio --------------------------------------------------------------------------------------

ISTIO_FILTERS = [  # upstream filters Istio puts on a gateway (its own istio.* filters are not in
    # upstream Envoy and are left out)
    {"name": "envoy.filters.http.cors",
     "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
    {"name": "envoy.filters.http.fault",
     "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}},
    ROUTER,
]
ISTIO_FAIL = {"FAIL_CLOSE": "FAIL_CLOSED", None: "FAIL_CLOSED", "FAIL_OPEN": "FAIL_OPEN",
              "FAIL_RELOAD": "FAIL_RELOAD"}


def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def istio_cluster_name(dest):
    port = dest.get("port", {}).get("number", 80)
    return f"outbound|{port}|{dest.get('subset', '')}|{dest['host']}", port


def istio_clusters(destination_rules, refs):
    """Placeholder clusters for every referenced destination, with the subset's load balancer,
    outlier detection and retry budget as Istio translates them."""
    subsets = {}
    for dr in destination_rules:
        for s in dr["spec"].get("subsets", []):
            subsets[(dr["spec"]["host"], s["name"])] = s.get("trafficPolicy", {})
    out = []
    for (name, port, host, subset) in sorted(set(refs)):
        if subset and (host, subset) not in subsets:
            raise Invalid(f"VirtualService routes to subset {subset} of {host}, which no DestinationRule defines")
        tp = subsets.get((host, subset), {})
        lb = {"LEAST_REQUEST": "LEAST_REQUEST", "ROUND_ROBIN": "ROUND_ROBIN", "RANDOM": "RANDOM"}.get(
            tp.get("loadBalancer", {}).get("simple"))
        c = placeholder_cluster(name, port, lb)
        od = tp.get("outlierDetection")
        if od:
            c["outlier_detection"] = {
                "split_external_local_origin_errors": od.get("splitExternalLocalOriginErrors", False),
                "consecutive_local_origin_failure": od.get("consecutiveLocalOriginFailures", 5),
                "enforcing_consecutive_local_origin_failure": 100,
                "interval": od.get("interval", "10s"),
                "base_ejection_time": od.get("baseEjectionTime", "30s"),
                "max_ejection_percent": od.get("maxEjectionPercent", 10)}
        retries = tp.get("connectionPool", {}).get("http", {}).get("maxRetries")
        if retries:
            c["circuit_breakers"] = {"thresholds": [{"priority": "DEFAULT", "max_retries": retries}]}
        out.append(c)
    return out


def istio_routes(virtual_services):
    routes, refs = [], []
    for vs in virtual_services:
        for http in vs["spec"].get("http", []):
            dests = http.get("route", [])
            if len(dests) != 1:
                raise Invalid(f"VirtualService {vs['metadata']['name']}: route {http.get('name')} "
                              "needs exactly one destination here")
            dest = dests[0]["destination"]
            name, port = istio_cluster_name(dest)
            refs.append((name, port, dest["host"], dest.get("subset", "")))
            for m in http.get("match", [{}]):
                match = {"prefix": "/"}
                headers = [{"name": h, "string_match": {"exact": v["exact"]}}
                           for h, v in (m.get("headers") or {}).items()]
                if headers:
                    match["headers"] = headers
                route = {"name": http.get("name", ""), "match": match,
                         "route": {"cluster": name, "timeout": http.get("timeout", "0s")}}
                retries = http.get("retries", {})
                if retries.get("attempts", 2) > 0:
                    route["route"]["retry_policy"] = {
                        "retry_on": retries.get("retryOn", "connect-failure,refused-stream,unavailable"),
                        "num_retries": retries.get("attempts", 2),
                        "retry_host_predicate": [copy.deepcopy(PREVIOUS_HOSTS)],
                        "host_selection_retry_max_attempts": 5}
                remove = http.get("headers", {}).get("request", {}).get("remove", [])
                if remove:
                    route["request_headers_to_remove"] = list(remove)
                routes.append(route)
    return routes, refs


def proto_merge(base, patch):
    """Istio's MERGE: proto merge semantics (messages merged field by field, repeated fields
    appended, scalars replaced)."""
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            proto_merge(base[k], v)
        elif isinstance(v, list) and isinstance(base.get(k), list):
            base[k] = base[k] + copy.deepcopy(v)
        else:
            base[k] = copy.deepcopy(v)


def apply_istio_patch(where, patch, lst, extensions):
    apply_to = patch.get("applyTo")
    match = patch.get("match", {})
    op = patch.get("patch", {}).get("operation")
    value = patch.get("patch", {}).get("value")
    if match.get("context", "ANY") not in ("ANY", "GATEWAY"):
        raise Invalid(f"{where}: {apply_to} patch for context {match['context']}: these manifests patch a gateway")
    if apply_to == "EXTENSION_CONFIG":
        if op != "ADD":
            raise Invalid(f"{where}: EXTENSION_CONFIG supports ADD here, got {op}")
        extensions[value["name"]] = value["typed_config"]
    elif apply_to == "LISTENER":
        if op != "MERGE":
            raise Invalid(f"{where}: LISTENER patch {op} is not modelled here")
        proto_merge(lst, value)
    elif apply_to == "HTTP_FILTER":
        flt = match.get("listener", {}).get("filterChain", {}).get("filter", {})
        if flt.get("name") != HCM:
            raise Invalid(f"{where}: HTTP_FILTER patch must match filter {HCM}")
        h = hcm_of_listener(lst)
        names = [f["name"] for f in h["http_filters"]]
        sub = flt.get("subFilter", {}).get("name")
        if sub and sub not in names:
            raise Invalid(f"{where}: HTTP_FILTER subFilter {sub} is not in the gateway's chain {names}")
        at = names.index(sub) if sub else None
        if op == "INSERT_BEFORE":
            h["http_filters"].insert(at if at is not None else 0, value)
        elif op == "INSERT_AFTER":
            h["http_filters"].insert(at + 1 if at is not None else len(names), value)
        elif op == "INSERT_FIRST":
            h["http_filters"].insert(0, value)
        elif op == "ADD":
            h["http_filters"].insert(names.index(ROUTER["name"]), value)
        else:
            raise Invalid(f"{where}: HTTP_FILTER operation {op} is not modelled here")
    elif apply_to == "HTTP_ROUTE":
        if op != "MERGE":
            raise Invalid(f"{where}: HTTP_ROUTE supports MERGE only")
        want = match.get("routeConfiguration", {}).get("vhost", {}).get("route", {})
        hit = 0
        for vh in hcm_of_listener(lst)["route_config"]["virtual_hosts"]:
            for route in vh["routes"]:
                if want.get("name") and route.get("name") != want["name"]:
                    continue
                if want.get("action", "ANY") not in ("ANY", "ROUTE") or "route" not in route:
                    continue
                proto_merge(route, value)
                hit += 1
        if not hit:
            raise Invalid(f"{where}: HTTP_ROUTE patch matches no route")
    else:
        raise Invalid(f"{where}: applyTo {apply_to} is not modelled here")


def ads_bootstrap(listeners, clusters):
    """A bootstrap with ADS, as an Istio proxy has: config_discovery filters resolve through it."""
    xds = placeholder_cluster("xds-grpc", 15012)
    xds["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return {"node": {"id": "router~10.0.0.1~dp-gateway.llm~llm.svc.cluster.local", "cluster": "dp-gateway.llm"},
            "dynamic_resources": {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                                                 "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
            "static_resources": {"listeners": listeners, "clusters": clusters + [xds]}}


def resolve_ecds(where, lst, extensions, wasm_path):
    """The listener as Envoy runs it once ECDS delivered each extension config and the Istio
    agent replaced its oci:// code with a local file."""
    resolved = copy.deepcopy(lst)
    resolved["name"] += "-after-ecds"
    resolved["address"]["socket_address"]["port_value"] += 1
    h = hcm_of_listener(resolved)
    found = []
    for i, f in enumerate(h["http_filters"]):
        cd = f.get("config_discovery")
        if not cd:
            continue
        ext = extensions.get(f["name"])
        if ext is None:
            raise Invalid(f"{where}: HTTP filter {f['name']} is fetched by config_discovery but no "
                          "EXTENSION_CONFIG adds it")
        if ext.get("@type") not in cd.get("type_urls", []):
            raise Invalid(f"{where}: extension {f['name']} is a {ext.get('@type')}, not in the "
                          f"filter's type_urls {cd.get('type_urls')}")
        code = ext.get("config", {}).get("vm_config", {}).get("code", {})
        uri = code.get("remote", {}).get("http_uri", {}).get("uri", "")
        sha = code.get("remote", {}).get("sha256", "")
        if not uri.startswith("oci://"):
            raise Invalid(f"{where}: extension {f['name']} code must be remote with an oci:// URI "
                          f"(the Istio agent pulls it), got {code}")
        if sha != "nil" and not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise Invalid(f"{where}: remote sha256 {sha!r} must be \"nil\" or the module's sha256")
        h["http_filters"][i] = {"name": f["name"], "typed_config": local_code(ext, wasm_path)}
        found.append((f["name"], ext, uri))
    return resolved, found


def istio_wasmplugin_filter(wp, wasm_path):
    spec = wp["spec"]
    name = f"{wp['metadata'].get('namespace', 'default')}.{wp['metadata']['name']}"
    plugin = spec.get("pluginConfig", {})
    config = {"name": name, "root_id": spec.get("pluginName", ""),
              "failure_policy": ISTIO_FAIL.get(spec.get("failStrategy"), "FAIL_CLOSED"),
              "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": wasm_path}}},
              "configuration": {"@type": STRING_VALUE, "value": json.dumps(plugin)}}
    return {"name": name, "typed_config": {"@type": WASM_TYPE, "config": config}}, plugin


def istio_route_header(route, header):
    for h in route.get("match", {}).get("headers", []):
        if h["name"].lower() == header:
            return h["string_match"]["exact"]
    return None


def check_istio_set(name, docs, reference, engine, envoy, wasm_path, images):
    print(f"deploy/{name}:")
    errors_before = len(errors)
    gateways = by_kind(docs, "Gateway")
    selector = gateways[0]["spec"]["selector"] if gateways else {}
    for ef in by_kind(docs, "EnvoyFilter") + by_kind(docs, "WasmPlugin"):
        labels = (ef["spec"].get("workloadSelector", {}).get("labels")
                  or ef["spec"].get("selector", {}).get("matchLabels"))
        if labels != selector:
            error(f"{name}: {ef['kind']} {ef['metadata']['name']} selects {labels}, the Gateway runs on {selector}")
    routes, refs = istio_routes(by_kind(docs, "VirtualService"))
    clusters = istio_clusters(by_kind(docs, "DestinationRule"), [(n, p, h, s) for n, p, h, s in refs])
    subset_labels = {(dr["spec"]["host"], sub["name"]): sub.get("labels", {})
                     for dr in by_kind(docs, "DestinationRule") for sub in dr["spec"].get("subsets", [])}
    ordinal_of_cluster = {n: pod_ordinal(subset_labels.get((h, sub))) for n, _, h, sub in refs}
    base = listener("0.0.0.0_8080", 8080, hcm("outbound_0.0.0.0_8080", "http.8080", routes,
                                               copy.deepcopy(ISTIO_FILTERS)))
    # Patches every variant shares (routing.yaml): applied before the filter's own.
    body_filters = [ef for ef in by_kind(docs, "EnvoyFilter")
                    if any(p.get("applyTo") == "EXTENSION_CONFIG" for p in ef["spec"]["configPatches"])]
    for ef in by_kind(docs, "EnvoyFilter"):
        if ef not in body_filters:
            for p in ef["spec"]["configPatches"]:
                apply_istio_patch(f"EnvoyFilter {ef['metadata']['name']}", p, base, {})
    if not body_filters or not by_kind(docs, "WasmPlugin"):
        error(f"{name}: needs both setups: an EnvoyFilter with EXTENSION_CONFIG and a WasmPlugin")
    # A rank that stops answering is ended by the per-try idle timeout (a 504 naming the rank),
    # which no VirtualService field sets: routing.yaml's HTTP_ROUTE EnvoyFilter merges it in.
    for route in hcm_of_listener(base)["route_config"]["virtual_hosts"][0]["routes"]:
        if not (route["route"].get("retry_policy") or {}).get("per_try_idle_timeout"):
            error(f"{name}: route {route.get('name') or route['route']['cluster']} has no per_try_idle_timeout "
                  f"(an HTTP_ROUTE EnvoyFilter merges it in): a silent rank would hold its requests until "
                  f"the stream idle timeout, a 504 that names no rank")
    # Upstream connections must close idle before the engine's server does (uvicorn: 5 s). A
    # subset's connectionPool replaces the DestinationRule's.
    policies = {}
    for dr in by_kind(docs, "DestinationRule"):
        top = dr["spec"].get("trafficPolicy", {}).get("connectionPool")
        policies[(dr["spec"]["host"], "")] = top
        for sub in dr["spec"].get("subsets", []):
            policies[(dr["spec"]["host"], sub["name"])] = sub.get("trafficPolicy", {}).get("connectionPool", top)
    for cluster, _, host, sub in sorted(set(refs)):
        idle = ((policies.get((host, sub)) or {}).get("http") or {}).get("idleTimeout")
        if idle is None or seconds(idle) >= 5:
            error(f"{name}: {cluster}: connectionPool.http.idleTimeout is {idle}: upstream connections must "
                  f"close idle before the engine's 5 s keep-alive")
    plugins = []
    listeners = []
    for ef in body_filters:
        where = f"EnvoyFilter {ef['metadata']['name']}"
        lst, extensions = copy.deepcopy(base), {}
        for p in ef["spec"]["configPatches"]:
            apply_istio_patch(where, p, lst, extensions)
        resolved, found = resolve_ecds(where, lst, extensions, wasm_path)
        if not found:
            error(f"{where}: no HTTP filter uses its extension config")
        for fname, ext, uri in found:
            plugin = plugin_of(ext)
            plugins.append(plugin)
            images.append((where, uri.removeprefix("oci://")))
            check_plugin(where, plugin, reference, engine, header_only=False,
                         preset="sglang" if engine else None)
            check_body_filter(where, ext["config"], plugin,
                              int(lst.get("per_connection_buffer_limit_bytes", 1024 * 1024)))
        listeners += [lst, resolved]
    for i, wp in enumerate(by_kind(docs, "WasmPlugin")):
        where = f"WasmPlugin {wp['metadata']['name']}"
        flt, plugin = istio_wasmplugin_filter(wp, wasm_path)
        plugins.append(plugin)
        images.append((where, wp["spec"]["url"].removeprefix("oci://")))
        check_plugin(where, plugin, reference, engine, header_only=True)
        check_body_filter(where, flt["typed_config"]["config"], plugin, 1024 * 1024)
        lst = copy.deepcopy(base)
        lst["name"] += f"-wasmplugin-{i}"
        lst["address"]["socket_address"]["port_value"] += 10 + i
        h = hcm_of_listener(lst)
        h["http_filters"] = insert_before_router(h["http_filters"], flt)
        listeners.append(lst)
    check_routes(name, routes, clusters, plugins, engine, istio_route_header, ordinal_of_cluster)
    run_envoy(envoy, ads_bootstrap(listeners, clusters), f"{name}: generated gateway with every patch and filter",
              errors_before)


def check_routes(name, routes, clusters, plugins, engine, header_of, ordinal_of_cluster):
    if not plugins:
        return
    if engine:
        if any(header_of(r, plugins[0].get("target", {}).get("cluster_header", "x-dp-affinity-cluster"))
               for r in routes) or len({r["route"]["cluster"] for r in routes}) != 1:
            error(f"{name}: the engine variant routes every request to the one engine")
        else:
            ok(f"{name}: every route goes to the one engine")
        return
    for plugin in plugins[1:]:
        if plugin.get("dp_size") != plugins[0].get("dp_size"):
            error(f"{name}: the plugin configurations disagree on dp_size")
    check_rank_routes(name, routes, plugins[0], header_of, ordinal_of_cluster)
    header = plugins[0].get("target", {}).get("cluster_header", "x-dp-affinity-cluster")
    check_fallback_health(name, routes, clusters, header_of, header)


# --- Envoy Gateway ------------------------------------------------------------------------------

QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|k|M|G)?$")
UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
EG_DEFAULT_BUFFER = 32768


def quantity(value):
    m = QUANTITY.match(str(value))
    if not m:
        raise Invalid(f"bufferLimit {value!r} is not a quantity")
    return int(m.group(1)) * UNITS[m.group(2)]


def seconds(duration):
    """Seconds of a Gateway API / protobuf duration string ("300s", "5m", "1h", "0s")."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if duration.endswith(unit) and duration[: -len(unit)].replace(".", "", 1).isdigit():
            return float(duration[: -len(unit)]) * units[unit]
    raise Invalid(f"unreadable duration {duration!r}")


def eg_policies(hr, traffic_policies):
    """The BackendTrafficPolicies that target HTTPRoute `hr`."""
    return [btp for btp in traffic_policies
            if any(t.get("kind") == "HTTPRoute" and t.get("name") == hr["metadata"]["name"]
                   for t in btp["spec"].get("targetRefs", []))]


def eg_policy(hr, traffic_policies):
    """The BackendTrafficPolicy on HTTPRoute `hr` (None if none): the first, as Envoy Gateway
    applies one policy per target and refuses the others (check_eg_set fails a second one)."""
    found = eg_policies(hr, traffic_policies)
    return found[0] if found else None


def eg_http_timeout(hr, traffic_policies, field):
    """timeout.http.<field> of the BackendTrafficPolicy on HTTPRoute `hr`, None if unset."""
    btp = eg_policy(hr, traffic_policies)
    return (btp or {}).get("spec", {}).get("timeout", {}).get("http", {}).get(field)


def eg_retry_policy(retry):
    """A BackendTrafficPolicy's `retry` as Envoy Gateway's translator writes it
    (internal/xds/translator/route.go, buildRetryPolicy): its defaults, then the fields given."""
    policy = {"retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
              "retriable_status_codes": [503], "num_retries": retry.get("numRetries", 2),
              "retry_host_predicate": [copy.deepcopy(PREVIOUS_HOSTS)],
              "host_selection_retry_max_attempts": 5}
    retry_on = retry.get("retryOn")
    if retry_on is not None:
        if retry_on.get("triggers"):
            policy["retry_on"] = ",".join(retry_on["triggers"])
        policy.pop("retriable_status_codes")
        if retry_on.get("httpStatusCodes"):
            policy["retriable_status_codes"] = list(retry_on["httpStatusCodes"])
    return policy


def eg_outlier_detection(passive):
    """healthCheck.passive as Envoy Gateway's translator writes it (internal/xds/translator/
    cluster.go, buildXdsOutlierDetection), with the CRD's defaults."""
    od = {"interval": passive.get("interval", "3s"),
          "base_ejection_time": passive.get("baseEjectionTime", "30s"),
          "split_external_local_origin_errors": passive.get("splitExternalLocalOriginErrors", False),
          "consecutive_local_origin_failure": passive.get("consecutiveLocalOriginFailures", 5),
          "consecutive_5xx": passive.get("consecutive5XxErrors", 5)}
    if passive.get("maxEjectionPercent", 10) > 0:
        od["max_ejection_percent"] = passive.get("maxEjectionPercent", 10)
    if passive.get("consecutiveGatewayErrors") is not None:
        od["consecutive_gateway_failure"] = passive["consecutiveGatewayErrors"]
        od["enforcing_consecutive_gateway_failure"] = 100
    return od


def eg_stream_idle(hr, rule, traffic_policies):
    """The route's idle_timeout as Envoy Gateway's translator sets it (internal/xds/translator/
    route.go, idleTimeout): a BackendTrafficPolicy's timeout.http.streamIdleTimeout on the route;
    else, with a request timeout, at least an hour, and 0 (no stream idle timeout at all) when
    the request timeout is 0s; else the listener's (None)."""
    stream_idle = eg_http_timeout(hr, traffic_policies, "streamIdleTimeout")
    if stream_idle is not None:
        return stream_idle
    request = rule.get("timeouts", {}).get("request")
    if request is None:
        return None
    return "0s" if seconds(request) == 0 else f"{max(3600, seconds(request)):g}s"


def eg_routes(http_routes, traffic_policies, selectors):
    """Envoy routes and placeholder clusters as Envoy Gateway generates them from the HTTPRoutes,
    and the pod ordinal each cluster reaches (see pod_ordinal; selectors: Service -> selector)."""
    routes, clusters, ordinal_of_cluster = [], [], {}
    for hr in http_routes:
        ns, hname = hr["metadata"].get("namespace", "default"), hr["metadata"]["name"]
        policy = (eg_policy(hr, traffic_policies) or {}).get("spec", {})
        for i, rule in enumerate(hr["spec"].get("rules", [])):
            cname = f"httproute/{ns}/{hname}/rule/{i}"
            backend = rule["backendRefs"][0]
            cluster = placeholder_cluster(cname, backend.get("port", 80), "LEAST_REQUEST")
            passive = (policy.get("healthCheck") or {}).get("passive")
            if passive is not None:
                cluster["outlier_detection"] = eg_outlier_detection(passive)
            clusters.append(cluster)
            ordinal_of_cluster[cname] = pod_ordinal(selectors.get(backend["name"]))
            remove = []
            for f in rule.get("filters", []):
                if f.get("type") == "RequestHeaderModifier":
                    remove += f["requestHeaderModifier"].get("remove", [])
            for j, m in enumerate(rule.get("matches", [{}])):
                match = {"prefix": "/"}
                headers = [{"name": h["name"].lower(), "string_match": {"exact": h["value"]}}
                           for h in m.get("headers", [])]
                if headers:
                    match["headers"] = headers
                route = {"name": f"{cname}/match/{j}", "match": match,
                         "route": {"cluster": cname, "timeout": rule.get("timeouts", {}).get("request", "15s")}}
                stream_idle = eg_stream_idle(hr, rule, traffic_policies)
                if stream_idle is not None:
                    route["route"]["idle_timeout"] = stream_idle
                if policy.get("retry") is not None:
                    route["route"]["retry_policy"] = eg_retry_policy(policy["retry"])
                if remove:
                    route["request_headers_to_remove"] = remove
                routes.append(route)
    # Gateway API precedence: more header matches first.
    routes.sort(key=lambda r: -len(r["match"].get("headers", [])))
    return routes, clusters, ordinal_of_cluster


def json_pointer(doc, pointer):
    """(parent, key) for an RFC 6901 pointer; the parent must exist."""
    if not pointer.startswith("/"):
        raise Invalid(f"JSON patch path {pointer!r} must start with /")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer[1:].split("/")]
    node = doc
    for p in parts[:-1]:
        try:
            node = node[int(p)] if isinstance(node, list) else node[p]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise Invalid(f"JSON patch path {pointer} does not exist in the generated listener "
                          f"(at {p!r})") from exc
    return node, parts[-1]


def apply_json_patch(doc, op):
    kind, path = op.get("op"), op.get("path")
    if op.get("jsonPath"):
        raise Invalid("jsonPath patches are not modelled here: use a plain path")
    parent, key = json_pointer(doc, path)
    if kind in ("add", "replace"):
        if isinstance(parent, list):
            idx = len(parent) if key == "-" else int(key)
            if kind == "add":
                if idx > len(parent):
                    raise Invalid(f"JSON patch add {path}: index beyond the list")
                parent.insert(idx, copy.deepcopy(op["value"]))
            else:
                parent[idx] = copy.deepcopy(op["value"])
        else:
            if kind == "replace" and key not in parent:
                raise Invalid(f"JSON patch replace {path}: nothing there")
            parent[key] = copy.deepcopy(op["value"])
    elif kind == "remove":
        try:
            del parent[int(key) if isinstance(parent, list) else key]
        except (KeyError, IndexError, ValueError) as exc:
            raise Invalid(f"JSON patch remove {path}: nothing there") from exc
    else:
        raise Invalid(f"JSON patch op {kind} is not modelled here")


def eg_extension_filter(eep, index, wasm_path):
    w = eep["spec"]["wasm"][index]
    ns, name = eep["metadata"].get("namespace", "default"), eep["metadata"]["name"]
    config = w.get("config", {})
    wasm_cfg = {"name": w["name"], "root_id": w.get("rootID", ""),
                "vm_config": {"vm_id": f"envoyextensionpolicy/{ns}/{name}/wasm/{index}",
                              "runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": wasm_path}}},
                "configuration": {"@type": STRING_VALUE, "value": json.dumps(config)}}
    if w.get("failOpen"):
        wasm_cfg["failure_policy"] = "FAIL_OPEN"
    flt = {"name": f"envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{name}/wasm/{index}",
           "typed_config": {"@type": WASM_TYPE, "config": wasm_cfg}}
    return flt, config, w


def check_eg_set(name, docs, reference, engine, envoy, wasm_path, images):
    print(f"deploy/{name}:")
    errors_before = len(errors)
    gw = by_kind(docs, "Gateway")[0]
    ns, gname = gw["metadata"].get("namespace", "default"), gw["metadata"]["name"]
    buffer = EG_DEFAULT_BUFFER
    for ctp in by_kind(docs, "ClientTrafficPolicy"):
        if any(t.get("name") == gname for t in ctp["spec"].get("targetRefs", [])):
            buffer = quantity(ctp["spec"].get("connection", {}).get("bufferLimit", EG_DEFAULT_BUFFER))
    proxy = by_kind(docs, "EnvoyProxy")
    mounts = {}
    if proxy:
        dep = proxy[0]["spec"]["provider"]["kubernetes"]["envoyDeployment"]
        vols = {v["name"]: v for v in dep.get("pod", {}).get("volumes", [])}
        for m in dep.get("container", {}).get("volumeMounts", []):
            img = vols.get(m["name"], {}).get("image", {}).get("reference")
            if img:
                mounts[m["mountPath"].rstrip("/") + "/plugin.wasm"] = img
                images.append((f"EnvoyProxy {proxy[0]['metadata']['name']}", img))
    traffic_policies = by_kind(docs, "BackendTrafficPolicy")
    selectors = {svc["metadata"]["name"]: svc["spec"].get("selector") for svc in by_kind(docs, "Service")}
    routes, clusters, ordinal_of_cluster = eg_routes(by_kind(docs, "HTTPRoute"), traffic_policies, selectors)
    # A rank that stops answering must be ended by something: with `timeouts.request: 0s` (LLM
    # answers stream for as long as generation runs) Envoy Gateway turns the stream idle
    # timeout off for the route unless a BackendTrafficPolicy sets it.
    for route in routes:
        if seconds(route["route"].get("idle_timeout", "300s")) == 0:
            error(f"{name}: route {route['name']} has no stream idle timeout (request timeout 0s and "
                  f"no BackendTrafficPolicy timeout.http.streamIdleTimeout): a silent rank hangs "
                  f"its requests for ever")
    for hr in by_kind(docs, "HTTPRoute"):
        found = eg_policies(hr, traffic_policies)
        if len(found) > 1:
            error(f"{name}: HTTPRoute {hr['metadata']['name']}: BackendTrafficPolicies "
                  f"{[b['metadata']['name'] for b in found]} all target it; Envoy Gateway applies one "
                  f"and refuses the others as conflicting")
        idle = eg_http_timeout(hr, traffic_policies, "connectionIdleTimeout")
        if idle is None or seconds(idle) >= 5:
            error(f"{name}: HTTPRoute {hr['metadata']['name']}: no BackendTrafficPolicy closes idle upstream "
                  f"connections before the engine's 5 s keep-alive (timeout.http.connectionIdleTimeout)")
    listeners_by_name = {}
    for lis in gw["spec"]["listeners"]:
        lname = f"{ns}/{gname}/{lis['name']}"
        port = 10000 + lis["port"] if lis["port"] < 1024 else lis["port"]
        listeners_by_name[lname] = listener(lname, port, hcm(f"http-{port}", lname, routes, [ROUTER]),
                                            default_chain=True, buffer_limit=buffer)
    patches = by_kind(docs, "EnvoyPatchPolicy")
    if not patches or not by_kind(docs, "EnvoyExtensionPolicy"):
        error(f"{name}: needs both setups: an EnvoyPatchPolicy and an EnvoyExtensionPolicy")
    out, plugins = [], []
    for epp in patches:
        where = f"EnvoyPatchPolicy {epp['metadata']['name']}"
        if epp["spec"].get("targetRef", {}).get("name") != gname:
            error(f"{where}: targets {epp['spec'].get('targetRef')}, not Gateway {gname}")
        if epp["spec"].get("type") != "JSONPatch":
            raise Invalid(f"{where}: type must be JSONPatch")
        patched = copy.deepcopy(listeners_by_name)
        for jp in epp["spec"]["jsonPatches"]:
            if jp.get("type") != "type.googleapis.com/envoy.config.listener.v3.Listener":
                raise Invalid(f"{where}: only Listener patches are modelled here, got {jp.get('type')}")
            if jp.get("name") not in patched:
                raise Invalid(f"{where}: patches listener {jp.get('name')}, but Envoy Gateway names the "
                              f"gateway's listeners {sorted(patched)}")
            apply_json_patch(patched[jp["name"]], jp["operation"])
        for lname, lst in patched.items():
            for flt in wasm_filters(hcm_of_listener(lst)):
                code = flt["typed_config"]["config"]["vm_config"]["code"]
                path = code.get("local", {}).get("filename")
                if path not in mounts:
                    error(f"{where}: wasm code {code} is not plugin.wasm in an image volume of the "
                          f"EnvoyProxy (mounted: {sorted(mounts)})")
                plugin = plugin_of(flt["typed_config"])
                plugins.append(plugin)
                check_plugin(where, plugin, reference, engine, header_only=False,
                             preset="sglang" if engine else None)
                check_body_filter(where, flt["typed_config"]["config"], plugin,
                                  int(lst.get("per_connection_buffer_limit_bytes", 1024 * 1024)))
                flt["typed_config"] = local_code(flt["typed_config"], wasm_path)
            out.append(lst)
        if not any(wasm_filters(hcm_of_listener(lst)) for lst in patched.values()):
            error(f"{where}: adds no Wasm filter to the gateway's listeners")
    route_names = {hr["metadata"]["name"] for hr in by_kind(docs, "HTTPRoute")}
    for eep in by_kind(docs, "EnvoyExtensionPolicy"):
        where = f"EnvoyExtensionPolicy {eep['metadata']['name']}"
        targets = eep["spec"].get("targetRefs", [])
        for t in targets:
            if t.get("kind") == "HTTPRoute" and t.get("name") not in route_names:
                error(f"{where}: targets HTTPRoute {t.get('name')}, which this set does not define")
        # The filter runs only on the routes of the HTTPRoutes it targets, and must run on the
        # one a request without its header matches first (the fallback), or nothing is chosen.
        targeted = {t.get("name") for t in targets if t.get("kind") == "HTTPRoute"}
        if not any(t.get("kind") == "Gateway" and t.get("name") == gname for t in targets) \
                and targeted != route_names:
            error(f"{where}: targets HTTPRoutes {sorted(targeted)}, not all of {sorted(route_names)}: "
                  f"a request matching another one is never placed")
        for i, w in enumerate(eep["spec"].get("wasm", [])):
            flt, plugin, spec = eg_extension_filter(eep, i, wasm_path)
            if spec.get("code", {}).get("type") != "Image":
                error(f"{where}: code.type must be Image (the OCI image)")
            images.append((where, spec.get("code", {}).get("image", {}).get("url", "").removeprefix("oci://")))
            plugins.append(plugin)
            check_plugin(where, plugin, reference, engine, header_only=True)
            check_body_filter(where, flt["typed_config"]["config"], plugin, buffer)
            for lname, lst in listeners_by_name.items():
                lst = copy.deepcopy(lst)
                lst["name"] += f"-extensionpolicy-{i}"
                lst["default_filter_chain"]["filters"][0]["typed_config"]["http_filters"] = \
                    insert_before_router([ROUTER], flt)
                lst["address"]["socket_address"]["port_value"] += 1 + i
                out.append(lst)
    check_routes(name, routes, clusters, plugins, engine, istio_route_header, ordinal_of_cluster)
    run_envoy(envoy, {"static_resources": {"listeners": out, "clusters": clusters}},
              f"{name}: generated gateway with every patch and filter", errors_before)


# --- the one-engine Envoy configs ---------------------------------------------------------------


def check_engine_configs(envoy_dir, reference, reference_wasm, envoy, wasm_path):
    for name, preset in ENGINE_CONFIGS.items():
        print(f"envoy/{name}:")
        errors_before = len(errors)
        path = os.path.join(envoy_dir, name)
        cfg = load_docs(path)[0]
        lst = cfg["static_resources"]["listeners"][0]
        h = hcm_of_listener(lst)
        flts = wasm_filters(h)
        if len(flts) != 1:
            raise Invalid(f"envoy/{name}: expected one Wasm filter, found {len(flts)}")
        wasm = flts[0]["typed_config"]
        plugin = plugin_of(wasm)
        check_plugin(f"envoy/{name}", plugin, reference, engine=True, header_only=False,
                     preset=preset)
        check_body_filter(f"envoy/{name}", wasm["config"], plugin,
                          int(lst.get("per_connection_buffer_limit_bytes", 1024 * 1024)))
        a, b = copy.deepcopy(wasm), copy.deepcopy(reference_wasm)
        for w in (a, b):
            w["config"].pop("configuration")
        if a != b:
            error(f"envoy/{name}: the Wasm filter settings differ from envoy/envoy.yaml's")
        clusters = cfg["static_resources"]["clusters"]
        routes = h["route_config"]["virtual_hosts"][0]["routes"]
        if len(clusters) != 1 or {r["route"]["cluster"] for r in routes} != {clusters[0]["name"]}:
            error(f"envoy/{name}: expected every route to go to the one engine cluster")
        if any(not r["route"].get("retry_policy", {}).get("per_try_idle_timeout") for r in routes):
            error(f"envoy/{name}: every route needs retry_policy.per_try_idle_timeout (a silent rank)")
        flts[0]["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = wasm_path
        run_envoy(envoy, cfg, f"envoy/{name} (wasm {os.path.relpath(wasm_path, ROOT)})", errors_before)


def check_ranks_config(envoy_dir, reference, envoy, wasm_path, ranks=8):
    """envoy/envoy.yaml for another rank count as scripts/envoy-for-ranks.py writes it: the four
    settings that name the ranks agree, nothing else changed, and Envoy validates it."""
    what = f"envoy/envoy.yaml for {ranks} ranks (scripts/envoy-for-ranks.py)"
    print(f"{what}:")
    errors_before = len(errors)
    spec = importlib.util.spec_from_file_location("envoy_for_ranks", os.path.join(ROOT, "scripts", "envoy-for-ranks.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    shipped = load_docs(os.path.join(envoy_dir, "envoy.yaml"))[0]
    endpoints = [("127.0.0.1", 18000 + r) for r in range(ranks)]
    cfg = gen.for_ranks(shipped, endpoints)
    _, plugin = gen.plugin_config(cfg)
    if plugin["dp_size"] != ranks:
        error(f"{what}: dp_size {plugin['dp_size']}")
    want_addresses = {f"{h}:{p}": r for r, (h, p) in enumerate(endpoints)}
    if plugin.get("learn", {}).get("upstream_addresses") != want_addresses:
        error(f"{what}: learn.upstream_addresses do not name each rank's address")
    diffs = [d for d in diff_paths(plugin, reference)
             if d != "dp_size" and not d.startswith("learn.upstream_addresses")]
    if diffs:
        error(f"{what}: plugin configuration differs from envoy/envoy.yaml's at {', '.join(diffs)}")
    template = plugin["target"]["cluster_template"]
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    for r, (host, port) in enumerate(endpoints):
        c = clusters.get(template.replace("{rank}", str(r)))
        got = c and [e["endpoint"]["address"]["socket_address"] for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]
        if got != [{"address": host, "port_value": port}]:
            error(f"{what}: rank {r}'s cluster is missing or not at {host}:{port}")
    fallback = clusters.get("dp-all")
    got = fallback and [e["endpoint"]["address"]["socket_address"]["port_value"]
                        for e in fallback["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    if got != [p for _, p in endpoints]:
        error(f"{what}: dp-all does not hold every rank")
    if len(clusters) != ranks + 1:
        error(f"{what}: {len(clusters)} clusters, expected {ranks} ranks and dp-all")
    a, b = copy.deepcopy(cfg), copy.deepcopy(shipped)
    for d in (a, b):
        d["static_resources"].pop("clusters")
        gen.plugin_config(d)[0].pop("value")
    if a != b:
        error(f"{what}: the listener, routes or filter settings differ from envoy/envoy.yaml's")
    # The wasm this run built, wherever the shipped path points.
    for lst in cfg["static_resources"]["listeners"]:
        for flt in wasm_filters(hcm_of_listener(lst)):
            flt["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = wasm_path
    run_envoy(envoy, cfg, f"{what} (wasm {os.path.relpath(wasm_path, ROOT)})", errors_before)


# --- main ---------------------------------------------------------------------------------------


def set_docs(parsed, name):
    """A deployable set: the shared gateway.yaml of its control plane plus its own directory."""
    plane = name.split("/")[0]
    docs = []
    for rel, d in sorted(parsed.items()):
        if rel == f"{plane}/gateway.yaml" or rel.startswith(name + "/"):
            docs += d
    return docs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deploy", default=os.path.join(ROOT, "deploy"))
    ap.add_argument("--envoy-dir", default=os.path.join(ROOT, "envoy"),
                    help="holds envoy.yaml (the reference) and the one-engine configs")
    ap.add_argument("--context", default=ROOT, help="the wasm image's build context")
    ap.add_argument("--envoy", default=os.environ.get("DP_AFFINITY_ENVOY")
                    or os.path.join(ROOT, ".tools/venv/bin/envoy"))
    ap.add_argument("--wasm", default=os.environ.get("DP_AFFINITY_WASM")
                    or os.path.join(ROOT, "target/wasm32-wasip1/release/dp_affinity.wasm"))
    ap.add_argument("--only", action="append", choices=("files", "image", "engine-configs") + SET_NAMES,
                    help="check only these parts (repeatable); default: everything")
    ap.add_argument("--dump", metavar="DIR", help="write every generated Envoy bootstrap to DIR")
    args = ap.parse_args()
    global DUMP_DIR
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        DUMP_DIR = args.dump
    wanted = set(args.only or ("files", "image", "engine-configs") + SET_NAMES)
    wasm = os.path.abspath(args.wasm)
    if not os.path.isfile(wasm):
        error(f"wasm {wasm} not built: run `make build`")
    if not os.access(args.envoy, os.X_OK):
        error(f"envoy {args.envoy} not installed: run `make tools`")
    if errors:
        return 1

    parsed = parse_all(args.deploy)  # always: the sets are built from it
    if "image" in wanted:
        check_image(args.deploy, args.context, wasm)
    reference, reference_wasm = reference_plugin(args.envoy_dir)
    if "engine-configs" in wanted:
        try:
            check_engine_configs(args.envoy_dir, reference, reference_wasm, args.envoy, wasm)
        except (Invalid, OSError, KeyError, IndexError, TypeError, yaml.YAMLError) as exc:
            error(f"engine configs: {type(exc).__name__}: {exc}")
        try:
            check_ranks_config(args.envoy_dir, reference, args.envoy, wasm)
        except (Invalid, OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            error(f"envoy.yaml for 8 ranks: {type(exc).__name__}: {exc}")
    images = []
    for name in SET_NAMES:
        if name not in wanted:
            continue
        docs = set_docs(parsed, name)
        if not docs:
            error(f"deploy/{name}: no manifests")
            continue
        check = check_istio_set if name.startswith("istio/") else check_eg_set
        try:
            check(name, docs, reference, name.endswith("/engine"), args.envoy, wasm, images)
        except (Invalid, KeyError, IndexError, TypeError, ValueError) as exc:
            error(f"deploy/{name}: cannot build its Envoy config: {type(exc).__name__}: {exc}")
    refs = sorted({ref for _, ref in images})
    if len(refs) > 1:
        error("the manifests name different wasm images: "
              + "; ".join(f"{w}: {ref}" for w, ref in images))
    elif refs:
        ok(f"every manifest loads the same wasm image {refs[0]}")

    if errors:
        print(f"validate-deploy: {len(errors)} problem(s)")
        return 1
    print("validate-deploy: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
