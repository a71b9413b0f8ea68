#!/usr/bin/env bash
# Issue 41's MoE rows on the H200 in one device call (<= 10 minutes): output tok/s over HTTP with the engine in its
# own process (`ENGINE_PROCESS=auto` on CUDA), 512 in / 512 out, median of 3, dummy weights: Gemma-4-26B-A4B at c=1
# and c=100 (goal >= 4,800 tok/s and GPU busy >= 90 % at c=100), then Qwen3-30B-A3B at c=1 and c=64 (GPU busy >= 90 %).
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh).
# Back under $OUT: split-<model>.log / .md.
. bench/kit/device_call.sh
common=(--input-len 512 --output-len 512 --env MAX_MODEL_LEN=4096)
serving_table_run split-26b 300 --model gemma-4-26b-a4b --concurrency 1,100 --num-prompts 8,100 "${common[@]}"
serving_table_run split-qwen3 585 --model qwen3-30b-a3b --concurrency 1,64 --num-prompts 8,64 "${common[@]}"
