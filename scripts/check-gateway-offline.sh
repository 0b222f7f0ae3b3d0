#!/usr/bin/env bash
# Checks that the SGLang model gateway, as the benchmarks start it, reaches nothing outside this
# machine: runs the gateway policies of the kv suite (4 ranks) with every gateway process under
# `strace -f -e trace=connect`, then lists every address any of them connected to (or tried to).
# Fails (exit 1) on any address that is not 127.0.0.1 / ::1, and on a run with no connection at
# all (the trace would then prove nothing).
#
#   scripts/check-gateway-offline.sh            # ~1 minute; needs `make build` and
#                                               # `scripts/install-tools.sh --bench`
#   NO_NET=1 scripts/check-gateway-offline.sh   # the same inside a user+network namespace with
#                                               # only a loopback (unshare -rn): a hub fetch or
#                                               # DNS look-up would fail there, and show in the
#                                               # trace as a refused or unreachable connect
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
log() { printf '[check-gateway-offline] %s\n' "$*" >&2; }

SMG="${DP_AFFINITY_SMG:-$ROOT/.tools/venv/bin/smg}"
[ -x "$SMG" ] || { log "no smg at $SMG: run scripts/install-tools.sh --bench"; exit 1; }
# strace is a Debian package; install it on first use (these machines run as root).
if ! command -v strace >/dev/null 2>&1; then
    log "installing strace (apt-get)"
    { apt-get update -qq && apt-get install -y -qq strace; } >&2
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# Every gateway the bench starts runs through this wrapper, each with its own trace file. strace
# only detaches when it is stopped, so the wrapper stops the gateway itself (strace's child).
cat >"$WORK/smg" <<EOF
#!/bin/sh
strace -f -qq -e trace=connect -o "$WORK/trace.\$\$" "$SMG" "\$@" &
tracer=\$!
trap 'kill -TERM \$(pgrep -P \$tracer) 2>/dev/null; wait \$tracer' TERM INT
wait \$tracer
EOF
chmod +x "$WORK/smg"

bench=(python3 scripts/bench-affinity.py --suite kv --ranks 4
       --policies gateway-cache-aware,gateway-manual --out "$WORK/results")
if [ "${NO_NET:-0}" = 1 ]; then
    log "running the gateway policies inside unshare -rn (loopback only)"
    DP_AFFINITY_SMG="$WORK/smg" unshare -rn sh -c 'ip link set lo up && exec "$@"' sh "${bench[@]}" >/dev/null
else
    log "running the gateway policies"
    DP_AFFINITY_SMG="$WORK/smg" "${bench[@]}" >/dev/null
fi

# The addresses of every connect() in the traces: "AF_INET 127.0.0.1", "AF_UNIX /path", ...
addresses="$(cat "$WORK"/trace.* | grep -o 'connect([0-9]*, {sa_family=[^}]*}' |
    sed -E 's/.*sa_family=(AF_[A-Z0-9]+).*(inet_addr\("([^"]*)"\)|inet_pton\(AF_INET6, "([^"]*)"|sun_path="([^"]*)").*/\1 \3\4\5/' |
    sort | uniq -c)"
traces="$(ls "$WORK"/trace.* | wc -l)"
log "$traces gateway processes traced; connect() calls by address:"
printf '%s\n' "$addresses" >&2
[ -n "$addresses" ] || { log "FAILED: no connect() traced"; exit 1; }
if grep -vE '^ *[0-9]+ (AF_INET 127\.0\.0\.1|AF_INET6 ::1)$' <<<"$addresses" >/dev/null; then
    log "FAILED: the gateway connected to (or tried) an address that is not loopback"
    exit 1
fi
log "passed: every connect() of every gateway went to loopback"
