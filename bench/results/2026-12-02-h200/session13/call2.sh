#!/usr/bin/env bash
# Session 13, device call 2: the default (pdl_early_release=None: after the wait for hidden <= 2048) against the
# release after the loop at B=1, on Qwen3-30B-A3B and Gemma-4-E2B (the default's "on" models) and Gemma-4-26B-A4B
# (its "off"), median of 3; then the order reversed on Qwen.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
run() {  # model, variants
  timeout $((540 - SECONDS)) python3 bench/engine_bench.py run --model $1 --variants $2 \
    --batches 1 --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$1-$3 2>&1 | grep -v Warn > $OUT/eb-$1-$3.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$1-$3.log | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$1 $3: /"
  date +%T
}
run qwen3-30b-a3b after,release-after-loop a
run gemma-4-e2b after,release-after-loop a
run gemma-4-26b-a4b after,release-after-wait a
[ $SECONDS -lt 420 ] && run qwen3-30b-a3b release-after-loop,after b
