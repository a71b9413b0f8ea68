#!/usr/bin/env bash
# Session 5, device call 1: the GEMV's L2 prefetch and the attention's early PDL release on Gemma-4-31B int8 at
# B=1 (variants of one runner build), the session's start (.old: HEAD before the session, archived) in the same
# call, and the launch ablations (bench/ablate_decode.py). Logs under $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
date +%T
python3 -m pytest -q -m gpu tests/kernels/test_l2_prefetch.py 2>&1 | tail -3 | tee $OUT/gpu_tests.log
date +%T
python3 bench/engine_bench.py run --model gemma-4-31b --quantization int8 --batches 1 --repeats 3 --skip-offline \
  --variants after,l2-16m,l2-32m,l2-all,attn-early,l2-16m-attn-early,l2-32m-attn-early,l2-8m --out /tmp/new \
  2>&1 | grep -v Warn | tee $OUT/new-31b-int8.log | grep -o '"variant": "[^"]*", "batch": 1, .*"overlap_tok_s": [0-9.]*'
date +%T
(cd .old && PYTHONPATH=/tmp/site:$PWD/src python3 bench/engine_bench.py run --model gemma-4-31b --quantization int8 \
  --batches 1 --repeats 3 --skip-offline --variants after --out /tmp/old) 2>&1 | grep -v Warn | tee $OUT/old-31b-int8.log \
  | grep -o '"variant": "[^"]*", "batch": 1, .*"overlap_tok_s": [0-9.]*'
date +%T
python3 bench/ablate_decode.py --model gemma-4-31b --quantization int8 --out /tmp/abl \
  --ablations none,no-norm-add,empty-norm-add,no-qk-norm,no-attention 2>&1 | grep -v Warn | tee $OUT/ablate-31b-int8.log \
  | grep -o '"variant": "[^"]*", "batch": 1, .*"overlap_tok_s": [0-9.]*'
date +%T
