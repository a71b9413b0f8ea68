#!/usr/bin/env bash
# Issue 42's longest contexts in one device call (<= 10 minutes): Gemma-4-26B-A4B and Gemma-4-31B, one cold prompt
# of 262,080 tokens (their 262,144-token limit less 64 out) at a time, median of 3, dummy weights, each server at its
# default MAX_MODEL_LEN (the model's limit where the KV pool holds it; on the H200 it does): TTFT and the decode ITL
# at that context. The shorter contexts (8k to 131k, and every other model to its limit) are bench/prefill_table.sh's.
# 31B runs as far as the call's time goes (each run ends before its deadline, or is skipped).
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh). Back under $OUT:
# <name>.log (console) and <name>.md (table) per run.
. bench/kit/device_call.sh
long=(--concurrency 1 --num-prompts 1 --output-len 64 --warmup 1 --warmup-input-len 512 --warmup-output-len 4)
serving_table_run longest-26b 300 --model gemma-4-26b-a4b "${long[@]}" --input-len 262080
serving_table_run longest-31b 585 --model gemma-4-31b "${long[@]}" --input-len 262080
