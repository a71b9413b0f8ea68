#!/usr/bin/env bash
# Session 6, device call 4: the final tree (one-launch RoPE tables) at B = 1 / 16 / 64, median of 3, for Gemma-4-E4B,
# 26B-A4B and Qwen3-30B-A3B bf16 (the rest of the device budget: each model's log is written as soon as it is done).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for m in gemma-4-e4b gemma-4-26b-a4b qwen3-30b-a3b; do
  python3 bench/engine_bench.py run --model $m --batches 1,16,64 --repeats 3 --skip-offline --out /tmp/eb 2>&1 \
    | grep -v Warn > $OUT/eb-$m.log
  grep -o '"batch": [0-9]*, "bucket.*"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*\|"overlap_fraction": [0-9.]*' \
    $OUT/eb-$m.log | sed 's/"bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
