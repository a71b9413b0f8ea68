#!/usr/bin/env bash
# Session 11, device call 3: what a whole overlapped decode step spends outside its CUDA graph (bench/step_timeline.py
# --overlapped): Qwen3-30B-A3B and Gemma-4-E4B at B=1, E4B at B=64 (bf16 dummy weights, context ~512).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for mb in qwen3-30b-a3b:1 gemma-4-e4b:1 gemma-4-e4b:64 qwen3-30b-a3b:64; do
  m=${mb%:*}; b=${mb#*:}
  [ $SECONDS -lt 420 ] || break
  timeout $((530 - SECONDS)) python3 bench/step_timeline.py --model $m --batch $b --overlapped --out /tmp/tl-$m-$b \
    2>&1 | grep -v Warn > $OUT/tl-$m-b$b.log
  grep -o '"kind": "step_timeline".*' $OUT/tl-$m-b$b.log | cut -c1-1500
  grep -o '"kind": "decode".*overlap_ms": [0-9.]*' $OUT/tl-$m-b$b.log | cut -c1-400
  date +%T
done
