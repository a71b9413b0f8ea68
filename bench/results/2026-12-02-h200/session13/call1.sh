#!/usr/bin/env bash
# Session 13, device call 1: where the loop kernels (GEMVs, decode attention, MoE GEMVs / grouped GEMMs, router GEMV,
# greedy head slices) release their PDL dependent: after their main loop (the default so far, "release-after-loop")
# or right after their wait ("release-after-wait", CudaRunnerOptions.pdl_early_release). GPU tests first (the runner
# bitwise with PDL on and off, both release places), then the A/B at B = 1 and 64 per model, median of 3 each, in
# the order after-wait, after-loop.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 200 python3 -m pytest -q tests/backends/test_pdl_runner.py 2>&1 | grep -v "Warn\|warn" | tail -3 \
  | tee $OUT/gpu_tests.log
date +%T
for m in qwen3-30b-a3b gemma-4-26b-a4b gemma-4-e4b gemma-4-31b gemma-4-e2b; do
  [ $SECONDS -lt 470 ] || break
  timeout $((560 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants release-after-wait,release-after-loop \
    --batches 1,64 --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$m.log | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
