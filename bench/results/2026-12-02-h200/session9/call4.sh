#!/usr/bin/env bash
# Session 9, device call 4: Qwen3-30B-A3B with QUANTIZATION=int8, where the q/k/v projection is the int8 GEMV at every
# step size it takes: the input add + norm fold off ("separate-add-norm-gemv") and on ("after"), B = 1, 2 and 16,
# median of 3, one process.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 330 python3 bench/engine_bench.py run --model qwen3-30b-a3b --quantization int8 \
  --variants separate-add-norm-gemv,after --batches 1,2,16 --repeats 3 --skip-offline --out /tmp/eb 2>&1 \
  | grep -v Warn > $OUT/eb-qwen3-30b-a3b-int8.log
grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9a-z]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
  $OUT/eb-qwen3-30b-a3b-int8.log | sed 's/"buckets": \[[0-9, ]*\], / /; s/, "bucket.*"replay_ms"/ "replay_ms"/'
date +%T
