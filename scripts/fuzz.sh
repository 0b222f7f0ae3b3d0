#!/usr/bin/env bash
# Runs the cargo-fuzz targets in fuzz/ for FUZZ_SECONDS each and prints, per target, the
# executions, coverage and findings reported by libFuzzer.
#
#   scripts/fuzz.sh                       # every target, 60 s each
#   FUZZ_SECONDS=30 scripts/fuzz.sh json_scan config
#   FUZZ_JOBS=2 scripts/fuzz.sh           # libFuzzer -fork=N (parallel workers)
#
# Installs what is missing: a nightly toolchain (`rustup toolchain install nightly --profile
# minimal`; cargo-fuzz needs -Zsanitizer) and `cargo install cargo-fuzz`. The corpus grows in
# fuzz/corpus/<target>/ (seeded from fuzz/seeds/<target>/), crashes land in
# fuzz/artifacts/<target>/; both are git-ignored. Reproduce a crash with
#   cargo +nightly fuzz run <target> fuzz/artifacts/<target>/crash-...
# Exit status: 0 when no target found anything, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
FUZZ_JOBS="${FUZZ_JOBS:-1}"
ALL_TARGETS=(json_scan header_values config table_bucket body_rewrite)
if [ "$#" -gt 0 ]; then
  TARGETS=("$@")
else
  TARGETS=("${ALL_TARGETS[@]}")
fi

if ! rustup toolchain list | grep -q '^nightly'; then
  echo "fuzz.sh: installing the nightly toolchain" >&2
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi

logdir="fuzz/logs"
mkdir -p "$logdir"
summary=()
failed=0

for target in "${TARGETS[@]}"; do
  corpus="fuzz/corpus/$target"
  seeds="fuzz/seeds/$target"
  artifacts="fuzz/artifacts/$target"
  mkdir -p "$corpus" "$artifacts"
  before="$(find "$artifacts" -type f | wc -l)"
  args=(-max_total_time="$FUZZ_SECONDS" -print_final_stats=1)
  [ -f "fuzz/dicts/$target.dict" ] && args+=(-dict="fuzz/dicts/$target.dict")
  [ "$FUZZ_JOBS" -gt 1 ] && args+=(-fork="$FUZZ_JOBS" -ignore_crashes=1)
  dirs=("$corpus")
  [ -d "$seeds" ] && dirs+=("$seeds")
  log="$logdir/$target.log"
  echo "== $target: ${FUZZ_SECONDS}s (log: $log)"
  status=0
  # libFuzzer writes its progress to stderr; keep all of it in the log.
  cargo +nightly fuzz run "$target" "${dirs[@]}" -- "${args[@]}" >"$log" 2>&1 || status=$?

  # Final stats: "#N DONE cov: C ft: F corp: K/S exec/s: E rss: R", or the last progress line
  # when the run stopped early (a crash).
  last="$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)"
  execs="$(sed -nE 's/^#([0-9]+).*/\1/p' <<<"$last")"
  cov="$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")"
  corp="$(sed -nE 's/.* corp: ([0-9]+).*/\1/p' <<<"$last")"
  rate="$(sed -nE 's/.* exec\/s: ([0-9]+).*/\1/p' <<<"$last")"
  after="$(find "$artifacts" -type f | wc -l)"
  findings=$((after - before))
  verdict="ok"
  if [ "$status" -ne 0 ] || [ "$findings" -gt 0 ]; then
    verdict="FOUND (exit $status)"
    failed=1
    grep -E 'panicked at|^==[0-9]+==ERROR|Test unit written to|SUMMARY' "$log" | head -n 8 | sed 's/^/   /' || true
  fi
  line="$(printf '%-14s execs %-10s exec/s %-7s cov %-6s corpus %-6s findings %-3s %s' \
    "$target" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${corp:-?}" "$findings" "$verdict")"
  echo "$line"
  summary+=("$line")
done

echo
echo "fuzz summary (${FUZZ_SECONDS}s per target):"
printf '  %s\n' "${summary[@]}"
exit "$failed"
