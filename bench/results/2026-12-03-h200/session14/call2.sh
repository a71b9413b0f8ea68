#!/usr/bin/env bash
# Session 14, device call 2: the new default release place at hidden sizes <= 2,048 (the attention, the head and the
# MoE launches right after their wait; the GEMVs and the router after their loop:
# cuda_backend.EARLY_RELEASE_NARROW_CLASSES) against the old one (every class after the wait) on Qwen3-30B-A3B and
# Gemma-4-E2B at B=1, median of 3, in the order new, old, new. Then issue 12's before/after table on today's tree,
# per model one process: "before" (every issue-12 lever with a switch off, the tuned configs and PDL off) and "after"
# (the default), B = 1, 16, 64, 256 (Gemma-4-31B: 1, 16, 64: its KV for 256 x 544 tokens does not fit beside its
# weights), median of 3, context ~540, dummy bf16 weights; the B=1 kernel profile for Qwen3-30B-A3B and
# Gemma-4-26B-A4B; the models in the time left.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
summary() {
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/$1.log | sed 's/"buckets.*"kernels_b1"/ "kernels_b1"/; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$1: /"
}
for m in qwen3-30b-a3b gemma-4-e2b; do
  timeout $((580 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after,release-after-wait,after \
    --batches 1 --repeats 3 --skip-offline --profile-batches "" --out /tmp/ab-$m 2>&1 | grep -v Warn > $OUT/ab-$m.log
  summary ab-$m
  date +%T
done
for m in qwen3-30b-a3b gemma-4-e2b gemma-4-26b-a4b gemma-4-e4b gemma-4-31b; do
  [ $SECONDS -lt 440 ] || break
  batches=1,16,64,256; [ $m = gemma-4-31b ] && batches=1,16,64
  profile=""; [ $m = qwen3-30b-a3b ] || [ $m = gemma-4-26b-a4b ] && profile=1
  timeout $((585 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants before,after \
    --batches $batches --repeats 3 --skip-offline --profile-batches "$profile" --out /tmp/eb-$m 2>&1 \
    | grep -v Warn > $OUT/eb-$m.log
  summary eb-$m
  date +%T
done
