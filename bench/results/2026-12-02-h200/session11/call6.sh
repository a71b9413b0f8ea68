#!/usr/bin/env bash
# Session 11, device call 6: call 5's serial steps (host and device in series) ran slower with the GEMV head on
# Gemma-4-31B bf16 (63.6 -> 60.6 tok/s) and 26B-A4B int8 (397 -> 359) while the overlapped ones ran level or faster.
# The same A/B in the reverse order (the GEMV head first), B=1, to tell the head from the order of the variants.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for run in gemma-4-31b:none gemma-4-26b-a4b:int8; do
  m=${run%:*}; q=${run#*:}
  extra=""; [ $q = int8 ] && extra="--quantization int8 --int8-embeddings on"
  timeout $((300 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after,tensor-core-head,after \
    --batches 1 --repeats 3 --skip-offline --profile-batches "" $extra --out /tmp/eb-$m-$q 2>&1 | grep -v Warn > $OUT/eb-$m-$q.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"tok_s_runs": \[[^]]*\]\|"overlap_tok_s_runs": \[[^]]*\]' $OUT/eb-$m-$q.log \
    | sed 's/, "bucket.*"tok_s_runs"/ "serial"/' | paste -sd' ' | sed "s/^/$m $q: /"
  date +%T
done
