#!/usr/bin/env bash
# Issue 43's cost of DETERMINISTIC=true in one device call (<= 10 minutes): output tok/s over HTTP, the default
# server against a DETERMINISTIC=true one, at c=1 and c=64, median of 3, for Gemma-4-26B-A4B then Qwen3-30B-A3B
# (dummy weights, bf16). Run from the project root on the device machine with `.whl` carried
# (bash bench/device_wheels.sh); one serving_table.py call per model, each starting two servers. Back under $OUT (six
# files: the device returns at most eight): det-cost-<model>.log (console), .md (table) and .json (rows); the
# per-run reports and server logs stay in /tmp/det-cost-<model>/ on the device.
#
# Cut to fit (the branch's lines were 512 in / 256 out, 4 and 128 prompts): 256 in / 128 out, 4 prompts at c=1 and
# 64 at c=64, MAX_MODEL_LEN=1024 (11 eager warm-up sizes instead of 12), MAX_BATCH_SIZE=64 (decode graphs up to 64).
# Per server: a start (~30-90 s, not measured for the deterministic tables: Triton compiles their kernels there),
# c=1: 1 warm-up + 3 x 4 requests x 128 tokens (~4 s at the default's ~350 tok/s; ~15 s if deterministic is 3-4x
# slower at batch 1), c=64: 64 warm-ups x 16 tokens + 3 x 64 requests (~3 s each at ~3,000 tok/s). So ~2 x 60 + 40 s
# per model, ~320 s for both; serving_table's --budget-s skips what would start after 560 s in all (the table says
# which), so the call ends with tables rather than a kill.
. bench/kit/device_call.sh
for m in gemma-4-26b-a4b qwen3-30b-a3b; do
  left=$((560 - SECONDS)); [ $m = gemma-4-26b-a4b ] && left=280
  [ $left -gt 60 ] || { echo "$m skipped: ${left} s left"; continue; }
  timeout $((590 - SECONDS)) python3 bench/serving_table.py --model $m --concurrency 1,64 --num-prompts 4,64 \
    --repeats 3 --input-len 256 --output-len 128 --env MAX_MODEL_LEN=1024 --env MAX_BATCH_SIZE=64 \
    --variant DETERMINISTIC=true --budget-s $left --out /tmp/det-cost-$m > $OUT/det-cost-$m.log 2>&1
  cp /tmp/det-cost-$m/table.md $OUT/det-cost-$m.md 2>/dev/null; cp /tmp/det-cost-$m/rows.json $OUT/det-cost-$m.json 2>/dev/null
  echo "== $m (t=${SECONDS} s)"; grep "ready in\|skipped" $OUT/det-cost-$m.log; cat $OUT/det-cost-$m.md 2>/dev/null \
    || tail -20 $OUT/det-cost-$m.log
done
