#!/usr/bin/env bash
# Session 6, device call 3: the RoPE tables in one launch a layer type (kernels/rope_tables.py). The kernel test
# (bitwise equal to the PyTorch tables at the real inverse frequencies, bf16 and fp32, positions to 131072), then
# B=1 before (.old = 10f0dfd) and after for Gemma-4-E4B, 26B-A4B and Qwen3-30B-A3B bf16, median of 3.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
date +%T
PYTHONPATH=/tmp/site:$PWD/src timeout 60 python3 -m pytest -q tests/kernels/test_rope_tables_kernel.py 2>&1 \
  | grep -v "Warn\|warn" | tail -3 | tee $OUT/gpu_kernel_tests.log
for m in gemma-4-e4b gemma-4-26b-a4b qwen3-30b-a3b; do
  for tree in old new; do
    if [ $tree = old ]; then root=$PWD/.old; else root=$PWD; fi
    PYTHONPATH=/tmp/site:$root/src python3 $root/bench/engine_bench.py run --model $m --batches 1 --repeats 3 \
      --skip-offline --out /tmp/eb-$tree 2>&1 | grep -v Warn > $OUT/eb-$m-$tree.log
    grep -o '"kernels_b1": [0-9]*\|"batch": 1, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
      $OUT/eb-$m-$tree.log | sed 's/"batch": 1, .*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m $tree: /"
  done
  date +%T
done
