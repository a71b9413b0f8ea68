#!/usr/bin/env bash
# Issue 42's HTTP figures in one device call (<= 10 minutes), dummy weights, median of 3, each server at its
# default MAX_MODEL_LEN (the model's own limit where the KV pool holds it):
#   1. Gemma-4-26B-A4B, one prompt at a time of 8,192 / 30,000 / 131,072 tokens, 64 out: TTFT and the decode ITL at
#      that context (cold: since 2026-12-05 prompts of different lengths share no prefix, so none is served from the
#      prefix cache; before, each length began with the previous one's prompt);
#   2. the burst: 100 prompts of 512 tokens at once on 26B-A4B, 128 out (p99 TTFT);
#   3. Qwen3-30B-A3B (to its 40,960-token limit: 40,896 in + 64 out), 4. Gemma-4-E4B and 5. Gemma-4-E2B at 32k and
#      128k, 6. Gemma-4-31B at 128k, as far as the call's time goes (each run ends before its deadline, or is skipped).
# The MAX_PREFILL_TOKENS=2048 variant answered its question on 2026-12-05 (8,192-token steps are not slower at 131k:
# 9,681 against 10,359 ms, H100, same call) and went.
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh). Back under $OUT:
# <name>.md (table) per run and consoles.txt (every console); reports and server logs stay in /tmp/<name>/ there.
. bench/kit/device_call.sh
long=(--concurrency 1 --num-prompts 1 --output-len 64 --warmup 1 --warmup-input-len 512 --warmup-output-len 4)
serving_table_run prefill-26b 130 --model gemma-4-26b-a4b "${long[@]}" --input-len 8192,30000,131072
serving_table_run burst-26b 175 --model gemma-4-26b-a4b --concurrency 100 --num-prompts 100 --input-len 512 \
  --output-len 128 --env MAX_MODEL_LEN=4096
serving_table_run prefill-qwen3 270 --model qwen3-30b-a3b "${long[@]}" --input-len 8192,30000,40896
serving_table_run long-e4b 370 --model gemma-4-e4b "${long[@]}" --input-len 32768,131008
serving_table_run long-e2b 470 --model gemma-4-e2b "${long[@]}" --input-len 32768,131008
serving_table_run long-31b 585 --model gemma-4-31b "${long[@]}" --input-len 131008
# The device returns at most 8 files: the six tables stay, the consoles go into one.
for f in $OUT/*.log; do echo "=== $f"; cat "$f"; done > $OUT/consoles.txt 2>/dev/null && rm -f $OUT/*.log
