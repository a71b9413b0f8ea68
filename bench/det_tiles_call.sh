#!/usr/bin/env bash
# Issue 43: DETERMINISTIC's own attention tiles (prefill_attention._aligned_config, the split decode on DECODE_BLOCK_M
# query rows) in one device call: engine-only decode tok/s, default against deterministic, at batch 1 and 64 on
# Gemma-4-26B-A4B and Qwen3-30B-A3B (engine_bench.py, dummy weights, median of 3), then the whole GPU suite (the
# decode-equals-prefill bits tests among it). Run from the project root with `.whl` carried. Back under $OUT:
# det-<model>.log and .jsonl, gpu_suite.log.
. bench/kit/device_call.sh
for m in gemma-4-26b-a4b qwen3-30b-a3b; do
  timeout 70 python3 bench/engine_bench.py run --model $m --variants after,deterministic --batches 1,64 \
    --profile-batches "" --repeats 3 --skip-offline --out /tmp/det-$m > $OUT/det-$m.log 2>&1
  cp /tmp/det-$m/engine_bench.jsonl $OUT/det-$m.jsonl 2>/dev/null
  grep -h '"kind": "decode"' $OUT/det-$m.jsonl | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print('$m', r.get('variant'), r.get('batch'), r.get('tok_s'), r.get('step_ms'))"
done
GPU_SUITE_SECONDS=$((575 - SECONDS)) bash bench/gpu_suite.sh | tail -5
echo "call wall: ${SECONDS} s"
