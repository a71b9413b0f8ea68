#!/usr/bin/env bash
# Session 9, device call 5: the final tree's int8 choice (the input add + norm fold for float weights only):
# Qwen3-30B-A3B int8 "after" at B = 1 and 2, median of 3 (call 4's "separate" figures are the code it should run),
# then the backend test of that choice on the GPU.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 100 python3 bench/engine_bench.py run --model qwen3-30b-a3b --quantization int8 --variants after \
  --batches 1,2 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-qwen3-30b-a3b-int8.log
grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9a-z]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
  $OUT/eb-qwen3-30b-a3b-int8.log | sed 's/"buckets": \[[0-9, ]*\], / /; s/, "bucket.*"replay_ms"/ "replay_ms"/'
date +%T
timeout $((170 - SECONDS)) python3 -m pytest -q tests/backends/test_fused_decode_launches.py -k "add_norm" 2>&1 \
  | grep -v "Warn\|warn" | tail -3
date +%T
