#!/usr/bin/env bash
# Issue 42's burst and long prompts in one device call (<= 10 minutes), dummy weights:
#   1. the burst: 100 prompts of 512 tokens at once on Gemma-4-26B-A4B, 128 out (p99 TTFT, median of 3), the default
#      (PREFILL_BACKLOG: steps take MAX_PREFILL_TOKENS while more requests wait for a first token than decode)
#      against PREFILL_BACKLOG=false (steps with decodes keep MAX_NUM_BATCHED_TOKENS);
#   2. engine_bench, Gemma-4-26B-A4B: one prompt of 131,072 tokens in prefill steps of 2,048 and 8,192 tokens (wall,
#      median of 3, and device time per kernel): does the 131k HTTP regression (10,929 ms at 8,192-token steps
#      against 8,567 at 2,048) come from the kernels, and which;
#   3. over HTTP: Gemma-4-E4B alone at 32,768 and 131,008 tokens (TTFT and decode ITL at that context).
# Run from the project root on the device machine with `.whl` carried. Back under $OUT: *.log, *.md, engine_bench.jsonl.
. bench/kit/device_call.sh
serving_table_run burst-26b 200 --model gemma-4-26b-a4b --concurrency 100 --num-prompts 100 --input-len 512 \
  --output-len 128 --env MAX_MODEL_LEN=4096 --variant PREFILL_BACKLOG=false
timeout $((440 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-26b-a4b --batches 1 --steps 4 \
  --profile-batches "" --skip-offline --prefill 131072 --prefill-chunk 2048,8192 --out $OUT > $OUT/engine-prefill.log 2>&1
echo "== engine_bench (t=${SECONDS} s)"; python3 - "$OUT/engine_bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "prefill":
        top = "; ".join(f"{t['name'][:50]} {t['ms']} ({t['launches']})" for t in r.get("top", [])[:8])
        print(r["prompt_len"], r["chunk"], r["wall_ms"], "ms", r["floor_fraction"], "kernels", r.get("kernel_ms"), "|", top)
PY
long=(--concurrency 1 --num-prompts 1 --output-len 64 --warmup 1 --warmup-input-len 512 --warmup-output-len 4)
serving_table_run long-e4b 585 --model gemma-4-e4b "${long[@]}" --input-len 32768,131008
