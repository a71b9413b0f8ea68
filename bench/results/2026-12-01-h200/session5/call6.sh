#!/usr/bin/env bash
# Session 5, device call 6: the runner-level GPU tests after the decode-attention change (fp32 greedy tokens equal to
# the reference runner for 64 steps, bf16 yardstick, graphs against eager, PDL on = off bitwise on every model kind,
# overlap), then Gemma-4-E4B bf16 at B = 1 / 64 (issue 12's remaining row), median of 3.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 330 python3 -m pytest -q -m gpu tests/backends/test_cuda_backend.py tests/backends/test_pdl_runner.py \
  tests/backends/test_overlap_gpu.py 2>&1 | grep -v "Warn\|warn" | tail -8 | tee $OUT/gpu_runner_tests.log
date +%T
python3 bench/engine_bench.py run --model gemma-4-e4b --batches 1,64 --repeats 3 --skip-offline --out /tmp/eb 2>&1 \
  | grep -v Warn > $OUT/eb-gemma-4-e4b-none.log
grep -o '"batch": [0-9]*, "bucket.*"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*\|"limit_tok_s": [0-9.]*' \
  $OUT/eb-gemma-4-e4b-none.log | sed 's/"context.*"replay_ms"/ "replay_ms"/' | paste -sd' '
date +%T
