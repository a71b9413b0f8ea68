#!/usr/bin/env bash
# The kv-profile branch's second device call (after bench/gpu_suite.sh): Gemma-4-31B started at the defaults on
# the lent card (before the measured step it needed KV_CACHE_MEMORY_FRACTION=0.7 on an 80 GB H100), its cold TTFT at
# 8,192 and 131,008 tokens, then issue 43's kernel profile of the deterministic decode step against the default at
# batch 1 and 64 on Gemma-4-26B-A4B (engine_bench.py, dummy weights). Run from the project root with `.whl` carried.
. bench/kit/device_call.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
serving_table_run prefill-31b 330 --model gemma-4-31b --concurrency 1 --num-prompts 1 --output-len 64 --warmup 1 \
  --warmup-input-len 512 --warmup-output-len 4 --ready-timeout 200 --input-len 8192,131008
grep -h "KV cache\|largest step\|measured" /tmp/prefill-31b/*.log 2>/dev/null | head -6
timeout $((585 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-26b-a4b --variants after,deterministic \
  --batches 1,64 --profile-batches 1,64 --repeats 3 --skip-offline --out /tmp/det-profile > $OUT/det-profile.log 2>&1
cp /tmp/det-profile/engine_bench.jsonl $OUT/det-profile.jsonl 2>/dev/null
echo "== det profile (t=${SECONDS} s)"; grep -v "^BENCH" $OUT/det-profile.log | tail -5
python3 - <<'PY'
import json, os
for line in open(os.environ.get("OUT", "/tmp") + "/det-profile.jsonl"):
    r = json.loads(line)
    if r.get("kind") == "decode":
        print("decode", r.get("variant"), r.get("batch"), r.get("tok_s"), r.get("step_ms"))
    if r.get("kind") == "kernels":
        print("kernels", r.get("variant"), r.get("batch"), r.get("us_per_step"))
        for k in r.get("top", [])[:12]:
            print("   ", k["us_per_step"], k["per_step"], k["name"][:90])
PY
