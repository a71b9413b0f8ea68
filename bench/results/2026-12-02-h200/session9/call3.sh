#!/usr/bin/env bash
# Session 9, device call 3: the runner tests of the fused decode launches on the GPU (call 2's -m gpu filter left them
# out), then issue 12's before/after rows for the two models this session changed, on the final tree: Qwen3-30B-A3B
# (the input add + norm in the q/k/v GEMV) and Gemma-4-E2B (its tuned GEMV files), "before" and "after", B = 1, 16,
# 64 and 256, median of 3, one process per model; last, torch.compile on Gemma-4-31B ("compile" first, so its capture
# includes every compile, then "after"), B = 1 and 16.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
summary() {
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9a-z]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$1.log | sed 's/"buckets": \[[0-9, ]*\], / /; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$1: /"
}
timeout 150 python3 -m pytest -q tests/backends/test_fused_decode_launches.py 2>&1 | grep -v "Warn\|warn" | tail -4 \
  | tee $OUT/gpu_runner_tests.log
date +%T
for m in qwen3-30b-a3b gemma-4-e2b; do
  timeout $((400 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants before,after \
    --batches 1,16,64,256 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-$m.log
  summary $m
  date +%T
done
timeout $((570 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-31b --variants compile,after \
  --batches 1,16 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-gemma-4-31b.log
summary gemma-4-31b
date +%T
