#!/usr/bin/env bash
# Session 11, device call 1: does an L2 prefetch of the o projection's weights during the decode attention pay?
# bench/l2_prefetch.py at batch 1, every attention layer shape, PDL on (and once off for Qwen).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout $((400 - SECONDS)) python3 bench/l2_prefetch.py 2>&1 | grep -v Warn | tee $OUT/l2_prefetch.md
timeout $((450 - SECONDS)) python3 bench/l2_prefetch.py --only qwen3 --no-pdl 2>&1 | grep -v Warn | tee $OUT/l2_prefetch_nopdl.md
timeout $((500 - SECONDS)) python3 bench/l2_prefetch.py --only qwen3,gemma-4-e4b --context 4000 --max-model-len 8192 2>&1 | grep -v Warn | tee $OUT/l2_prefetch_ctx4k.md
date +%T
