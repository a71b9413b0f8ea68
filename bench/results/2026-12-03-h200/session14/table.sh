#!/usr/bin/env bash
# Session 14, device calls 2 and 3: issue 12's before/after table on today's tree. Per model one process, the
# "before" variant (every issue-12 lever with a switch off, the tuned configs and PDL off) and "after" (the default),
# B = 1, 16, 64 and 256 (Gemma-4-31B: 1, 16, 64; its KV for 256 x 544 tokens does not fit beside its weights),
# median of 3, context ~540, dummy bf16 weights; the B=1 kernel profile of each variant.
# Usage: table.sh MODEL...  (call 2: gemma-4-e4b qwen3-30b-a3b gemma-4-26b-a4b; call 3: gemma-4-e2b gemma-4-31b)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
summary() {
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$1.log | sed 's/"buckets.*"kernels_b1"/ "kernels_b1"/; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$1: /"
}
for m in "$@"; do
  [ $SECONDS -lt 420 ] || break
  batches=1,16,64,256; [ $m = gemma-4-31b ] && batches=1,16,64
  timeout $((570 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants before,after \
    --batches $batches --repeats 3 --skip-offline --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  summary $m
  date +%T
done
