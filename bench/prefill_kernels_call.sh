#!/usr/bin/env bash
# Issue 42's three prefill experiments in one device call (<= 10 minutes), dummy weights, on branch
# prefill-experiments (main + prefill-backlog + qknr-tokens + moe-sum-unweighted):
#   1. bench/qk_norm_rope_tiles.py: q/k norm + RoPE + KV store with a block of tokens a program vs one (~1 min);
#   2. bench/moe_pair_dtype.py: the MoE pair outputs in bf16 (weighted in the k-sum) vs fp32 (~1 min);
#   3. engine_bench, Gemma-4-26B-A4B, one prompt of 8,192 and of 30,000 tokens in 8,192-token steps (wall, median of
#      3, device time per kernel; before: 169.3 / 986 ms, _qk_norm_rope_kernel 9.0 ms, _moe_down_kernel 20.8 ms,
#      _moe_sum_kernel 5.9 ms at 8,192, bench/results/long-context-2026-12-04.md);
#   4. the burst: 100 prompts of 512 tokens at once on Gemma-4-26B-A4B, 128 out (p99 TTFT, median of 3), the branch's
#      default (PREFILL_BACKLOG: steps take MAX_PREFILL_TOKENS while more requests wait for a first token than decode)
#      against PREFILL_BACKLOG=false (before: TTFT p99 2,090 ms, bench/results/http-2026-12-05.md).
# Keep each change that wins (then the GPU suite, bench/gpu_suite.sh, in the next call), delete each that does not.
# Run from the project root on the device machine with `.whl` carried. Back under $OUT: *.log, *.md, engine_bench.jsonl.
. bench/kit/device_call.sh
timeout 75 python3 bench/qk_norm_rope_tiles.py > $OUT/qk_norm_rope_tiles.log 2>&1
echo "== qk_norm_rope_tiles (t=${SECONDS} s)"; cat $OUT/qk_norm_rope_tiles.log
timeout 75 python3 bench/moe_pair_dtype.py > $OUT/moe_pair_dtype.log 2>&1
echo "== moe_pair_dtype (t=${SECONDS} s)"; cat $OUT/moe_pair_dtype.log
timeout 170 python3 bench/engine_bench.py run --model gemma-4-26b-a4b --batches 1 --steps 4 --profile-batches "" \
  --skip-offline --prefill 8192,30000 --prefill-chunk 8192 --out $OUT > $OUT/engine-prefill.log 2>&1
echo "== engine_bench (t=${SECONDS} s)"; python3 - "$OUT/engine_bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "prefill":
        top = "; ".join(f"{t['name'][:50]} {t['ms']} ({t['launches']})" for t in r.get("top", [])[:10])
        print(r["prompt_len"], r["chunk"], r["wall_ms"], "ms", r["floor_fraction"], "kernels", r.get("kernel_ms"), "|", top)
PY
serving_table_run burst-26b 585 --model gemma-4-26b-a4b --concurrency 100 --num-prompts 100 --input-len 512 \
  --output-len 128 --env MAX_MODEL_LEN=4096 --variant PREFILL_BACKLOG=false
