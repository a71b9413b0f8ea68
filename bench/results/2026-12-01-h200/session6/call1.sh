#!/usr/bin/env bash
# Session 6, device call 1: the projection + sandwich norm in one launch (kernels/gemv_norm_add.py). GPU tests of
# the kernel at the real shapes and of the runners (fp32 greedy tokens against the reference, PDL on = off, fused
# against unfused launches), then Gemma-4-E4B, 26B-A4B and 31B bf16 at B=1 with the fusion off ("unfused-norm") and
# on ("after"), median of 3, one process per model.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 200 python3 -m pytest -q tests/kernels/test_gemv_norm_add_kernel.py tests/kernels/test_norm_add_kernel.py \
  2>&1 | grep -v "Warn\|warn" | tail -6 | tee $OUT/gpu_kernel_tests.log
date +%T
timeout 330 python3 -m pytest -q -m gpu tests/backends/test_cuda_backend.py tests/backends/test_pdl_runner.py \
  2>&1 | grep -v "Warn\|warn" | tail -6 | tee $OUT/gpu_runner_tests.log
timeout 200 python3 -m pytest -q tests/backends/test_fused_decode_launches.py -k "gemv_norm_add or gated_gemv" \
  2>&1 | grep -v "Warn\|warn" | tail -4 | tee -a $OUT/gpu_runner_tests.log
date +%T
for m in gemma-4-e4b gemma-4-26b-a4b gemma-4-31b; do
  python3 bench/engine_bench.py run --model $m --variants unfused-norm,after --batches 1 --repeats 3 --skip-offline \
    --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": 1, .*"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*' \
    $OUT/eb-$m.log | sed 's/"buckets.*"kernels_b1"/ "kernels_b1"/; s/"batch": 1, .*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
