#!/usr/bin/env bash
# Runs the local demo: 4 mock DP ranks on 127.0.0.1:18000..18003 and Envoy with envoy/envoy.yaml
# (listener 127.0.0.1:10000, admin 127.0.0.1:9901) in the foreground. Ctrl-C (or SIGTERM, or any
# exit) stops all of them.
#
# Use `make run`, which installs the tools and builds first. Extra arguments go to Envoy, e.g.
#   scripts/run.sh --component-log-level wasm:debug,http:debug
# Environment: ENVOY (binary), MOCK (binary), DP_AFFINITY_WASM (the filter; default the path
# envoy/envoy.yaml names), RANKS (mock ranks, default 4 as envoy/envoy.yaml; another count runs
# a copy written by scripts/envoy-for-ranks.py), LOG_LEVEL (Envoy's own, default warning: its
# start-up lines are long and say nothing about the filter), WASM_LOG_LEVEL (the filter's, that
# is Envoy's `wasm` logger: default info; `WASM_LOG_LEVEL=debug make run` logs every placement).
# `curl -X POST 'localhost:9901/logging?wasm=debug'` changes it while Envoy runs.
set -euo pipefail

# envoy/envoy.yaml names the wasm by a path relative to the repository root, and Envoy resolves
# it against its working directory.
cd "$(dirname "$0")/.."

ENVOY="${ENVOY:-${DP_AFFINITY_ENVOY:-.tools/venv/bin/envoy}}"
MOCK="${MOCK:-${DP_AFFINITY_MOCK:-target/release/mock-rank}}"
# The path envoy/envoy.yaml names; `make run` passes the build's own (CARGO_TARGET_DIR).
SHIPPED_WASM="target/wasm32-wasip1/release/dp_affinity.wasm"
WASM="${DP_AFFINITY_WASM:-$SHIPPED_WASM}"
CONFIG="envoy/envoy.yaml"
LOG_LEVEL="${LOG_LEVEL:-warning}"
WASM_LOG_LEVEL="${WASM_LOG_LEVEL:-info}"
# Envoy refuses a flag given twice: extra arguments that set component levels replace ours.
COMPONENT_LEVELS=(--component-log-level "wasm:$WASM_LOG_LEVEL")
for arg in "$@"; do
    case "$arg" in --component-log-level*) COMPONENT_LEVELS=() ;; esac
done
RANKS="${RANKS:-4}"
PYTHON="${PYTHON:-.tools/venv/bin/python}"
BASE_PORT=18000
LISTEN_PORT=10000
ADMIN_PORT=9901

die() { printf 'run.sh: %s\n' "$*" >&2; exit 1; }

[ -x "$ENVOY" ] || die "envoy not found at $ENVOY: run \`make tools\`"
[ -x "$MOCK" ] || die "mock-rank not found at $MOCK: run \`make build\`"
[ -f "$WASM" ] || die "filter not found at $WASM: run \`make build\`"
case "$RANKS" in
    '' | *[!0-9]*) die "RANKS must be a number of ranks, got '$RANKS'" ;;
esac
[ "$RANKS" -ge 1 ] && [ "$RANKS" -le 64 ] || die "RANKS must be 1..64 here (one local port each), got $RANKS"

# True if something accepts TCP connections on 127.0.0.1:$1 (bash's /dev/tcp: no curl needed).
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The config's ports are fixed; say which one is taken instead of letting a child die cryptically.
for port in $LISTEN_PORT $ADMIN_PORT $(seq $BASE_PORT $((BASE_PORT + RANKS - 1))); do
    if port_open "$port"; then
        die "127.0.0.1:$port is already in use (another \`make run\`?)"
    fi
done

LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/dp-affinity-run.XXXXXX")"
# Another rank count than the shipped 4: the shipped config with dp_size, the rank clusters,
# dp-all and the learned addresses made for it, nothing else changed.
if [ "$RANKS" != 4 ]; then
    [ -x "$PYTHON" ] || die "python with PyYAML not found at $PYTHON: run \`make tools\`"
    "$PYTHON" scripts/envoy-for-ranks.py "$RANKS" --base-port "$BASE_PORT" > "$LOG_DIR/envoy-ranks.yaml" \
        || die "cannot write the config for $RANKS ranks"
    CONFIG="$LOG_DIR/envoy-ranks.yaml"
fi
# Another build than the shipped path: run a copy of the config that names it.
if [ "$WASM" != "$SHIPPED_WASM" ]; then
    sed "s|filename: $SHIPPED_WASM|filename: $WASM|" "$CONFIG" > "$LOG_DIR/envoy.yaml"
    CONFIG="$LOG_DIR/envoy.yaml"
fi
PIDS=()

# Stops every child we started, then waits for them so no process outlives the script. Runs once
# (EXIT fires after INT/TERM too). Children are killed by PID: they are ours alone.
cleaned=0
cleanup() {
    [ "$cleaned" = 1 ] && return
    cleaned=1
    trap - INT TERM
    if [ "${#PIDS[@]}" -gt 0 ]; then
        printf '\nrun.sh: stopping envoy and mock ranks\n' >&2
        kill -TERM "${PIDS[@]}" 2>/dev/null || true
        wait "${PIDS[@]}" 2>/dev/null || true
    fi
    printf 'run.sh: mock rank logs kept in %s\n' "$LOG_DIR" >&2
}
trap cleanup EXIT
# The exit status tells a caller the run was interrupted (128 + signal number).
trap 'exit 130' INT
trap 'exit 143' TERM

# Mock ranks. mock-rank prints "listening 127.0.0.1:PORT" once it accepts connections; its other
# output goes to a log file so Envoy's log stays readable in the terminal.
for r in $(seq 0 $((RANKS - 1))); do
    port=$((BASE_PORT + r))
    "$MOCK" --rank "$r" --port "$port" >"$LOG_DIR/rank-$r.log" 2>&1 &
    PIDS+=("$!")
done

# Wait for readiness (bounded): a rank that exits or never listens aborts the run.
wait_for() { # name pid port
    local i
    for i in $(seq 1 100); do
        port_open "$3" && return 0
        kill -0 "$2" 2>/dev/null || die "$1 exited early; see its log in $LOG_DIR"
        sleep 0.1
    done
    die "$1 not listening on 127.0.0.1:$3 after 10 s"
}
for r in $(seq 0 $((RANKS - 1))); do
    wait_for "mock rank $r" "${PIDS[$r]}" $((BASE_PORT + r))
done

# Envoy. --disable-hot-restart: no shared-memory region, so this Envoy does not clash with the
# Envoys that the e2e tests start (a second Envoy with hot restart on needs its own --base-id).
# It runs as a background child (not exec) so the traps above stay in force; `wait` below keeps
# the script in the foreground for as long as Envoy runs. The access log is flushed every 10 s
# by default; every 0.5 s here, so each request's line shows as it is answered.
"$ENVOY" -c "$CONFIG" \
    --log-level "$LOG_LEVEL" \
    "${COMPONENT_LEVELS[@]}" \
    --file-flush-interval-msec 500 \
    --concurrency 2 \
    --disable-hot-restart \
    "$@" &
ENVOY_PID=$!
PIDS+=("$ENVOY_PID")

for i in $(seq 1 100); do
    if port_open "$LISTEN_PORT" && port_open "$ADMIN_PORT"; then
        break
    fi
    kill -0 "$ENVOY_PID" 2>/dev/null || die "envoy exited during startup (see its log above)"
    sleep 0.1
done

cat <<EOF

==== dp-affinity is running ====
  Envoy    http://127.0.0.1:$LISTEN_PORT   admin http://127.0.0.1:$ADMIN_PORT
  ranks    127.0.0.1:$BASE_PORT..$((BASE_PORT + RANKS - 1)) (logs in $LOG_DIR)

  # routing key: the first request is placed (its key's home), the next ones stick to it
  curl -si localhost:$LISTEN_PORT/v1/chat/completions -H 'content-type: application/json' \\
       -H 'x-routing-key: conv-1' -d '{"model":"m","messages":[{"role":"user","content":"hi"}]}' | grep -i x-dp-rank
  # key in the body (OpenAI prompt_cache_key), streamed
  curl -sN localhost:$LISTEN_PORT/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"model":"m","prompt_cache_key":"conv-2","stream":true,"messages":[{"role":"user","content":"hi"}]}'
  # explicit rank (header, or body field routed_dp_rank)
  curl -si localhost:$LISTEN_PORT/generate -H 'x-data-parallel-rank: 2' -d '{"text":"hi"}' | grep -i x-dp-rank
  # invalid rank -> 400 JSON error
  curl -s localhost:$LISTEN_PORT/generate -H 'content-type: application/json' -d '{"text":"hi","routed_dp_rank":$((RANKS + 3))}'
  # filter counters
  curl -s localhost:$ADMIN_PORT/stats | grep wasmcustom.dp_affinity

Ctrl-C stops everything.
EOF

# Returns when Envoy exits (or a signal arrives: the trap runs, then cleanup on EXIT).
set +e
wait "$ENVOY_PID"
status=$?
set -e
exit "$status"
