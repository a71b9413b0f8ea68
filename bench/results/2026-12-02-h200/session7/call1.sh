#!/usr/bin/env bash
# Session 7, device call 1: Gemma 4's dense MLP beside its routed experts (kernels/mlp_beside_experts.py). GPU tests
# of the paired kernels at Gemma-4-26B-A4B's real shapes and of the refactored standalone kernels, the runner tests
# (fp32 greedy tokens against the reference, PDL on = off, paired against separate launches), then Gemma-4-26B-A4B
# bf16 at B=1 and 2 and int8 at B=1 with the pairing off ("separate-ffn") and on ("after"), median of 3, one process.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 240 python3 -m pytest -q tests/kernels/test_mlp_beside_experts_kernel.py tests/kernels/test_moe_decode_kernel.py \
  tests/kernels/test_linear_route_kernel.py tests/kernels/test_gated_gemv_kernel.py 2>&1 | grep -v "Warn\|warn" \
  | tail -8 | tee $OUT/gpu_kernel_tests.log
date +%T
timeout 300 python3 -m pytest -q -m gpu tests/backends/test_cuda_backend.py tests/backends/test_pdl_runner.py \
  2>&1 | grep -v "Warn\|warn" | tail -8 | tee $OUT/gpu_runner_tests.log
timeout 200 python3 -m pytest -q tests/backends/test_fused_decode_launches.py -k "mlp_beside or gated_gemv" \
  2>&1 | grep -v "Warn\|warn" | tail -6 | tee -a $OUT/gpu_runner_tests.log
date +%T
for q in none int8; do
  if [ $q = none ]; then batches=1,2; else batches=1; fi
  python3 bench/engine_bench.py run --model gemma-4-26b-a4b --quantization $q --variants separate-ffn,after \
    --batches $batches --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-26b-$q.log
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": [12], .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-26b-$q.log | sed 's/"buckets.*"kernels_b1"/ "kernels_b1"/; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/26b $q: /"
  date +%T
done
