#!/usr/bin/env bash
# Issue 43 in one device call: the whole GPU suite (the deterministic sampler's one-launch row log-sum-exp is a GPU
# change), then the deterministic decode step's kernel profile against the default (Gemma-4-26B-A4B, batch 1 and
# 64), then DETERMINISTIC's attention tiles and KV split sizes (`tune_attention.py invariant`: prefill and decode
# time, decode bits against the aligned prefill) in what is left of the call. Run from the project root with `.whl`
# carried. Back under $OUT: gpu_suite.log, det-profile.log and .jsonl, invariant-tiles.log.
. bench/kit/device_call.sh
GPU_SUITE_SECONDS=420 bash bench/gpu_suite.sh | tail -4
timeout $((585 - SECONDS > 60 ? 60 : 585 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-26b-a4b \
  --variants after,deterministic --batches 1,64 --profile-batches 64 --repeats 3 --skip-offline \
  --out /tmp/det-profile > $OUT/det-profile.log 2>&1
cp /tmp/det-profile/engine_bench.jsonl $OUT/det-profile.jsonl 2>/dev/null
grep '"kind": "decode"' $OUT/det-profile.jsonl | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print('decode', r.get('variant'), r.get('batch'), r.get('tok_s'), r.get('step_ms'))"
left=$((570 - SECONDS))
[ $left -gt 40 ] && timeout $((left + 10)) python3 bench/tune_attention.py invariant --time-limit $((left - 25)) \
  > $OUT/invariant-tiles.log 2>&1
grep -v "^$" $OUT/invariant-tiles.log | tail -40
echo "call wall: ${SECONDS} s"
