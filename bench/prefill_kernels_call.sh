#!/usr/bin/env bash
# Issue 42's prefill kernels in one device call (<= 10 minutes), Gemma-4-26B-A4B dummy weights:
#   1. engine_bench: one prompt of 30,000 and 131,072 tokens in prefill steps of 2,048 and 8,192 tokens (wall, median
#      of 3, and device time per kernel): does the 131k HTTP regression (10,929 ms at 8,192-token steps against
#      8,567 at 2,048) come from the kernels, and which;
#   2. tune_attention prefill at 8,192 queries ending at 8,192 and at 32,768 keys (a prefill-only step), the D=512
#      candidates with 16-token query tiles included;
#   3. tune_attention decode for E4B and E2B at batches 16-256 (issue 41's decode attention).
# Run from the project root on the device machine with `.whl` carried. Back under $OUT: *.log and engine_bench.jsonl.
. bench/kit/device_call.sh
timeout 230 python3 bench/engine_bench.py run --model gemma-4-26b-a4b --skip-decode --skip-offline \
  --prefill 30000,131072 --prefill-chunk 2048,8192 --out $OUT > $OUT/engine-prefill.log 2>&1
echo "== engine_bench (t=${SECONDS} s)"; python3 - "$OUT/engine_bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "prefill":
        top = ", ".join(f"{t['name'][:40]} {t['ms']}" for t in r.get("top", [])[:6])
        print(r["prompt_len"], r["chunk"], r["wall_ms"], "ms", r["floor_fraction"], "kernels", r.get("kernel_ms"), "|", top)
PY
for ctx in 8192 32768; do
  timeout $((450 - SECONDS)) python3 bench/tune_attention.py prefill --context $ctx --chunk 8192 \
    > $OUT/tune-prefill-$ctx.log 2>&1
  echo "== tune prefill $ctx (t=${SECONDS} s)"; grep -A6 "D=512\|D=256" $OUT/tune-prefill-$ctx.log | head -40
done
timeout $((585 - SECONDS)) python3 bench/tune_attention.py decode --models gemma-4-e4b,gemma-4-e2b \
  --contexts 2048,8192 --batches 16,64,256 --time-limit $((520 - SECONDS)) > $OUT/tune-decode.log 2>&1
echo "== tune decode (t=${SECONDS} s)"; tail -30 $OUT/tune-decode.log
