#!/usr/bin/env bash
# Session 12, device call 3: the final tree (the earlier keys before the attention's wait only where its key loop is
# not pipelined, the MoE down weights before theirs): Qwen3-30B-A3B "after" against "kv-after-wait" at B = 1 and 2
# (the regime that keeps it), and the other models' "after" at B = 1 and 64, to set against calls 1-2's
# "kv-after-wait" (the code those cells now run). Median of 3 each.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for run in qwen3-30b-a3b:after,kv-after-wait,after:1,2 gemma-4-e4b:after:1,64 gemma-4-26b-a4b:after:1,64 \
           gemma-4-e2b:after:1,64 gemma-4-31b:after:1,64; do
  IFS=: read m variants batches <<< "$run"
  [ $SECONDS -lt 330 ] || break
  timeout $((420 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants $variants \
    --batches $batches --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' $OUT/eb-$m.log \
    | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
