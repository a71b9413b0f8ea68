#!/usr/bin/env bash
# Session 10, device call 5: the final tree. The one-launch experts' GPU tests at their default config (64 down rows
# streamed), then Qwen3-30B-A3B engine_bench: after (two launches, the default) vs one-launch-experts at B = 1, 2.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 100 python3 -m pytest -q -x tests/kernels/test_moe_decode_one_launch.py tests/kernels/test_moe_decode_kernel.py \
  -k "gpu" 2>&1 | grep -v "Warn\|warn" | tail -2
date +%T
timeout $((400 - SECONDS)) python3 bench/engine_bench.py run --model qwen3-30b-a3b --variants after,one-launch-experts \
  --batches 1,2 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-qwen.log
grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9a-z]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
  $OUT/eb-qwen.log | sed 's/"buckets": \[[0-9, ]*\], / /; s/, "bucket.*"replay_ms"/ "replay_ms"/'
grep '"kind": "kernels"' $OUT/eb-qwen.log | cut -c1-700
date +%T
