#!/usr/bin/env python3
"""Tests scripts/validate-deploy.py itself: the shipped manifests pass, and each broken copy fails
with the message that names its fault.

Every case copies deploy/ and envoy/ to a temporary directory, breaks one thing by a literal text
replacement (a replacement that no longer applies fails the test, so a case cannot silently stop
testing anything), runs the validator on the copy (scoped with --only to the part the fault is
in, to keep `make validate` fast) and asserts exit 1 plus the expected words in its output.
Exit 0 = every case behaved, 1 = not.
"""

import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALIDATOR = os.path.join(ROOT, "scripts", "validate-deploy.py")

# (name, --only scope, [(file under the copy, old text, new text)], words the failure must contain;
# None: a change the validator must accept)
CASES = [
    ("envoy.yaml without the fallback cluster an 8-rank copy is made from", ["engine-configs"],
     [("envoy/envoy.yaml", "  - name: dp-all\n", "  - name: dp-every\n")],
     "envoy.yaml for 8 ranks: ValueError: the config has no cluster 'dp-rank-0' or 'dp-all' to copy"),
    ("a rank cluster the 8-rank copy keeps but Envoy refuses (caught by Envoy only)", ["engine-configs"],
     [("envoy/envoy.yaml", "  - name: dp-rank-0\n    type: STATIC", "  - name: dp-rank-0\n    type: STATICALLY")],
     "envoy/envoy.yaml for 8 ranks (scripts/envoy-for-ranks.py) (wasm"),
    ("a manifest that is not YAML", ["files"],
     [("deploy/istio/gateway.yaml", "  servers:\n", "  servers: [unclosed\n")],
     "istio/gateway.yaml does not parse"),
    ("a document without a kind", ["files"],
     [("deploy/envoy-gateway/ranks/routing.yaml", "kind: HTTPRoute\n", "")],
     "lack apiVersion, kind or metadata.name"),
    ("the Istio body filter without allow_on_headers_stop_iteration", ["istio/ranks"],
     [("deploy/istio/ranks/body-envoyfilter.yaml", "            allow_on_headers_stop_iteration: true\n", "")],
     "allow_on_headers_stop_iteration is not true but the configuration reads the body"),
    ("an Envoy field value Envoy refuses (caught by Envoy only)", ["istio/engine"],
     [("deploy/istio/engine/body-envoyfilter.yaml", "failure_policy: FAIL_RELOAD", "failure_policy: FAIL_RELOADED")],
     "istio/engine: generated gateway with every patch and filter: `envoy --mode validate` failed"),
    ("a plugin configuration the filter refuses (caught by its on_configure only)", ["envoy-gateway/engine"],
     [("deploy/envoy-gateway/engine/body-patchpolicy.yaml", '"dp_size": 4,', '"dp_size": 0,')],
     "envoy-gateway/engine: generated gateway with every patch and filter: `envoy --mode validate` failed"),
    ("a plugin configuration that strays from envoy.yaml's", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/body-patchpolicy.yaml", '"ways": 16,', '"ways": 999,')],
     "plugin configuration differs from envoy/envoy.yaml's (rank clusters variant) at table.ways"),
    ("an ECDS type URL the filter is not", ["istio/ranks"],
     [("deploy/istio/ranks/body-envoyfilter.yaml", 'type_urls: ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]',
       'type_urls: ["type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"]')],
     "not in the filter's type_urls"),
    ("a missing rank route", ["istio/ranks"],
     [("deploy/istio/ranks/routing.yaml", "        x-dp-affinity-cluster: {exact: dp-rank-3}",
       "        x-dp-affinity-cluster: {exact: dp-rank-2}")],
     "rank routes match x-dp-affinity-cluster"),
    ("a rank route that passes the internal header to the engine", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/routing.yaml",
       "  - matches:\n    - headers: [{name: x-dp-affinity-cluster, value: dp-rank-1}]\n    filters:\n    - type: RequestHeaderModifier\n      requestHeaderModifier: {remove: [x-dp-affinity-cluster]}\n",
       "  - matches:\n    - headers: [{name: x-dp-affinity-cluster, value: dp-rank-1}]\n")],
     "the route for dp-rank-1 does not remove x-dp-affinity-cluster"),
    ("a header-only WasmPlugin that reads body fields", ["istio/ranks"],
     [("deploy/istio/ranks/header-wasmplugin.yaml", "      body_fields: []\n      max_bytes: 512",
       "      body_fields: [routing_key]\n      max_bytes: 512")],
     "cannot set allow_on_headers_stop_iteration but its configuration reads the body"),
    ("the Envoy Gateway buffer limit left at 32 KiB", ["envoy-gateway/engine"],
     [("deploy/envoy-gateway/gateway.yaml", "bufferLimit: 10Mi", "bufferLimit: 32Ki")],
     "Envoy answers 413"),
    ("a JSON patch path that is not in the generated listener", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/body-patchpolicy.yaml", "/default_filter_chain/filters/0/typed_config",
       "/default_filter_chain/filters/1/typed_config")],
     "does not exist in the generated listener"),
    ("a patched listener name Envoy Gateway does not generate", ["envoy-gateway/engine"],
     [("deploy/envoy-gateway/engine/body-patchpolicy.yaml", "name: llm/dp-gateway/http", "name: default/eg/http")],
     "names the gateway's listeners"),
    ("a wasm path no image volume provides", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/gateway.yaml", "mountPath: /opt/dp-affinity", "mountPath: /opt/wasm")],
     "is not plugin.wasm in an image volume"),
    ("two different wasm images", ["istio/ranks"],
     [("deploy/istio/ranks/header-wasmplugin.yaml", "dp-affinity:0.1.0", "dp-affinity:0.2.0")],
     "the manifests name different wasm images"),
    ("a one-engine Envoy config with the cluster target", ["engine-configs"],
     [("envoy/envoy.vllm-dp.yaml", '"mode": "engine",\n', ""),
      ("envoy/envoy.vllm-dp.yaml", '"engine": "vllm"', '"cluster_header": "x-dp-affinity-cluster"')],
     "envoy/envoy.vllm-dp.yaml: plugin configuration differs from envoy/envoy.yaml's (engine variant) at target"),
    ("a Dockerfile copying a file the build does not make", ["image"],
     [("deploy/wasm-image/Dockerfile", "COPY target/wasm32-wasip1/release/dp_affinity.wasm",
       "COPY target/wasm32-wasip1/release/dp-affinity.wasm")],
     "does not exist in the build context"),
    ("a Dockerfile putting the module where the fetchers do not look", ["image"],
     [("deploy/wasm-image/Dockerfile", "/plugin.wasm", "/filter.wasm")],
     "look for plugin.wasm"),
    ("a .dockerignore that leaves the module out of the context", ["image"],
     [("deploy/wasm-image/Dockerfile.dockerignore", "!target/wasm32-wasip1/release/dp_affinity.wasm\n", "")],
     "is excluded by Dockerfile.dockerignore"),
    ("an Envoy Gateway route left without a stream idle timeout", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/routing.yaml", "      streamIdleTimeout: 300s  # BackendTrafficPolicy field since Envoy Gateway v1.8\n", "")],
     "has no stream idle timeout (request timeout 0s and no BackendTrafficPolicy"),
    ("Envoy Gateway upstream connections kept idle past the engine's keep-alive", ["envoy-gateway/engine"],
     [("deploy/envoy-gateway/engine/routing.yaml", "connectionIdleTimeout: 4s", "connectionIdleTimeout: 1h")],
     "no BackendTrafficPolicy closes idle upstream connections"),
    ("an Istio rank subset selecting another rank's pod", ["istio/ranks"],
     [("deploy/istio/ranks/routing.yaml", "pod-name: engine-1\n", "pod-name: engine-2\n")],
     "the route for dp-rank-1 reaches pod ordinal 2"),
    ("an Envoy Gateway rank Service selecting another rank's pod", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/routing.yaml", "pod-name: engine-3\n", "pod-name: engine-0\n")],
     "the route for dp-rank-3 reaches pod ordinal 0"),
    ("Istio routes without the per-try idle timeout", ["istio/engine"],
     [("deploy/istio/engine/routing.yaml", "            per_try_idle_timeout: 290s\n", "")],
     "has no per_try_idle_timeout"),
    ("an Istio DestinationRule keeping idle connections past the engine's keep-alive", ["istio/engine"],
     [("deploy/istio/engine/routing.yaml", "idleTimeout: 4s", "idleTimeout: 30s")],
     "connectionPool.http.idleTimeout is 30s"),
    ("the Envoy Gateway fallback without a passive health check", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/routing.yaml",
       "  healthCheck:\n    passive:\n      splitExternalLocalOriginErrors: true\n"
       "      consecutiveLocalOriginFailures: 2\n      interval: 1s\n      baseEjectionTime: 10s\n"
       "      maxEjectionPercent: 50\n", "")],
     "has no outlier detection on local-origin failures"),
    ("Envoy Gateway retries on the rank routes", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/routing.yaml", "  name: dp-ranks-idle\n  namespace: llm\nspec:\n",
       "  name: dp-ranks-idle\n  namespace: llm\nspec:\n  retry: {numRetries: 1}\n")],
     "a pinned request's failure must reach the filter"),
    ("two BackendTrafficPolicies on one HTTPRoute", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/routing.yaml", "kind: HTTPRoute, name: dp-ranks}", "kind: HTTPRoute, name: dp-fallback}")],
     "refuses the others as conflicting"),
    ("the EnvoyExtensionPolicy off the fallback route", ["envoy-gateway/ranks"],
     [("deploy/envoy-gateway/ranks/header-extensionpolicy.yaml",
       "  - group: gateway.networking.k8s.io\n    kind: HTTPRoute\n    name: dp-fallback\n", "")],
     "a request matching another one is never placed"),
    ("the Istio fallback without retries", ["istio/ranks"],
     [("deploy/istio/ranks/routing.yaml", "      attempts: 3\n", "      attempts: 0\n")],
     "does not retry connect failures on another rank"),
    ("a secret seed and the vllm preset, as the files tell operators (passes)", ["envoy-gateway/engine"],
     [("deploy/envoy-gateway/engine/body-patchpolicy.yaml", '"hash_seed": ""', '"hash_seed": "my-secret"'),
      ("deploy/envoy-gateway/engine/body-patchpolicy.yaml", '"mode": "engine",\n                    "engine": "sglang"',
       '"mode": "engine",\n                    "engine": "vllm"')],
     None),
]


def copy_tree(dst):
    shutil.copytree(os.path.join(ROOT, "deploy"), os.path.join(dst, "deploy"))
    shutil.copytree(os.path.join(ROOT, "envoy"), os.path.join(dst, "envoy"))
    # The Dockerfile's build context: only the built module is needed.
    wasm = "target/wasm32-wasip1/release/dp_affinity.wasm"
    built = os.environ.get("DP_AFFINITY_WASM") or os.path.join(ROOT, wasm)
    os.makedirs(os.path.dirname(os.path.join(dst, wasm)))
    shutil.copy(built, os.path.join(dst, wasm))


def run(copy_dir, only):
    cmd = [sys.executable, VALIDATOR, "--deploy", os.path.join(copy_dir, "deploy"),
           "--envoy-dir", os.path.join(copy_dir, "envoy"), "--context", copy_dir]
    for part in only:
        cmd += ["--only", part]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_case(tmp, i, case):
    """None if the broken copy was refused as expected, else what went wrong (and the output)."""
    name, only, edits, expect = case
    case_dir = os.path.join(tmp, f"case{i}")
    copy_tree(case_dir)
    for rel, old, new in edits:
        path = os.path.join(case_dir, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if old not in text:
            return f"{name}: {rel} no longer contains {old!r}: update this case", ""
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new, 1))
    proc = run(case_dir, only)
    if expect is None:
        # A change the validator must accept.
        if proc.returncode != 0:
            return f"{name}: expected exit 0, got exit {proc.returncode}", proc.stdout
        return None, f"  ok   {name}: accepted\n"
    if proc.returncode != 1 or expect not in proc.stdout:
        return f"{name}: expected exit 1 with {expect!r}, got exit {proc.returncode}", proc.stdout
    return None, f"  ok   {name}: refused ({expect})\n"


def main():
    failures = []
    with tempfile.TemporaryDirectory(prefix="dp-affinity-validate-test-") as tmp:
        pristine = os.path.join(tmp, "pristine")
        copy_tree(pristine)
        # The cases run concurrently: each is a validator process plus at most one Envoy, and
        # they share nothing but the read-only build.
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            baseline = pool.submit(run, pristine, [])
            cases = [pool.submit(run_case, tmp, i, c) for i, c in enumerate(CASES)]
            proc = baseline.result()
            if proc.returncode != 0:
                sys.stdout.write(proc.stdout)
                failures.append("the unmodified copy does not pass")
            else:
                print("  ok   the unmodified copy passes")
            for future in cases:
                failure, output = future.result()
                sys.stdout.write(output)
                if failure:
                    failures.append(failure)
    if failures:
        for f in failures:
            print(f"  FAIL {f}")
        print(f"test-validate-deploy: {len(failures)} failure(s)")
        return 1
    accepted = sum(1 for case in CASES if case[3] is None)
    print(f"test-validate-deploy: OK ({len(CASES) - accepted} broken copies refused, "
          f"{accepted} operator edit(s) accepted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
