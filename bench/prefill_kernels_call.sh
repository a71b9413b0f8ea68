#!/usr/bin/env bash
# Issue 42's 131k question at kernel level in one device call (~4 minutes), dummy weights: engine_bench,
# Gemma-4-26B-A4B, one prompt of 131,072 tokens in prefill steps of 2,048 and 8,192 tokens (wall, median of 3, and
# device time per kernel): is 10,929 ms over HTTP at 8,192-token steps a regression against 8,567 at 2,048 (the
# full layers' attention alone should take ~9.6 s at 147 TFLOP/s either way), and which kernel moves. The HTTP rows
# at long context (E4B, Qwen3, the same 131k both ways) are bench/prefill_table.sh's.
# Run from the project root on the device machine with `.whl` carried. Back under $OUT: engine-prefill.log and
# engine_bench.jsonl.
. bench/kit/device_call.sh
timeout 240 python3 bench/engine_bench.py run --model gemma-4-26b-a4b --batches 1 --steps 4 --profile-batches "" \
  --skip-offline --prefill 131072 --prefill-chunk 2048,8192 --out $OUT > $OUT/engine-prefill.log 2>&1
echo "== engine_bench (t=${SECONDS} s)"; python3 - "$OUT/engine_bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "prefill":
        top = "; ".join(f"{t['name'][:50]} {t['ms']} ({t['launches']})" for t in r.get("top", [])[:8])
        print(r["prompt_len"], r["chunk"], r["wall_ms"], "ms", r["floor_fraction"], "kernels", r.get("kernel_ms"), "|", top)
PY
