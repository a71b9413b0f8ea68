#!/usr/bin/env bash
# Session 12, device call 2: call 1's A/B (the decode attention's earlier keys before its PDL wait: "after", against
# "kv-after-wait") on Gemma-4-E4B, Gemma-4-31B and Gemma-4-E2B at B = 1 and 64, median of 3 each, in the order
# after, kv-after-wait, after.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for m in gemma-4-e4b gemma-4-31b gemma-4-e2b; do
  [ $SECONDS -lt 480 ] || break
  timeout $((590 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after,kv-after-wait,after \
    --batches 1,64 --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' $OUT/eb-$m.log \
    | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
