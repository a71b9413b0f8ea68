#!/usr/bin/env bash
# Session 6, device call 2: loads before the PDL wait of data written before the predecessor (kernels/pdl.py's second
# rule): the MoE decode down GEMV's expert ids and first weight tile, the decode attention's context length and
# first block-table entries. GPU tests (PDL on = off bitwise on every model kind, fp32 greedy tokens against the
# reference runner, the attention and MoE decode kernels at real shapes), then B=1 before (.old = efe7c9c) and after
# for Qwen3-30B-A3B, Gemma-4-26B-A4B, E4B and 31B bf16, median of 3, one process per tree and model.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
date +%T
PYTHONPATH=/tmp/site:$PWD/src timeout 240 python3 -m pytest -q -m gpu tests/backends/test_pdl_runner.py \
  tests/backends/test_cuda_backend.py 2>&1 | grep -v "Warn\|warn" | tail -4 | tee $OUT/gpu_runner_tests.log
PYTHONPATH=/tmp/site:$PWD/src timeout 150 python3 -m pytest -q tests/kernels/test_attention_kernels.py \
  tests/kernels/test_moe_decode_kernel.py 2>&1 | grep -v "Warn\|warn" | tail -4 | tee $OUT/gpu_kernel_tests.log
date +%T
for m in qwen3-30b-a3b gemma-4-26b-a4b gemma-4-e4b gemma-4-31b; do
  for tree in old new; do
    if [ $tree = old ]; then root=$PWD/.old; else root=$PWD; fi
    PYTHONPATH=/tmp/site:$root/src python3 $root/bench/engine_bench.py run --model $m --batches 1 --repeats 3 \
      --skip-offline --out /tmp/eb-$tree 2>&1 | grep -v Warn > $OUT/eb-$m-$tree.log
    grep -o '"batch": 1, .*"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*' $OUT/eb-$m-$tree.log \
      | sed 's/"batch": 1, .*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m $tree: /"
  done
  date +%T
done
