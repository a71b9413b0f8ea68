#!/usr/bin/env bash
# Session 8, device call 2: a KV-shared layer's q norm and RoPE inside the decode attention launch
# (decode_attention.QueryNormRope). GPU tests of the attention kernels (the raw-q variant against qk_norm_rope then
# attention) and of the fused norm add GEMV, the runner tests (fp32 greedy tokens against the reference, PDL on = off,
# fused against separate), then Gemma-4-E4B and E2B bf16 at B=1, 16 and 64 with the fold off ("separate-q-rope") and
# on ("after"), median of 3, one process per model.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 200 python3 -m pytest -q tests/kernels/test_attention_kernels.py tests/kernels/test_norm_add_gemv_kernel.py \
  tests/kernels/test_qk_norm_rope_kernel.py 2>&1 | grep -v "Warn\|warn" | tail -8 | tee $OUT/gpu_kernel_tests.log
date +%T
timeout 300 python3 -m pytest -q -m gpu tests/backends/test_cuda_backend.py tests/backends/test_pdl_runner.py \
  2>&1 | grep -v "Warn\|warn" | tail -8 | tee $OUT/gpu_runner_tests.log
timeout 200 python3 -m pytest -q tests/backends/test_fused_decode_launches.py 2>&1 | grep -v "Warn\|warn" | tail -6 \
  | tee -a $OUT/gpu_runner_tests.log
date +%T
for m in gemma-4-e4b gemma-4-e2b; do
  python3 bench/engine_bench.py run --model $m --variants separate-q-rope,after \
    --batches 1,16,64 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$m.log | sed 's/"buckets.*"kernels_b1"/ "kernels_b1"/; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
