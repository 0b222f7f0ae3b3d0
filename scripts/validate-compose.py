#!/usr/bin/env python3
"""Validate the Docker harness (envoy/docker-compose.yaml + envoy/envoy.docker.yaml) without Docker.

Docker does not run on the build machines, so this checks what `docker compose up` would trip on:
  * the compose file parses and every service is well formed (build context and Dockerfile exist,
    bind-mount sources exist, ports are published on 127.0.0.1, the Envoy image matches the Envoy
    version the tests run);
  * Envoy's -c file is the mounted envoy.docker.yaml, and the wasm path in that config is where the
    compose file mounts the filter;
  * every DNS cluster endpoint is a compose service listening on that port, and cluster dp-rank-r
    points at the service started with --rank r;
  * the plugin configuration is sane (dp_size = number of rank clusters, body limit below Envoy's
    buffer limit, upstream_addresses empty since upstreams are DNS names) and the routes and filter
    match envoy/envoy.yaml (the two are kept in sync by hand);
  * `envoy --mode validate` accepts envoy.docker.yaml with the container wasm path rewritten to the
    local build (validate mode loads the wasm and runs the filter's on_configure; it does not
    resolve the DNS names of STRICT_DNS clusters, so compose hostnames are fine).
It also checks envoy/envoy.yaml's rank clusters against its learn.upstream_addresses.

Needs PyYAML (installed into .tools/venv by scripts/install-tools.sh). Exit 0 = valid, 1 = not.
"""

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:  # pragma: no cover - message for a bare python3
    sys.exit("validate-compose: PyYAML missing; run with .tools/venv/bin/python (make tools)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVOY_DIR = os.path.join(ROOT, "envoy")
WASM_FILTER = "envoy.filters.http.wasm"
HCM = "envoy.filters.network.http_connection_manager"
RANK_CLUSTER = re.compile(r"^dp-rank-(\d+)$")

errors = []


def error(msg):
    errors.append(msg)
    print(f"  FAIL {msg}")


def ok(msg):
    print(f"  ok   {msg}")


def load_yaml(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


# --- Envoy config helpers ------------------------------------------------------------------------


def hcm_of(cfg):
    """The single http_connection_manager typed_config of the single listener."""
    listeners = cfg["static_resources"]["listeners"]
    if len(listeners) != 1:
        raise ValueError(f"expected 1 listener, found {len(listeners)}")
    listener = listeners[0]
    for chain in listener["filter_chains"]:
        for flt in chain["filters"]:
            if flt["name"] == HCM:
                return listener, flt["typed_config"]
    raise ValueError("no http_connection_manager in the listener")


def wasm_of(hcm):
    for flt in hcm["http_filters"]:
        if flt["name"] == WASM_FILTER:
            return flt["typed_config"]["config"]
    raise ValueError("no envoy.filters.http.wasm filter")


def plugin_json(wasm_cfg):
    return json.loads(wasm_cfg["configuration"]["value"])


def cluster_endpoints(cluster):
    out = []
    for locality in cluster.get("load_assignment", {}).get("endpoints", []):
        for ep in locality.get("lb_endpoints", []):
            sa = ep["endpoint"]["address"]["socket_address"]
            out.append((str(sa["address"]), int(sa["port_value"])))
    return out


def check_envoy_common(name, cfg):
    """Checks that hold for every shipped Envoy config. Returns (hcm, wasm config, plugin config)."""
    listener, hcm = hcm_of(cfg)
    wasm = wasm_of(hcm)
    plugin = plugin_json(wasm)
    ok(f"{name}: plugin configuration is JSON")

    names = [f["name"] for f in hcm["http_filters"]]
    if names[-1:] != ["envoy.filters.http.router"] or WASM_FILTER not in names:
        error(f"{name}: http_filters must be [..., {WASM_FILTER}, ..., envoy.filters.http.router], got {names}")
    if wasm.get("vm_config", {}).get("runtime") != "envoy.wasm.runtime.v8":
        error(f"{name}: wasm runtime must be envoy.wasm.runtime.v8 (the only one in the official build)")
    if wasm.get("allow_on_headers_stop_iteration") is not True:
        # Missing body_fields means the defaults, which are non-empty.
        reads_body = any(plugin.get(sect, {}).get("body_fields", ["default"])
                         for sect in ("explicit_rank", "routing_key"))
        if reads_body:
            error(f"{name}: allow_on_headers_stop_iteration is off but body fields are read: requests would hang")

    buf = int(listener.get("per_connection_buffer_limit_bytes", 1024 * 1024))
    body_max = int(plugin.get("body", {}).get("max_bytes", 8 * 1024 * 1024))
    if buf <= body_max:
        error(f"{name}: listener per_connection_buffer_limit_bytes {buf} <= body.max_bytes {body_max}: "
              "Envoy would answer 413 before the filter sees the body")
    else:
        ok(f"{name}: per_connection_buffer_limit_bytes {buf} > body.max_bytes {body_max}")

    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    ranks = {}
    for cname, c in clusters.items():
        m = RANK_CLUSTER.match(cname)
        if m:
            ranks[int(m.group(1))] = c
    dp_size = plugin.get("dp_size")
    if sorted(ranks) != list(range(dp_size or 0)):
        error(f"{name}: dp_size {dp_size} but rank clusters are {sorted(ranks)}")
    else:
        ok(f"{name}: dp_size {dp_size} = clusters dp-rank-0..{dp_size - 1}")
    template = plugin.get("target", {}).get("cluster_template", "dp-rank-{rank}")
    if template != "dp-rank-{rank}":
        error(f"{name}: target.cluster_template {template!r} does not name the dp-rank-N clusters")
    for r, c in ranks.items():
        if len(cluster_endpoints(c)) != 1:
            error(f"{name}: cluster dp-rank-{r} must have exactly one endpoint")
    if "dp-all" not in clusters:
        error(f"{name}: no dp-all cluster (the fallback route's target)")
    else:
        all_eps = sorted(cluster_endpoints(clusters["dp-all"]))
        rank_eps = sorted(ep for c in ranks.values() for ep in cluster_endpoints(c))
        if all_eps != rank_eps:
            error(f"{name}: dp-all endpoints {all_eps} differ from the rank endpoints {rank_eps}")
        else:
            ok(f"{name}: dp-all holds exactly the {len(all_eps)} rank endpoints")
        if clusters["dp-all"].get("lb_policy") != "LEAST_REQUEST":
            error(f"{name}: dp-all lb_policy should be LEAST_REQUEST")
    return hcm, wasm, plugin, ranks


def check_local_config(path):
    print(f"{os.path.relpath(path, ROOT)}:")
    cfg = load_yaml(path)
    hcm, wasm, plugin, ranks = check_envoy_common("envoy.yaml", cfg)
    addrs = plugin.get("learn", {}).get("upstream_addresses", {})
    want = {f"{a}:{p}": r for r, c in ranks.items() for a, p in cluster_endpoints(c)}
    if addrs != want:
        error(f"envoy.yaml: learn.upstream_addresses {addrs} != rank cluster endpoints {want}")
    else:
        ok("envoy.yaml: learn.upstream_addresses match the rank clusters")
    return cfg


# --- compose helpers -----------------------------------------------------------------------------


def volumes_of(svc):
    """[(source, target)] for bind mounts, short or long syntax."""
    out = []
    for v in svc.get("volumes", []) or []:
        if isinstance(v, str):
            parts = v.split(":")
            if len(parts) >= 2 and (parts[0].startswith(".") or parts[0].startswith("/")):
                out.append((parts[0], parts[1]))
        elif isinstance(v, dict) and v.get("type") == "bind":
            out.append((v["source"], v["target"]))
    return out


def command_list(svc):
    cmd = svc.get("command")
    if cmd is None:
        return []
    if isinstance(cmd, str):
        return cmd.split()
    return [str(x) for x in cmd]


def flag(cmd, name):
    for i, arg in enumerate(cmd):
        if arg == name and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def check_ports(sname, svc):
    for p in svc.get("ports", []) or []:
        spec = str(p) if not isinstance(p, dict) else \
            f"{p.get('host_ip', '')}:{p.get('published', '')}:{p.get('target', '')}"
        m = re.fullmatch(r"(?:([\d.]+):)?(\d+):(\d+)(?:/(tcp|udp))?", spec)
        if not m:
            error(f"compose: service {sname}: port {spec!r} is not [ip:]host:container")
            continue
        ip, host, cont = m.group(1), int(m.group(2)), int(m.group(3))
        if not (0 < host < 65536 and 0 < cont < 65536):
            error(f"compose: service {sname}: port {spec!r} out of range")
        if ip != "127.0.0.1":
            error(f"compose: service {sname}: port {spec!r} should be published on 127.0.0.1 only")


def check_build(sname, svc, compose_dir):
    build = svc.get("build")
    if build is None:
        return
    if isinstance(build, str):
        build = {"context": build}
    context = os.path.normpath(os.path.join(compose_dir, build.get("context", ".")))
    if not os.path.isdir(context):
        error(f"compose: service {sname}: build context {context} missing")
        return
    dockerfile = os.path.join(context, build.get("dockerfile", "Dockerfile"))
    if not os.path.isfile(dockerfile):
        error(f"compose: service {sname}: Dockerfile {dockerfile} missing")
        return
    text = open(dockerfile, encoding="utf-8").read()
    # Every `cargo build -p NAME` must name a workspace package that is in the context.
    for pkg in re.findall(r"cargo build[^\n]*?-p\s+(\S+)", text):
        if not package_exists(context, pkg):
            error(f"compose: {os.path.relpath(dockerfile, ROOT)} builds package {pkg}, not found in {context}")
    if not re.search(r"^FROM\s", text, re.M):
        error(f"compose: {dockerfile} has no FROM")
    ok(f"compose: service {sname}: builds {os.path.relpath(dockerfile, ROOT)} "
       f"(context {os.path.relpath(context, ROOT) or '.'})")


def package_exists(context, pkg):
    for dirpath, dirnames, filenames in os.walk(context):
        dirnames[:] = [d for d in dirnames if d not in ("target", ".git", ".tools", "node_modules")]
        if "Cargo.toml" in filenames:
            text = open(os.path.join(dirpath, "Cargo.toml"), encoding="utf-8").read()
            if re.search(rf'^\s*name\s*=\s*"{re.escape(pkg)}"', text, re.M):
                return True
    return False


def check_compose(compose_path, docker_cfg_path, envoy_version, wasm_local, wasm_built):
    print(f"{os.path.relpath(compose_path, ROOT)}:")
    compose_dir = os.path.dirname(compose_path)
    compose = load_yaml(compose_path)
    services = compose.get("services") if isinstance(compose, dict) else None
    if not isinstance(services, dict) or not services:
        error("compose: no services")
        return None
    ok(f"compose: parses, services: {', '.join(services)}")

    for sname, svc in services.items():
        if not isinstance(svc, dict) or not (svc.get("image") or svc.get("build")):
            error(f"compose: service {sname}: needs image or build")
            continue
        check_build(sname, svc, compose_dir)
        check_ports(sname, svc)
        for src, _ in volumes_of(svc):
            path = os.path.normpath(os.path.join(compose_dir, src))
            if not os.path.exists(path):
                if path == os.path.normpath(wasm_local) and wasm_local != wasm_built:
                    # Built elsewhere (CARGO_TARGET_DIR): compose needs it at its default path.
                    print(f"  note compose: service {sname}: {src} is not built here "
                          f"(the filter was built at {wasm_built}); `docker compose up` needs it there")
                else:
                    error(f"compose: service {sname}: bind source {src} ({path}) does not exist"
                          + (" - run `make build`" if path.endswith(".wasm") else ""))
            elif path.endswith(".wasm") and os.path.isdir(path):
                error(f"compose: {path} is a directory (a bind mount created it?); remove it and rebuild")
        deps = svc.get("depends_on", [])
        for dep in (deps if isinstance(deps, list) else list(deps)):
            if dep not in services:
                error(f"compose: service {sname} depends on unknown service {dep}")

    envoys = {n: s for n, s in services.items() if str(s.get("image", "")).startswith("envoyproxy/envoy")}
    if len(envoys) != 1:
        error(f"compose: expected one envoyproxy/envoy service, found {list(envoys)}")
        return None
    ename, esvc = next(iter(envoys.items()))
    image = esvc["image"]
    want = re.compile(rf"^envoyproxy/envoy(-distroless)?:v{re.escape(envoy_version)}$|"
                      rf"^envoyproxy/envoy:distroless-v{re.escape(envoy_version)}$")
    if not want.match(image):
        error(f"compose: {ename} image {image} does not match the tested Envoy {envoy_version}")
    else:
        ok(f"compose: {ename} image {image} matches the tested Envoy {envoy_version}")

    cmd = command_list(esvc)
    cfg_target = flag(cmd, "-c") or flag(cmd, "--config-path") or "/etc/envoy/envoy.yaml"
    mounts = {t: os.path.normpath(os.path.join(compose_dir, s)) for s, t in volumes_of(esvc)}
    if mounts.get(cfg_target) != os.path.normpath(docker_cfg_path):
        error(f"compose: {ename} reads {cfg_target}, which is not a mount of "
              f"{os.path.relpath(docker_cfg_path, ROOT)} (mounts: {mounts})")
    else:
        ok(f"compose: {ename} -c {cfg_target} is envoy/{os.path.basename(docker_cfg_path)}")
    return services, ename, mounts


def check_docker_config(docker_cfg_path, local_cfg, compose_info, wasm_local):
    print(f"{os.path.relpath(docker_cfg_path, ROOT)}:")
    cfg = load_yaml(docker_cfg_path)
    hcm, wasm, plugin, ranks = check_envoy_common("envoy.docker.yaml", cfg)

    if plugin.get("learn", {}).get("upstream_addresses", {}) != {}:
        error("envoy.docker.yaml: learn.upstream_addresses must be empty (upstreams are DNS names; "
              "the rank is learned from the response header)")
    if not plugin.get("learn", {}).get("response_header", "x-dp-rank"):
        error("envoy.docker.yaml: learn.response_header is empty: nothing to learn the rank from")

    wasm_path = wasm["vm_config"]["code"]["local"]["filename"]
    if compose_info:
        services, ename, mounts = compose_info
        if mounts.get(wasm_path) != os.path.normpath(wasm_local):
            error(f"envoy.docker.yaml: wasm {wasm_path} is not where compose mounts {wasm_local} "
                  f"(mounts: {mounts})")
        else:
            ok(f"envoy.docker.yaml: wasm {wasm_path} is the mounted build output")
        before = len(errors)
        for c in cfg["static_resources"]["clusters"]:
            cname = c["name"]
            dns = c.get("type") in ("STRICT_DNS", "LOGICAL_DNS")
            for host, port in cluster_endpoints(c):
                if not dns:
                    continue
                svc = services.get(host)
                if svc is None:
                    error(f"envoy.docker.yaml: cluster {cname} endpoint {host} is not a compose service")
                    continue
                cmd = command_list(svc)
                if flag(cmd, "--port") != str(port):
                    error(f"envoy.docker.yaml: cluster {cname} uses {host}:{port} but the service "
                          f"runs --port {flag(cmd, '--port')}")
                if flag(cmd, "--host") != "0.0.0.0":
                    error(f"compose: service {host} must bind --host 0.0.0.0 to be reachable from Envoy")
                m = RANK_CLUSTER.match(cname)
                if m and flag(cmd, "--rank") != m.group(1):
                    error(f"envoy.docker.yaml: cluster {cname} points at {host}, which runs --rank "
                          f"{flag(cmd, '--rank')}")
        if len(errors) == before:
            ok("envoy.docker.yaml: DNS endpoints are compose services with matching --rank/--port")

    # Same routing and filter as envoy.yaml, apart from the deliberate differences.
    _, local_hcm = hcm_of(local_cfg)
    if hcm.get("route_config") != local_hcm.get("route_config"):
        error("envoy.docker.yaml: route_config differs from envoy.yaml")
    local_wasm = copy.deepcopy(wasm_of(local_hcm))
    docker_wasm = copy.deepcopy(wasm)
    local_plugin, docker_plugin = plugin_json(local_wasm), plugin_json(docker_wasm)
    for p in (local_plugin, docker_plugin):
        p.get("learn", {}).pop("upstream_addresses", None)
    for w in (local_wasm, docker_wasm):
        w["vm_config"]["code"]["local"].pop("filename", None)
        w["configuration"].pop("value", None)
    if local_wasm != docker_wasm or local_plugin != docker_plugin:
        error("envoy.docker.yaml: the wasm filter settings differ from envoy.yaml "
              "(beyond the wasm path and learn.upstream_addresses)")
    else:
        ok("envoy.docker.yaml: routes and filter settings match envoy.yaml")

    return cfg, wasm_path


def envoy_validate(envoy, cfg, container_wasm, wasm_local):
    """Run `envoy --mode validate` on a copy of cfg whose wasm path points at the local build."""
    cfg = copy.deepcopy(cfg)
    _, hcm = hcm_of(cfg)
    local = wasm_of(hcm)["vm_config"]["code"]["local"]
    assert local["filename"] == container_wasm
    local["filename"] = wasm_local
    with tempfile.TemporaryDirectory(prefix="dp-affinity-validate-") as tmp:
        path = os.path.join(tmp, "envoy.docker.local.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        proc = subprocess.run([envoy, "--mode", "validate", "-c", path, "--log-level", "warn"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout)
        error(f"envoy.docker.yaml: `envoy --mode validate` failed (exit {proc.returncode}) "
              f"with the wasm path rewritten to {wasm_local}")
    else:
        ok(f"envoy.docker.yaml: `envoy --mode validate` OK (wasm {os.path.relpath(wasm_local, ROOT)})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compose", default=os.path.join(ENVOY_DIR, "docker-compose.yaml"))
    ap.add_argument("--docker-config", default=os.path.join(ENVOY_DIR, "envoy.docker.yaml"))
    ap.add_argument("--local-config", default=os.path.join(ENVOY_DIR, "envoy.yaml"))
    ap.add_argument("--envoy", default=os.environ.get("DP_AFFINITY_ENVOY")
                    or os.path.join(ROOT, ".tools/venv/bin/envoy"))
    ap.add_argument("--wasm", default=os.environ.get("DP_AFFINITY_WASM")
                    or os.path.join(ROOT, "target/wasm32-wasip1/release/dp_affinity.wasm"),
                    help="the built filter to validate with")
    ap.add_argument("--envoy-version", default=os.environ.get("ENVOY_VERSION", "1.40.0"))
    args = ap.parse_args()
    # The compose file mounts the artifact at its default place, whatever --wasm says.
    compose_wasm = os.path.join(ROOT, "target/wasm32-wasip1/release/dp_affinity.wasm")
    wasm = os.path.abspath(args.wasm)

    try:
        local_cfg = check_local_config(args.local_config)
        compose_info = check_compose(args.compose, args.docker_config, args.envoy_version, compose_wasm,
                                     wasm)
        docker_cfg, container_wasm = check_docker_config(args.docker_config, local_cfg, compose_info,
                                                         compose_wasm)
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        error(f"cannot read the configs: {type(exc).__name__}: {exc}")
        docker_cfg = None

    if docker_cfg is not None:
        if not os.path.isfile(wasm):
            error(f"wasm {wasm} not built: run `make build`")
        elif not os.access(args.envoy, os.X_OK):
            error(f"envoy {args.envoy} not installed: run `make tools`")
        else:
            envoy_validate(args.envoy, docker_cfg, container_wasm, wasm)

    if errors:
        print(f"validate-compose: {len(errors)} problem(s)")
        return 1
    print("validate-compose: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
