#!/usr/bin/env bash
# Session 9, device call 2: Qwen3-MoE's input add + norm inside the fused q/k/v GEMV (kernels/norm_add_gemv.py's
# add_norm_gemv). GPU tests of the fused norm GEMVs and the runner tests; then per model one process, median of 3,
# B = 1, 16, 64, bf16 dummy weights: Qwen3-30B-A3B "compile" (first, so its capture includes every Triton and
# Inductor compile), "separate-add-norm-gemv" (the fold off) and "after"; the first tuned GEMV files for Gemma-4-E2B
# (written into the engine's config directory here, and tarred under $OUT to be checked in); then Gemma-4-E2B
# "compile", "cublas-linear" (its projections on cuBLAS, as without the files) and "after"; Gemma-4-26B-A4B
# "compile" and "after" in the time left.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
summary() {
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9a-z]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$1.log | sed 's/"buckets": \[[0-9, ]*\], / /; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$1: /"
}
timeout 120 python3 -m pytest -q tests/kernels/test_add_norm_gemv_kernel.py tests/kernels/test_norm_add_gemv_kernel.py \
  2>&1 | grep -v "Warn\|warn" | tail -4 | tee $OUT/gpu_kernel_tests.log
timeout 150 python3 -m pytest -q tests/backends/test_fused_decode_launches.py -m gpu tests/backends/test_cuda_backend.py \
  -k "fused or add_norm or fp32_greedy" 2>&1 | grep -v "Warn\|warn" | tail -6 | tee $OUT/gpu_runner_tests.log
date +%T
timeout $((330 - SECONDS)) python3 bench/engine_bench.py run --model qwen3-30b-a3b \
  --variants compile,separate-add-norm-gemv,after --batches 1,16,64 --repeats 3 --skip-offline --out /tmp/eb 2>&1 \
  | grep -v Warn > $OUT/eb-qwen3-30b-a3b.log
summary qwen3-30b-a3b
date +%T
touch /tmp/before_sweep
timeout $((400 - SECONDS)) python3 bench/dense_linear.py --sweep --write --models gemma-4-e2b --tokens 1,2 \
  --budget-s 60 > $OUT/dense_linear_sweep.log 2>&1
find src/inference_server/kernels/configs -newer /tmp/before_sweep -type f > /tmp/new_configs.txt
tar -cf $OUT/dense_linear_e2b.tar -T /tmp/new_configs.txt; wc -l < /tmp/new_configs.txt
grep "^| gemma" $OUT/dense_linear_sweep.log | tail -30
date +%T
timeout $((500 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-e2b --variants compile,cublas-linear,after \
  --batches 1,16,64 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-gemma-4-e2b.log
summary gemma-4-e2b
date +%T
if [ $SECONDS -lt 470 ]; then
  timeout $((580 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-26b-a4b --variants compile,after \
    --batches 1,16,64 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-gemma-4-26b-a4b.log
  summary gemma-4-26b-a4b
fi
date +%T
