#!/usr/bin/env bash
# Session 14, device call 1: the loop kernels' PDL release place per class (kernels/pdl.py PDL_LOOP_CLASSES). The
# GPU test of a per-class release (the attention after its wait, the rest after their loop: bitwise the runner
# without PDL, every model kind), then at B = 1 (median of 3): on the models whose default releases no class early
# (hidden > 2,048: Gemma-4-26B-A4B, E4B, 31B) the default against one class early; on Qwen3-30B-A3B (every class
# early by default) the default against every class early but one.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 120 python3 -m pytest -q tests/backends/test_pdl_runner.py -k attention-after-wait 2>&1 | grep -v "Warn\|warn" \
  | tail -3 | tee $OUT/gpu_tests.log
date +%T
run() {  # model, variants
  [ $SECONDS -lt 500 ] || return
  timeout $((570 - SECONDS)) python3 bench/engine_bench.py run --model $1 --variants $2 --batches 1 --repeats 3 \
    --skip-offline --profile-batches "" --out /tmp/eb-$1 2>&1 | grep -v Warn > $OUT/eb-$1.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$1.log | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$1: /"
  date +%T
}
run gemma-4-26b-a4b after,release-early-attention,release-early-gemv,release-early-moe,release-early-router,after
run gemma-4-e4b after,release-early-attention,release-early-gemv,release-early-head,after
run gemma-4-31b after,release-early-attention,release-early-gemv,after
run qwen3-30b-a3b after,release-late-attention,release-late-gemv,release-late-moe,release-late-router
