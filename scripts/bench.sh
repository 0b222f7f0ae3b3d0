#!/usr/bin/env bash
# Runs every benchmark behind the figures in BENCHMARKS.md and writes one report:
#   1. native micro-benchmarks (`cargo bench --bench core`): affinity table, body field extraction;
#   2. the size of the release wasm;
#   3. what the filter costs through Envoy against the same upstream, under wrk
#      (scripts/bench-overhead.py);
#   4. what affinity buys: hit rate, balance and latency per routing policy on a multi-turn
#      workload through Envoy in front of mock ranks with a prefix cache, the SGLang model gateway
#      as a peer router (scripts/bench-affinity.py).
# The report goes to results/bench-<UTC date>.md (results/ is git-ignored) and to stdout; raw
# data (wrk outputs, traces, per-request records, Envoy logs, the SVG chart) go to
# results/bench-<UTC date>/.
#
#   make bench                 builds the tools, the wasm and the mock first, then runs this
#   scripts/bench.sh [--quick] expects `make build` to have run; --quick: shorter, noisier
#
# Takes under 10 minutes (under 2 with --quick) on the 2-core machines, plus compiling the bench
# binary when the source changed. Everything it starts (Envoy, wrk, mock ranks, the load
# generator, the bench binary) is a child that is stopped before it returns, also on Ctrl-C.
set -euo pipefail

cd "$(dirname "$0")/.."

QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
    esac
done
QUICK_ARG=()
[ "$QUICK" = 1 ] && QUICK_ARG=(--quick)

ENVOY="${ENVOY:-${DP_AFFINITY_ENVOY:-.tools/venv/bin/envoy}}"
WASM="${DP_AFFINITY_WASM:-target/wasm32-wasip1/release/dp_affinity.wasm}"
STAMP="$(date -u +%Y-%m-%dT%H%M%SZ)"
REPORT="results/bench-$STAMP.md"
RAW="results/bench-$STAMP"
mkdir -p "$RAW"

log() { printf '[bench] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

[ -f "$WASM" ] || die "no wasm at $WASM: run \`make build\` (or \`make bench\`)"
[ -x "$ENVOY" ] || die "no envoy at $ENVOY: run \`make tools\` (or \`make bench\`)"
# A snapshot of the wasm: the size reported and the module Envoy loads are the same bytes even if
# a build replaces the artifact while the benchmark runs.
cp "$WASM" "$RAW/dp_affinity.wasm"
SOURCE_WASM="$WASM"
WASM="$RAW/dp_affinity.wasm"

# wrk is a Debian package; install it on first use (these machines run as root).
if ! command -v wrk >/dev/null 2>&1; then
    log "installing wrk (apt-get)"
    { apt-get update -qq && apt-get install -y -qq wrk; } >&2 || die "cannot install wrk"
fi

# The SGLang model gateway (pinned, into .tools/venv): only the benchmarks use it, so only they
# install it; a no-op once it is there.
scripts/install-tools.sh --bench >&2 || die "cannot install the SGLang model gateway (scripts/install-tools.sh --bench)"

# Children run in the background and are waited for, so a TERM/INT sent to this script alone
# (not to its process group) is forwarded instead of leaving them running.
CHILD=""
forward() {
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
    exit "$1"
}
trap 'forward 130' INT
trap 'forward 143' TERM

# child CMD...: runs CMD (stdin from /dev/null) as a waited-for child; returns its status.
child() {
    "$@" </dev/null &
    CHILD=$!
    local status=0
    wait "$CHILD" || status=$?
    CHILD=""
    return "$status"
}

# report LINES...: appends to the report.
report() { printf '%s\n' "$@" >>"$REPORT"; }

machine() {
    local model kernel load
    model="$(lscpu | sed -n 's/^Model name: *//p' | head -n1)"
    kernel="$(uname -sr)"
    load="$(cut -d' ' -f1-3 /proc/loadavg)"
    report "# dp-affinity benchmarks, $STAMP" "" \
        "- machine: $(nproc) CPUs, ${model:-unknown model}, $kernel" \
        "- load average at start: $load (the cores are shared with other work)" \
        "- $(rustc --version), Envoy $("$ENVOY" --version | grep -oE '/[0-9]+\.[0-9]+\.[0-9]+/' | head -n1 | tr -d /), wrk $(wrk -v 2>&1 | sed -n 's/^wrk \([^ ]*\).*/\1/p')" \
        "- wasm: \`$SOURCE_WASM\` built $(date -u -r "$SOURCE_WASM" '+%Y-%m-%d %H:%M UTC'), sha256 $(sha256sum "$WASM" | cut -c1-16)…" \
        "- mode: $([ "$QUICK" = 1 ] && echo 'quick (--quick)' || echo full)" ""
}

micro() {
    log "1/4 native micro-benchmarks: cargo bench --bench core ${QUICK_ARG[*]}"
    local out="$RAW/core.md"
    # Compiler output to a file: the report keeps only the bench's own table.
    child cargo bench --bench core -- "${QUICK_ARG[@]}" >"$out" 2>"$RAW/cargo-bench.log" ||
        die "cargo bench failed; see $RAW/cargo-bench.log"
    report "## Native micro-benchmarks (\`cargo bench --bench core\`)" "" "$(cat "$out")" ""
}

wasm_size() {
    log "2/4 wasm size"
    local bytes kib verdict
    bytes="$(stat -c %s "$WASM")"
    kib="$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1024}')"
    verdict="$(awk -v b="$bytes" 'BEGIN {print (b <= 300 * 1024) ? "met" : "**missed**"}')"
    report "## wasm size" "" \
        "| artifact | size | goal | |" "|---|---:|---|---|" \
        "| \`$SOURCE_WASM\` | $bytes B ($kib KiB) | ≤ 300 KiB | $verdict |" ""
}

overhead() {
    log "3/4 overhead through Envoy (scripts/bench-overhead.py ${QUICK_ARG[*]})"
    local out="$RAW/overhead.md"
    child env DP_AFFINITY_WASM="$WASM" python3 scripts/bench-overhead.py "${QUICK_ARG[@]}" --out "$RAW" >"$out" ||
        die "the overhead benchmark failed; see $RAW"
    report "$(cat "$out")" ""
}

affinity() {
    log "4/4 affinity comparison (scripts/bench-affinity.py ${QUICK_ARG[*]})"
    local out="$RAW/affinity.md"
    child env DP_AFFINITY_WASM="$WASM" python3 scripts/bench-affinity.py "${QUICK_ARG[@]}" --out "$RAW" >"$out" ||
        die "the affinity comparison failed; see $RAW"
    local svg
    svg="$(ls "$RAW"/affinity-*.svg | head -n1)"
    # A full run's chart becomes the one BENCHMARKS.md shows (docs/affinity.svg, tracked).
    if [ "$QUICK" = 0 ]; then
        mkdir -p docs && cp "$svg" docs/affinity.svg
    fi
    report "$(cat "$out")" "" "Chart: \`$svg\`$([ "$QUICK" = 0 ] && echo ' (copied to `docs/affinity.svg`)')" ""
}

started=$SECONDS
: >"$REPORT"
machine
micro
wasm_size
overhead
affinity
report "Total time: $((SECONDS - started)) s. Raw outputs: \`$RAW/\`."
log "report: $REPORT"
cat "$REPORT"
