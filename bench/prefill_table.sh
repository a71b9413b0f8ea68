#!/usr/bin/env bash
# Issue 42's HTTP figures in one device call (<= 10 minutes), dummy weights, median of 3, each server at its
# default MAX_MODEL_LEN (the model's own limit where the KV pool holds it):
#   1. Gemma-4-26B-A4B, one prompt at a time of 8,192 / 30,000 / 131,072 tokens, 64 out: TTFT and the decode ITL at
#      that context; the default server against MAX_PREFILL_TOKENS=2048 (every step at the 2,048-token budget, as
#      before prefill-only steps took 4x);
#   2. the burst: 100 prompts of 512 tokens at once on 26B-A4B, 128 out (p99 TTFT), both servers again;
#   3. Qwen3-30B-A3B and 4. Gemma-4-E4B alone at long contexts.
# Run from the project root on the device machine with `.whl` carried (bash bench/device_wheels.sh). Back under $OUT:
# <name>.log (console) and <name>.md (table) per run; reports and server logs stay in /tmp/<name>/ on the device.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
table() {  # name, end of its budget (s since the call began), serving_table arguments...
  local name=$1 end=$2; shift 2
  local left=$((end - SECONDS))
  [ $left -gt 60 ] || { echo "== $name skipped: ${left} s left"; return; }
  timeout $((590 - SECONDS)) python3 bench/serving_table.py "$@" --repeats 3 --budget-s $left --out /tmp/$name \
    > $OUT/$name.log 2>&1
  cp /tmp/$name/table.md $OUT/$name.md 2>/dev/null
  echo "== $name (t=${SECONDS} s)"; grep "ready in\|skipped\|budget" $OUT/$name.log
  cat $OUT/$name.md 2>/dev/null || tail -20 $OUT/$name.log
}
long=(--concurrency 1 --num-prompts 1 --output-len 64 --warmup 1 --warmup-input-len 512 --warmup-output-len 4)
table prefill-26b 200 --model gemma-4-26b-a4b "${long[@]}" --input-len 8192,30000,131072 \
  --variant MAX_PREFILL_TOKENS=2048
table burst-26b 330 --model gemma-4-26b-a4b --concurrency 100 --num-prompts 100 --input-len 512 --output-len 128 \
  --env MAX_MODEL_LEN=4096 --variant MAX_PREFILL_TOKENS=2048
table prefill-qwen3 470 --model qwen3-30b-a3b "${long[@]}" --input-len 8192,30000,131072
table long-e4b 575 --model gemma-4-e4b "${long[@]}" --input-len 32768,131008
