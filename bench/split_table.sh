#!/usr/bin/env bash
# Issue 41's split engine on the H200 in one device call (<= 10 minutes): output tok/s over HTTP, the in-process
# server (ENGINE_PROCESS=in-process: `auto` is separate on CUDA) against ENGINE_PROCESS=separate, at c=1 and c=100
# (512 in / 512 out, median of 3), Gemma-4-E4B then Gemma-4-E2B (dummy weights). Checks ENGINE_PROCESS=auto's choice
# on CUDA (separate, from E4B at c=100 on 2026-12-05) at c=1 and on E2B.
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh).
# Back under $OUT: split-<model>.log / .md.
. bench/kit/device_call.sh
common=(--concurrency 1,100 --num-prompts 8,100 --input-len 512 --output-len 512 --env MAX_MODEL_LEN=4096
        --env ENGINE_PROCESS=in-process)
serving_table_run split-e4b 300 --model gemma-4-e4b "${common[@]}" --variant ENGINE_PROCESS=separate
serving_table_run split-e2b 575 --model gemma-4-e2b "${common[@]}" --variant ENGINE_PROCESS=separate
