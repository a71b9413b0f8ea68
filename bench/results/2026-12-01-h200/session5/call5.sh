#!/usr/bin/env bash
# Session 5, device call 5: issue 13's table on the final code (7eca25a + the profile fix): Gemma-4-31B,
# Qwen3-30B-A3B and Gemma-4-26B-A4B at B = 1 / 16 / 64, int8 against bf16, median of 3, one call.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for m in gemma-4-31b qwen3-30b-a3b gemma-4-26b-a4b; do
  for qz in int8 none; do
    python3 bench/engine_bench.py run --model $m --quantization $qz --batches 1,16,64 --repeats 3 --skip-offline \
      --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-$m-$qz.log
    grep -o '"batch": [0-9]*, "bucket.*"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*\|"limit_tok_s": [0-9.]*' \
      $OUT/eb-$m-$qz.log | sed 's/"context.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m $qz: /"
    date +%T
  done
done
