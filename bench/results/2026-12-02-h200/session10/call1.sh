#!/usr/bin/env bash
# Session 10, device call 1: the routed experts in one launch (kernels/moe_decode_one_launch.py).
# 1. its GPU tests and moe_decode's (its down epilogue is now a shared helper); 2. bench/moe_decode.py at 1, 2, 4
# tokens (two launches vs one, float experts); 3. Qwen3-30B-A3B engine_bench after vs two-launch-experts at 1, 2.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 150 python3 -m pytest -q -x tests/kernels/test_moe_decode_one_launch.py tests/kernels/test_moe_decode_kernel.py \
  -k "gpu" 2>&1 | grep -v "Warn\|warn" | tail -5
date +%T
timeout $((330 - SECONDS)) python3 bench/moe_decode.py --tokens 1,2,4 --reps 10 > $OUT/moe_decode.md 2> $OUT/moe_decode.err
cat $OUT/moe_decode.md; grep "one launch" $OUT/moe_decode.err | head -40
date +%T
timeout $((560 - SECONDS)) python3 bench/engine_bench.py run --model qwen3-30b-a3b --variants after,two-launch-experts \
  --batches 1,2 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-qwen.log
grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9a-z]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
  $OUT/eb-qwen.log | sed 's/"buckets": \[[0-9, ]*\], / /; s/, "bucket.*"replay_ms"/ "replay_ms"/'
tail -3 $OUT/eb-qwen.log
date +%T
