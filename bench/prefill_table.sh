#!/usr/bin/env bash
# Issue 42's HTTP figures in one device call (<= 10 minutes), dummy weights, median of 3, each server at its
# default MAX_MODEL_LEN (the model's own limit where the KV pool holds it):
#   1. Gemma-4-26B-A4B, one prompt at a time of 8,192 / 30,000 / 131,072 tokens, 64 out: TTFT and the decode ITL at
#      that context; the default server against MAX_PREFILL_TOKENS=2048 (every step at the 2,048-token budget, as
#      before prefill-only steps took 4x);
#   2. the burst: 100 prompts of 512 tokens at once on 26B-A4B, 128 out (p99 TTFT), both servers again;
#   3. Qwen3-30B-A3B (to its 40,960-token limit: 40,896 in + 64 out) and 4. Gemma-4-E4B alone at long contexts.
# 2026-12-05: parts 1-2 ran without their MAX_PREFILL_TOKENS=2048 variant (bench/results/http-2026-12-05.md); the
# variant answers whether 131k got slower with 8,192-token steps (10,929 ms against 8,567 at 2,048 the day before).
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh). Back under $OUT:
# <name>.log (console) and <name>.md (table) per run; reports and server logs stay in /tmp/<name>/ on the device.
. bench/kit/device_call.sh
long=(--concurrency 1 --num-prompts 1 --output-len 64 --warmup 1 --warmup-input-len 512 --warmup-output-len 4)
serving_table_run prefill-26b 200 --model gemma-4-26b-a4b "${long[@]}" --input-len 8192,30000,131072 \
  --variant MAX_PREFILL_TOKENS=2048
serving_table_run burst-26b 330 --model gemma-4-26b-a4b --concurrency 100 --num-prompts 100 --input-len 512 \
  --output-len 128 \
  --env MAX_MODEL_LEN=4096 --variant MAX_PREFILL_TOKENS=2048
serving_table_run prefill-qwen3 470 --model qwen3-30b-a3b "${long[@]}" --input-len 8192,30000,40896
serving_table_run long-e4b 575 --model gemma-4-e4b "${long[@]}" --input-len 32768,131008
