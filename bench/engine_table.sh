#!/usr/bin/env bash
# One device call: engine-only decode of every model on the consolidated tree (issue 40), the default variant,
# B = 1/16/64/256 (31B: 1/16/64), median of 3; one log per model under $OUT.
. bench/kit/device_call.sh
for m in qwen3-30b-a3b gemma-4-26b-a4b gemma-4-e4b gemma-4-e2b gemma-4-31b; do
  [ $SECONDS -lt 540 ] || break
  b=1,16,64,256; [ $m = gemma-4-31b ] && b=1,16,64
  timeout $((585 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after --batches $b --repeats 3 \
    --skip-offline --profile-batches "" --out /tmp/eb-$m > $OUT/engine-decode-$m.log 2>&1
  echo "$m $(grep -o '"batch": [0-9]*\|"overlap_tok_s": [0-9.]*' $OUT/engine-decode-$m.log | paste -sd' ') t=$SECONDS"
done
