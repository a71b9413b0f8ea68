#!/usr/bin/env bash
# Session 7, device call 3: the session's tree against its start (.old = 0b65a4f) in one call: the decode attention's
# GPU tests and the attention alone at the new launch parameters against the old kernel, then Gemma-4-E4B,
# Gemma-4-26B-A4B and Qwen3-30B-A3B bf16 at B = 1 / 16 / 64 on both trees,
# median of 3 each.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
date +%T
PYTHONPATH=/tmp/site:$PWD/src timeout 150 python3 -m pytest -q tests/kernels/test_attention_kernels.py 2>&1 \
  | grep -v "Warn\|warn" | tail -3 | tee $OUT/attention.log
PYTHONPATH=/tmp/site:$PWD/src timeout 90 python3 bench/decode_attention_bench.py --batches 1,64 --contexts 527 \
  --old .old --launches 40 2>&1 | grep -v Warn >> $OUT/attention.log
date +%T
for m in gemma-4-e4b gemma-4-26b-a4b qwen3-30b-a3b; do
  for tree in old new; do
    if [ $m = gemma-4-31b ] && [ $tree = old ]; then continue; fi
    if [ $tree = old ]; then root=$PWD/.old; else root=$PWD; fi
    PYTHONPATH=/tmp/site:$root/src timeout 110 python3 $root/bench/engine_bench.py run --model $m --batches 1,16,64 --repeats 3 \
      --skip-offline --out /tmp/eb-$tree 2>&1 | grep -v Warn > $OUT/eb-$m-$tree.log
    grep -o '"kernels_b1": [0-9]*\|"batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
      $OUT/eb-$m-$tree.log | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m $tree: /"
    date +%T
  done
done
