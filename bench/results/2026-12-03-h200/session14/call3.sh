#!/usr/bin/env bash
# Session 14, device call 3: the default release place at hidden sizes <= 2,048 after call 2 (every class right
# after its wait but the router GEMV: cuda_backend.EARLY_RELEASE_NARROW_CLASSES). Qwen3-30B-A3B at B=1 against every
# class early, in the order new, old, new, median of 3; then the default tree at B = 1, 16, 64, 256 on Qwen3-30B-A3B
# and Gemma-4-E2B (whose launches are those of every class early: it has no router), median of 3.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
summary() {
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/$1.log | sed 's/"buckets.*"kernels_b1"/ "kernels_b1"/; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$1: /"
}
timeout 60 python3 bench/engine_bench.py run --model qwen3-30b-a3b --variants after,release-after-wait,after \
  --batches 1 --repeats 3 --skip-offline --profile-batches "" --out /tmp/ab 2>&1 | grep -v Warn > $OUT/ab-qwen3-30b-a3b.log
summary ab-qwen3-30b-a3b
for m in qwen3-30b-a3b gemma-4-e2b; do
  timeout $((230 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after --batches 1,16,64,256 \
    --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  summary eb-$m
  date +%T
done
