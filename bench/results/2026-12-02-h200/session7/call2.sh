#!/usr/bin/env bash
# Session 7, device call 2: the decode attention's launch parameters at batch 16 and 64 (Gemma-4-E4B's B=64 step
# spent 1.48 of 5.1 ms in it, at 0.2 of its K/V bytes' memory time: session5/call7): splits, key tile, pipeline
# depth and warps, for E4B's sliding and full layers and Qwen3-30B-A3B's, context 527 (the engine bench's), model
# length 32768; then batch 1 with the default splits.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 400 python3 bench/decode_attention_bench.py --layers "gemma-4-e4b sliding,gemma-4-e4b full,qwen3-30b-a3b" \
  --batches 64,16 --contexts 527 --splits auto,1,2,4,6,8 --block-n 32,64 --stages 1,2,3 --warps 4,8 --launches 40 \
  2>&1 | grep -v Warn > $OUT/attention_b16_b64.log
date +%T
timeout 150 python3 bench/decode_attention_bench.py --layers "gemma-4-e4b sliding,gemma-4-e4b full,qwen3-30b-a3b,gemma-4-26b-a4b sliding,gemma-4-26b-a4b full" \
  --batches 1 --contexts 527 --splits auto --block-n 32,64 --stages 1,2,3 --warps 4,8 --launches 60 \
  2>&1 | grep -v Warn > $OUT/attention_b1.log
date +%T
tail -n 4 $OUT/attention_b1.log
