#!/usr/bin/env bash
# Session 11, device call 2: call 1's bulk prefetches held the chain (a launch of them lasted as long as its fetches,
# so every pf+attn+gemv row was slower than attn+gemv). Here the prefetch also runs on a parallel branch of the graph
# ("side"), and as per-line prefetch.global.L2.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout $((200 - SECONDS)) python3 bench/l2_prefetch.py --chunks 4096,16384 2>&1 | grep -v Warn | tee $OUT/l2_prefetch_bulk.md
timeout $((300 - SECONDS)) python3 bench/l2_prefetch.py --lines --threads 128 --chunks 1024,4096 \
  --only qwen3,gemma-4-e4b,gemma-4-26b-a4b 2>&1 | grep -v Warn | tee $OUT/l2_prefetch_lines.md
date +%T
