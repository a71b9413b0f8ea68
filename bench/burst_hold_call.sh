#!/usr/bin/env bash
# The HOLD_BURSTS experiment in one device call (< 10 minutes), Gemma-4-26B-A4B, dummy weights, median of 3:
#   1. the burst (prefill_table.sh part 2's settings: 100 prompts of 512 tokens at once, 128 out, MAX_MODEL_LEN=4096)
#      on three servers: HOLD_BURSTS=true (steps keep MAX_PREFILL_TOKENS until every request waiting when the burst
#      began has its first token), HOLD_BURSTS=false (steps drop to MAX_NUM_BATCHED_TOKENS once the decodes outnumber
#      the prompts left), and HOLD_BURSTS=true with MAX_PREFILL_TOKENS=16384. The question: p99 TTFT (H100 before the
#      hold: 546 / 1,158 ms, goal 0.8 s; a step model gave 1,018 -> 866 ms, 813 at 16k) against the streams' ITL p99
#      (step model 52 -> 137 ms, 55 at 16k);
#   2. the chunk policy's case (docs/benchmarks.md: 64 streams of 512 in / 256 out while 8,192-token prompts arrive at
#      1/s, MAX_MODEL_LEN=16384), HOLD_BURSTS=true against false: one prompt beside 64 decodes is no burst, so ITL p99
#      under the arrivals should not move; the plain runs' start (64 prompts at once) is a burst and may. It runs only
#      when >= 200 s are left after part 1 (~100 s a burst server, estimated from prefill_kernels_call.sh's two in
#      200 s): else run it alone, `bash bench/burst_hold_call.sh chunks` (`burst`: part 1 alone).
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh). Back under $OUT:
# <name>.log (console) and <name>.md (table) per part, summary.md (TTFT median / p99 and ITL p99 per server); reports
# and server logs stay in /tmp/<name>/ there.
. bench/kit/device_call.sh
part=${1:-all}
case $part in all | burst | chunks) ;; *) echo "usage: bash bench/burst_hold_call.sh [all|burst|chunks]"; exit 2 ;; esac
rows=()  # the parts run in this call (a warm machine may hold an earlier call's /tmp/<name>)
if [ "$part" != chunks ]; then
  rm -rf /tmp/burst-hold; rows+=(/tmp/burst-hold/rows.json)
  serving_table_run burst-hold 330 --model gemma-4-26b-a4b --concurrency 100 --num-prompts 100 --input-len 512 \
    --output-len 128 --env MAX_MODEL_LEN=4096 --env HOLD_BURSTS=true --variant HOLD_BURSTS=false \
    --variant HOLD_BURSTS=true,MAX_PREFILL_TOKENS=16384
fi
if [ "$part" != burst ]; then
  if [ $((540 - SECONDS)) -ge 200 ]; then
    rm -rf /tmp/chunks-hold; rows+=(/tmp/chunks-hold/rows.json)
    serving_table_run chunks-hold 540 --model gemma-4-26b-a4b --concurrency 64 --num-prompts 64 --input-len 512 \
      --output-len 256 --arrivals 8192@1 --env MAX_MODEL_LEN=16384 --env HOLD_BURSTS=true --variant HOLD_BURSTS=false
  else
    echo "== chunks-hold skipped: $((540 - SECONDS)) s left (< 200); run bash bench/burst_hold_call.sh chunks"
  fi
fi
# One short table of what the experiment decides on, from serving_table's rows (the default row is HOLD_BURSTS=true:
# --env sets it on every server, a variant overrides it).
python3 - "${rows[@]}" > $OUT/summary.md <<'PY'
import json, sys
from pathlib import Path
def ms(value):
    return "n/a" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"
print("| part | server | TTFT median / p99 ms | ITL median / p99 ms | output tok/s | runs |")
print("|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    if not Path(path).is_file():
        print(f"| {Path(path).parent.name} | (no rows) | | | | |")
        continue
    for r in json.loads(Path(path).read_text()):
        server = "HOLD_BURSTS=true" + r["variant"][len("default"):] if r["variant"].startswith("default") \
            else r["variant"]
        print(f"| {Path(path).parent.name} | {server} | {ms(r['ttft_median_ms'])} / {ms(r['ttft_p99_ms'])} "
              f"| {ms(r['itl_median_ms'])} / {ms(r['itl_p99_ms'])} | {ms(r['output_tok_s'])} "
              f"| {r['runs']}{' (%d failed)' % r['failed'] if r['failed'] else ''} |")
PY
echo "== summary (t=${SECONDS} s)"; cat $OUT/summary.md
