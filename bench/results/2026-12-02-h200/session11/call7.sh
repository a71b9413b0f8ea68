#!/usr/bin/env bash
# Session 11, device call 7: a decode-attention split sweep at batch 1 (Qwen3-30B-A3B, Gemma-4-E4B, 26B-A4B layers,
# context 527, the bench's model length 592 and a server's 32768), and Gemma-4-E4B's torch.compile cold start (the
# "compile" variant first in its process), one of the two compile figures still missing.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for len in 592 32768; do
  timeout $((100 - SECONDS)) python3 bench/decode_attention_bench.py --contexts 527 --batches 1 --max-model-len $len \
    --splits auto,1,2,4,8,16 --layers "qwen3-30b-a3b,gemma-4-e4b sliding,gemma-4-e4b full,gemma-4-26b-a4b sliding" \
    2>&1 | grep -v Warn | tee $OUT/attention_splits_$len.txt
done
date +%T
timeout $((230 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-e4b --variants compile --batches 1 \
  --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-e4b 2>&1 | grep -v Warn > $OUT/eb-gemma-4-e4b-compile.log
grep -o '"kind": "capture".*\|"variant": "compile", "batch": [0-9]*, .*"overlap_tok_s": [0-9.]*' $OUT/eb-gemma-4-e4b-compile.log | cut -c1-300
date +%T
