#!/usr/bin/env bash
# Session 7, device call 4: Gemma-4-E4B ran 0.5 % slower at B=1 with the batch-1-2 attention parameters (call3),
# though the attention alone ran faster. B=1 of E4B and 26B-A4B with the batch-1-2 rule for every head dim (the tree)
# and for D <= 128 only (.old: the tree with that one change), median of 3, one call.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
for m in gemma-4-e4b gemma-4-26b-a4b; do
  for tree in old new old new; do
    if [ $tree = old ]; then root=$PWD/.old; else root=$PWD; fi
    PYTHONPATH=/tmp/site:$root/src timeout 60 python3 $root/bench/engine_bench.py run --model $m --batches 1 \
      --repeats 3 --skip-offline --out /tmp/eb-$tree 2>&1 | grep -v Warn >> $OUT/eb-$m-$tree.log
    grep -o '"batch": 1, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' $OUT/eb-$m-$tree.log | tail -2 \
      | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m $tree: /"
  done
done
