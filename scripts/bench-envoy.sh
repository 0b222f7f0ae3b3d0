#!/usr/bin/env bash
# Through-Envoy benchmark: plain Envoy (listener A) vs Envoy + the dp_affinity filter (listener B),
# and a do-nothing wasm filter (listener N) as the floor of any wasm filter, all answering with a
# direct_response, in ONE Envoy process started here and always stopped.
# Load comes from wrk on 127.0.0.1. Prints a Markdown section on stdout; progress on stderr.
#
# Usually run by scripts/bench.sh (`make bench`). Alone:
#   scripts/bench-envoy.sh [--quick]
#
# Variants (same wrk flags, same Lua script, so the client does the same work for each):
#   A             plain listener, GET /       with x-smg-routing-key (ignored: no filter)
#   N no-op wasm  no-op filter,   GET /       with x-smg-routing-key (ignored)
#   B key miss    filter, GET /               with x-smg-routing-key: the response names no rank,
#                 so the key is never learned: hash + table lookup (miss) on every request
#   B key hit     filter, GET /learn          with x-smg-routing-key: the response carries
#                 x-dp-rank: 1, so each key is pinned once (in the warm-up) and then hits
#                 (hash + lookup + refresh, set the cluster header, echo the rank)
#   B explicit    filter, GET /               with x-data-parallel-rank: 1 (table untouched)
# Keys: BENCH_KEYS distinct keys (default 1000), one picked at random per request.
#
# Two loads: "sat" (wrk -t1 -c16: the 2 cores saturated, for throughput) and "c1" (one connection,
# one request in flight, for the latency a request gains). Rounds alternate the variants (A, N,
# B miss, B hit, B explicit); each figure is the median over the rounds.
#
# Environment (defaults in brackets):
#   ENVOY [$DP_AFFINITY_ENVOY or .tools/venv/bin/envoy]   WASM [$DP_AFFINITY_WASM or the release wasm]
#   BENCH_WRK_THREADS [1]  BENCH_WRK_CONNECTIONS [16]  BENCH_DURATION [8 s; quick 3] (sat runs)
#   BENCH_LAT_DURATION [4 s; quick 2] (c1 runs)  BENCH_WARMUP [2 s; quick 1]
#   BENCH_ROUNDS [3; quick 2]  BENCH_KEYS [1000]
#   BENCH_PORT_A [10080]  BENCH_PORT_B [10081]  BENCH_PORT_N [10082]  BENCH_ADMIN_PORT [10090]
#   BENCH_LOG_DIR [a new temp dir]: raw wrk outputs, the Envoy config and log are kept there.
set -euo pipefail

cd "$(dirname "$0")/.."

QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
    esac
done

ENVOY="${ENVOY:-${DP_AFFINITY_ENVOY:-.tools/venv/bin/envoy}}"
WASM="${WASM:-${DP_AFFINITY_WASM:-target/wasm32-wasip1/release/dp_affinity.wasm}}"
THREADS="${BENCH_WRK_THREADS:-1}"
CONNS="${BENCH_WRK_CONNECTIONS:-16}"
if [ "$QUICK" = 1 ]; then
    DURATION="${BENCH_DURATION:-3}" LAT_DURATION="${BENCH_LAT_DURATION:-2}"
    WARMUP="${BENCH_WARMUP:-1}" ROUNDS="${BENCH_ROUNDS:-2}"
else
    DURATION="${BENCH_DURATION:-8}" LAT_DURATION="${BENCH_LAT_DURATION:-4}"
    WARMUP="${BENCH_WARMUP:-2}" ROUNDS="${BENCH_ROUNDS:-3}"
fi
KEYS="${BENCH_KEYS:-1000}"
PORT_A="${BENCH_PORT_A:-10080}"
PORT_B="${BENCH_PORT_B:-10081}"
PORT_N="${BENCH_PORT_N:-10082}"
ADMIN="${BENCH_ADMIN_PORT:-10090}"
LOG_DIR="${BENCH_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/dp-affinity-bench.XXXXXX")}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"

log() { printf '[bench-envoy] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# --- prerequisites ---------------------------------------------------------------------------

# wrk is a Debian package; install it on first use (these machines run as root).
if ! command -v wrk >/dev/null 2>&1; then
    log "installing wrk (apt-get)"
    { apt-get update -qq && apt-get install -y -qq wrk; } >&2 || die "cannot install wrk"
fi
[ -x "$ENVOY" ] || die "envoy not found at $ENVOY: run \`make tools\`"
[ -f "$WASM" ] || die "filter not found at $WASM: run \`make build\`"
WASM="$(cd "$(dirname "$WASM")" && pwd)/$(basename "$WASM")"

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in "$PORT_A" "$PORT_B" "$PORT_N" "$ADMIN"; do
    port_open "$port" && die "127.0.0.1:$port is already in use (set BENCH_PORT_A/B/N, BENCH_ADMIN_PORT)"
done

log "building the no-op wasm filter (scripts/bench-noop-wasm.sh)"
NOOP_WASM="$(bash scripts/bench-noop-wasm.sh)" || die "cannot build the no-op wasm filter"

# --- Envoy config and wrk script -------------------------------------------------------------

# The shipped config names the wasm files relative to the repo root and uses fixed ports:
# rewrite both.
CONFIG="$LOG_DIR/direct.yaml"
sed -e "s#filename: target/wasm32-wasip1/release/dp_affinity.wasm#filename: $WASM#" \
    -e "s#filename: target/bench-noop/target/wasm32-wasip1/release/noop_filter.wasm#filename: $NOOP_WASM#" \
    -e "s#port_value: 10080#port_value: $PORT_A#" \
    -e "s#port_value: 10081#port_value: $PORT_B#" \
    -e "s#port_value: 10082#port_value: $PORT_N#" \
    -e "s#port_value: 10090#port_value: $ADMIN#" \
    envoy/bench/direct.yaml >"$CONFIG"
for path in "$WASM" "$NOOP_WASM"; do
    grep -q "filename: $path" "$CONFIG" || die "could not set the wasm path $path in $CONFIG"
done

# One Lua script for every variant: the per-request client cost (random key, header formatting)
# is the same for A and B, so it cancels out of the ratio. `done` prints one machine-readable
# line; wrk's latency percentiles are in microseconds.
LUA="$LOG_DIR/keys.lua"
cat >"$LUA" <<'EOF'
-- args: mode (key | explicit), number of keys, key prefix
local mode, nkeys, prefix

function init(args)
  mode = args[1] or "key"
  nkeys = tonumber(args[2] or "1000")
  prefix = args[3] or "k-"
  math.randomseed(os.time() + math.floor(os.clock() * 1e6))
end

function request()
  local headers = { ["x-smg-routing-key"] = prefix .. math.random(nkeys) }
  if mode == "explicit" then
    headers["x-data-parallel-rank"] = "1"
  end
  return wrk.format("GET", nil, headers)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT rps=%.1f p50_us=%d p90_us=%d p99_us=%d requests=%d errors=%d\n",
    summary.requests / summary.duration * 1e6,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    summary.requests, e.connect + e.read + e.write + e.status + e.timeout))
end
EOF

# --- Envoy ----------------------------------------------------------------------------------

ENVOY_PID=""
stop_envoy() {
    if [ -n "$ENVOY_PID" ]; then
        kill -TERM "$ENVOY_PID" 2>/dev/null || true
        wait "$ENVOY_PID" 2>/dev/null || true
        ENVOY_PID=""
    fi
}
trap stop_envoy EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$ENVOY" --mode validate -c "$CONFIG" --log-level warn >&2 || die "envoy rejects $CONFIG"

# Own --base-id (derived from our PID) so this Envoy's shared memory never clashes with another
# Envoy on the machine (make run, the e2e tests, a second bench).
BASE_ID=$((900000 + $$ % 100000))
log "starting envoy (--concurrency 2, --base-id $BASE_ID), log in $LOG_DIR/envoy.log"
"$ENVOY" -c "$CONFIG" --concurrency 2 --base-id "$BASE_ID" --log-level warn \
    >"$LOG_DIR/envoy.log" 2>&1 &
ENVOY_PID=$!

admin() { curl -fsS --max-time 5 "http://127.0.0.1:$ADMIN$1"; }
ready=0
for _ in $(seq 1 100); do
    kill -0 "$ENVOY_PID" 2>/dev/null || die "envoy exited during startup; see $LOG_DIR/envoy.log"
    if [ "$(admin /ready 2>/dev/null || true)" = "LIVE" ]; then ready=1; break; fi
    sleep 0.1
done
[ "$ready" = 1 ] || die "envoy not ready after 10 s; see $LOG_DIR/envoy.log"

# The filter's outcome counters (wasmcustom.dp_affinity.NAME) as "hit miss explicit". The filter
# hands its counts to Envoy once per tick (1 s), so wait for a tick before reading.
FLUSH_WAIT=1.3
outcomes() {
    sleep "$FLUSH_WAIT"
    admin "/stats?filter=^wasmcustom\\.dp_affinity\\.(affinity_hit|affinity_miss|explicit)\$" |
        awk -F': ' '{n[$1] = $2} END {
            p = "wasmcustom.dp_affinity."
            print n[p "affinity_hit"] + 0, n[p "affinity_miss"] + 0, n[p "explicit"] + 0
        }'
}

# Sanity before measuring: the filter learns on /learn and hits the next time.
curl -fsS -o /dev/null "http://127.0.0.1:$PORT_B/learn" -H 'x-smg-routing-key: sanity'
curl -fsS -o /dev/null "http://127.0.0.1:$PORT_B/learn" -H 'x-smg-routing-key: sanity'
read -r hits _ <<<"$(outcomes)"
[ "$hits" -ge 1 ] || die "the filter did not learn from x-dp-rank (no affinity_hit after a tick)"
read -r -a LAST <<<"$(outcomes)"

# --- runs -----------------------------------------------------------------------------------

# variant -> listener port, path, Lua args
declare -A PORT=([A]=$PORT_A [N]=$PORT_N [B-miss]=$PORT_B [B-hit]=$PORT_B [B-explicit]=$PORT_B)
declare -A URLPATH=([A]=/ [N]=/ [B-miss]=/ [B-hit]=/learn [B-explicit]=/)
declare -A ARGS=([A]="key $KEYS miss-" [N]="key $KEYS miss-" [B-miss]="key $KEYS miss-"
                 [B-hit]="key $KEYS hit-" [B-explicit]="explicit $KEYS miss-")
VARIANTS=(A N B-miss B-hit B-explicit)
# load -> wrk flags. "sat": enough connections to saturate the 2 cores (throughput; latency is
# then mostly queueing, ≈ connections / throughput). "c1": one connection, one request in
# flight, so p50 is the time Envoy takes per request and Δp50 is the filter's added latency.
declare -A WRK_FLAGS=([sat]="-t$THREADS -c$CONNS" [c1]="-t1 -c1")
RESULTS="$LOG_DIR/results.tsv"
: >"$RESULTS"

# CPU time Envoy has used so far (all threads), in clock ticks: utime + stime of /proc/PID/stat.
# Per request, it is the cost that scheduling noise on the shared cores barely moves.
HZ="$(getconf CLK_TCK)"
envoy_ticks() { awk '{print $14 + $15}' "/proc/$ENVOY_PID/stat"; }

# run LOAD VARIANT SECONDS LABEL: one wrk run; appends to $RESULTS
#   load variant label rps p50 p99 errors hit miss explicit envoy_cpu_us_per_request
run() {
    local load=$1 v=$2 secs=$3 label=$4 out="$LOG_DIR/wrk-$1-$2-$4.txt"
    local ticks0 ticks line cpu now=(0 0 0) delta=(0 0 0) k
    kill -0 "$ENVOY_PID" 2>/dev/null || die "envoy is gone (interrupted?); see $LOG_DIR/envoy.log"
    ticks0=$(envoy_ticks)
    # shellcheck disable=SC2086 # WRK_FLAGS and ARGS hold several words on purpose
    wrk ${WRK_FLAGS[$load]} -d"${secs}s" --latency -s "$LUA" \
        "http://127.0.0.1:${PORT[$v]}${URLPATH[$v]}" -- ${ARGS[$v]} >"$out" 2>&1 ||
        die "wrk failed for $v; see $out"
    ticks=$(($(envoy_ticks) - ticks0))
    # Only the filter's listener moves its counters: no need to wait for a tick after A or N.
    if [ "$v" != A ] && [ "$v" != N ]; then
        read -r -a now <<<"$(outcomes)"
        for k in 0 1 2; do delta[k]=$((now[k] - LAST[k])); done
        LAST=("${now[@]}")
    fi
    line=$(grep '^RESULT ' "$out") || die "no RESULT line from wrk; see $out"
    kv() { sed -n "s/.* $1=\([0-9.]*\).*/\1/p" <<<"$line"; }
    cpu=$(awk -v t="$ticks" -v hz="$HZ" -v n="$(kv requests)" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$load" "$v" "$label" "$(kv rps)" \
        "$(kv p50_us)" "$(kv p99_us)" "$(kv errors)" "${delta[0]}" "${delta[1]}" "${delta[2]}" \
        "$cpu" >>"$RESULTS"
    log "$(printf '%-4s %-10s %-7s %9s req/s  p50 %5s µs  p99 %5s µs  envoy cpu %5s µs/req' \
        "$load" "$v" "$label" "$(kv rps)" "$(kv p50_us)" "$(kv p99_us)" "$cpu")"
}

# The warm-up also pins the B-hit keys (each key's first request is a miss that learns).
log "warm-up: ${WARMUP} s per variant"
for v in "${VARIANTS[@]}"; do run sat "$v" "$WARMUP" warmup; done
log "throughput: $ROUNDS rounds x ${#VARIANTS[@]} variants x ${DURATION} s (wrk ${WRK_FLAGS[sat]})"
for r in $(seq 1 "$ROUNDS"); do
    for v in "${VARIANTS[@]}"; do run sat "$v" "$DURATION" "round$r"; done
done
log "latency: $ROUNDS rounds x ${#VARIANTS[@]} variants x ${LAT_DURATION} s (wrk ${WRK_FLAGS[c1]})"
for r in $(seq 1 "$ROUNDS"); do
    for v in "${VARIANTS[@]}"; do run c1 "$v" "$LAT_DURATION" "round$r"; done
done
ENVOY_VERSION="$("$ENVOY" --version | grep -oE '/[0-9]+\.[0-9]+\.[0-9]+/' | head -n1 | tr -d / || true)"
stop_envoy

# --- report ---------------------------------------------------------------------------------

# column C of the measured (non-warm-up) rows of load L, variant V: one value per line
col() { awk -F'\t' -v l="$1" -v v="$2" -v c="$3" '$1 == l && $2 == v && $3 != "warmup" {print $c}' "$RESULTS"; }
median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
sum() { awk '{s += $1} END {print s + 0}'; }
calc() { awk "BEGIN {printf \"$1\", $2}"; }
per_round() { awk '{printf "%s%.0f", (NR > 1 ? ", " : ""), $1}'; }
name() {
    case "$1" in
        A) echo "A plain Envoy" ;;
        N) echo "N no-op wasm filter" ;;
        *) echo "B dp_affinity, ${1#B-}" ;;
    esac
}

# spread LOAD COLUMN: how far apart the A rounds are on that column, in percent of the lowest
spread() {
    local lo hi
    lo=$(col "$1" A "$2" | sort -g | head -n1) hi=$(col "$1" A "$2" | sort -g | tail -n1)
    calc '%.1f' "($hi - $lo) / $lo * 100"
}

# table LOAD: one Markdown table; the goal column judges throughput (sat) or added p50 (c1).
table() {
    local load=$1 a_rps a_p50 a_p99 a_cpu v rps p50 p99 cpu ratio added d50 d99 dcpu outcome verdict
    a_rps=$(col "$load" A 4 | median) a_p50=$(col "$load" A 5 | median) a_p99=$(col "$load" A 6 | median)
    a_cpu=$(col "$load" A 11 | median)
    echo "| variant | req/s (median) | per round | × A | p50 | Δp50 | p99 | Δp99 | Envoy CPU/req | Δ CPU/req | filter outcome | goal |"
    echo "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"
    for v in "${VARIANTS[@]}"; do
        rps=$(col "$load" "$v" 4 | median) p50=$(col "$load" "$v" 5 | median)
        p99=$(col "$load" "$v" 6 | median) cpu=$(col "$load" "$v" 11 | median)
        ratio=$(calc '%.2f' "$rps / $a_rps")
        added=$(calc '%.0f' "$p50 - $a_p50")
        d50="$(calc '%+.0f' "$added") µs" d99="$(calc '%+.0f' "$p99 - $a_p99") µs"
        dcpu="$(calc '%+.1f' "$cpu - $a_cpu") µs"
        if [ "$v" = A ] || [ "$v" = N ]; then
            outcome="—" verdict=""
            [ "$v" = A ] && d50="—" d99="—" dcpu="—"
        else
            outcome="hit $(col "$load" "$v" 8 | sum), miss $(col "$load" "$v" 9 | sum), explicit $(col "$load" "$v" 10 | sum)"
            if [ "$load" = sat ]; then
                verdict=$(awk -v r="$ratio" 'BEGIN {print (r >= 0.85) ? "met (≥ 0.85×)" : "**missed** (≥ 0.85×)"}')
            else
                verdict=$(awk -v d="$added" 'BEGIN {print (d <= 40) ? "met (≤ +40 µs)" : "**missed** (≤ +40 µs)"}')
            fi
        fi
        printf '| %s | %.0f | %s | %s | %.0f µs | %s | %.0f µs | %s | %.1f µs | %s | %s | %s |\n' \
            "$(name "$v")" "$rps" "$(col "$load" "$v" 4 | per_round)" "$ratio" "$p50" "$d50" \
            "$p99" "$d99" "$cpu" "$dcpu" "$outcome" "$verdict"
    done
}

cat <<EOF
Envoy ${ENVOY_VERSION:-?}, \`--concurrency 2\`, one process, three listeners on 127.0.0.1
(\`envoy/bench/direct.yaml\`: A plain, N no-op wasm filter, B dp_affinity), direct responses.
wrk picks one of $KEYS routing keys per request (Lua script, same for every variant). Warm-up
${WARMUP} s per variant, then $ROUNDS rounds alternating A, N, B miss, B hit, B explicit; each
figure is the median over the rounds. wrk and Envoy share the 2 cores. N is a wasm filter that
does nothing: the share of any wasm filter. "Envoy CPU/req" is the CPU time of the Envoy process
(all threads, /proc) during the run divided by the requests served: the least noisy figure here.
Goals for the filter (header path): throughput ≥ 0.85× A, added p50 ≤ 40 µs.

Throughput, \`wrk ${WRK_FLAGS[sat]} -d${DURATION}s --latency\` (saturated: latencies here are
mostly queueing, about connections ÷ throughput):

EOF
table sat
cat <<EOF

Latency, \`wrk ${WRK_FLAGS[c1]} -d${LAT_DURATION}s --latency\` (one request in flight: Δp50 is the
time the filter adds to a request):

EOF
table c1
echo
errors=$(awk -F'\t' '$3 != "warmup" {s += $7} END {print s + 0}' "$RESULTS")
[ "$errors" = 0 ] || echo "**$errors wrk errors** (non-2xx, timeouts, resets): see $LOG_DIR."
# Each load is judged on the figure it is for: throughput when saturated, p50 with one connection
# (its throughput swings with wake-up latency and says little).
for check in "sat 4 throughput" "c1 5 p50"; do
    read -r load column what <<<"$check"
    s=$(spread "$load" "$column")
    if awk -v s="$s" 'BEGIN {exit !(s > 15)}'; then
        echo "**Noisy ($load)**: the A rounds' $what differs by $s% (> 15%): something else took CPU; rerun."
    else
        echo "A rounds ($load): $what within $s% of each other."
    fi
done
log "raw wrk outputs in $LOG_DIR"
