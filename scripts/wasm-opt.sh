#!/usr/bin/env bash
# Shrinks the release .wasm in place with Binaryen's wasm-opt (-Oz, to convergence), after `cargo build`.
#
#   scripts/wasm-opt.sh <path/to/dp_affinity.wasm>
#
# rustc's output is ~15 % larger than what wasm-opt makes of it, and V8 (Envoy's runtime)
# compiles both to the same speed (BENCHMARKS.md, "wasm size"). wasm-opt is Binaryen's npm build
# (pinned in scripts/install-tools.sh, run by node), which takes ~20 s, so the result is cached:
# target/wasm-opt/ keeps the last input's sha256 and its optimised output. The artifact is
# replaced by a copy, never rewritten through its inode: cargo hard-links it to deps/, and a
# fresh `cargo build` links the unoptimised file back, which this script then recognises by its
# hash and replaces from the cache in a moment.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
BINARYEN_DIR="${BINARYEN_DIR:-$ROOT/.tools/binaryen}"
WASM_OPT="$BINARYEN_DIR/node_modules/.bin/wasm-opt"
# The features rustc's wasm32-wasip1 output uses; wasm-opt refuses a module that uses others, and
# never emits instructions of a feature that is not enabled here.
FEATURES=(--enable-bulk-memory --enable-sign-ext --enable-nontrapping-float-to-int --enable-mutable-globals)

log() { printf '[wasm-opt] %s\n' "$*"; }

artifact="${1:?usage: scripts/wasm-opt.sh <path/to/module.wasm>}"
[ -f "$artifact" ] || { log "no $artifact (build it first)" >&2; exit 1; }
[ -x "$WASM_OPT" ] || { log "no $WASM_OPT: run scripts/install-tools.sh" >&2; exit 1; }

cache="$(dirname "$(dirname "$(dirname "$artifact")")")/wasm-opt"
mkdir -p "$cache"
name="$(basename "$artifact")"
have="$(sha256sum "$artifact" | cut -d' ' -f1)"

if [ -f "$cache/$name" ] && [ "$have" = "$(sha256sum "$cache/$name" | cut -d' ' -f1)" ]; then
    exit 0 # already the optimised module
fi
if [ ! -f "$cache/$name" ] || [ "$have" != "$(cat "$cache/$name.input.sha256" 2>/dev/null)" ]; then
    before="$(stat -c %s "$artifact")"
    # --converge repeats -Oz until a round shrinks nothing more: ~770 B (0.25 %) below one round.
    "$WASM_OPT" -Oz --converge "${FEATURES[@]}" "$artifact" -o "$cache/$name.tmp"
    mv "$cache/$name.tmp" "$cache/$name"
    printf '%s\n' "$have" > "$cache/$name.input.sha256"
    log "$name: $before -> $(stat -c %s "$cache/$name") bytes"
fi
cp --remove-destination "$cache/$name" "$artifact"
