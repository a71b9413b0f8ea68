#!/usr/bin/env bash
# Session 11, device call 5: call 4's A/B (the greedy head at 1-2 rows: the fused head's tensor-core slices,
# "tensor-core-head", against the head's CUDA-core GEMV + greedy_head_of_logits, "after") for Gemma-4-31B bf16, and
# for int8 heads (QUANTIZATION=int8, INT8_EMBEDDINGS on: before, 1-2 rows took the int8 GEMV and the sampler's chain).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for run in gemma-4-31b:none qwen3-30b-a3b:int8 gemma-4-26b-a4b:int8; do
  m=${run%:*}; q=${run#*:}
  [ $SECONDS -lt 400 ] || break
  extra=""; [ $q = int8 ] && extra="--quantization int8 --int8-embeddings on"
  timeout $((540 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants tensor-core-head,after \
    --batches 1,2 --repeats 3 --skip-offline --profile-batches "" $extra --out /tmp/eb-$m-$q 2>&1 | grep -v Warn > $OUT/eb-$m-$q.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' $OUT/eb-$m-$q.log \
    | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m $q: /"
  date +%T
done
