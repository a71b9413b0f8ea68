#!/usr/bin/env bash
# Session 11, device call 4: the greedy head at 1-2 rows through the head's CUDA-core GEMV + greedy_head_of_logits
# (call 3: the fused head's tensor-core slices took 163 µs of Qwen3-30B-A3B's B=1 step and 368 of E4B's, where the
# tuned logits GEMVs ran 139 and 297 alone). GPU tests, then engine_bench "tensor-core-head" (the fused head, as
# before) against "after" (the GEMV) at B = 1 and 2, median of 3, per model.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 120 python3 -m pytest -q tests/kernels/test_greedy_head_of_logits.py tests/kernels/test_greedy_head_kernel.py \
  -m gpu 2>&1 | grep -v "Warn\|warn" | tail -4 | tee $OUT/gpu_tests.log
date +%T
for m in gemma-4-e4b qwen3-30b-a3b gemma-4-26b-a4b gemma-4-e2b; do
  [ $SECONDS -lt 470 ] || break
  timeout $((560 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants tensor-core-head,after \
    --batches 1,2 --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' $OUT/eb-$m.log \
    | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
