#!/usr/bin/env bash
# Issue 42's long prompts in one device call (<= 10 minutes), dummy weights:
#   1. engine_bench, Gemma-4-26B-A4B: one prompt of 131,072 tokens in prefill steps of 2,048 and 8,192 tokens (wall,
#      median of 3, and device time per kernel): does the 131k HTTP regression (10,929 ms at 8,192-token steps
#      against 8,567 at 2,048) come from the kernels, and which;
#   2. over HTTP (serving_table, median of 3): Gemma-4-E4B alone at 32,768 and 131,008 tokens, then Qwen3-30B-A3B at
#      8,192 / 30,000 / 40,896 (its limit is 40,960).
# Run from the project root on the device machine with `.whl` carried. Back under $OUT: *.log, *.md, engine_bench.jsonl.
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
long=(--concurrency 1 --num-prompts 1 --output-len 64 --warmup 1 --warmup-input-len 512 --warmup-output-len 4)
serving_table_run long-e4b 420 --model gemma-4-e4b "${long[@]}" --input-len 32768,131008
serving_table_run prefill-qwen3 585 --model qwen3-30b-a3b "${long[@]}" --input-len 8192,30000,40896
