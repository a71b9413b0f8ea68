#!/usr/bin/env bash
# Issue 41's split engine on the H200 in one device call (<= 10 minutes): output tok/s over HTTP, the in-process
# server (ENGINE_PROCESS=in-process: `auto` is separate on CUDA) against ENGINE_PROCESS=separate, at c=1 and c=100 (512 in / 512 out, median of 3), Gemma-4-E4B then
# Gemma-4-E2B (dummy weights); and a py-spy profile of E4B's engine process under the c=100 load (what the fake-step
# profiles on a 2-core VM cannot show: the runner's host work per step). Checks ENGINE_PROCESS=auto's choice on CUDA
# (separate, from E4B at c=100 on 2026-12-05) at c=1 and on E2B. py-spy failed to attach on the device on 2026-12-05.
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh: it holds py-spy).
# Back under $OUT: split-<model>.log / .md and engine-spy.json (speedscope; open at speedscope.app).
. bench/kit/device_call.sh
spy() {  # once E4B's engine process exists, wait for the c=100 runs, then sample it for 20 s
  local pid=""
  for _ in $(seq 600); do pid=$(pgrep -f inference_server.engine_process | head -1); [ -n "$pid" ] && break; sleep 0.5; done
  [ -n "$pid" ] || { echo "spy: no engine process"; return; }
  sleep 80  # start ~40 s, then c=1 (3 x 8 x 512 tokens, ~40 s): c=100 follows
  py-spy record --pid "$pid" --duration 20 --rate 200 --nonblocking --format speedscope -o $OUT/engine-spy.json \
    > /tmp/spy.log 2>&1 || { echo "spy failed:"; tail -3 /tmp/spy.log; }
}
spy &
common=(--concurrency 1,100 --num-prompts 8,100 --input-len 512 --output-len 512 --env MAX_MODEL_LEN=4096
        --env ENGINE_PROCESS=in-process)
serving_table_run split-e4b 300 --model gemma-4-e4b "${common[@]}" --variant ENGINE_PROCESS=separate
serving_table_run split-e2b 575 --model gemma-4-e2b "${common[@]}" --variant ENGINE_PROCESS=separate
wait
