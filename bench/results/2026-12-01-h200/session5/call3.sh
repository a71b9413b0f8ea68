#!/usr/bin/env bash
# Session 5, device call 3: the decode attention costs far more in a plain graph replay than under the profiler
# (call 2: 31B int8 replay 8.79 ms, profiled 7.71 ms; without attention both 7.50). Is it PDL (attention launched
# without it), shared memory (one stage, 16-key tiles), or PDL everywhere (no-pdl)?
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
show() { grep -o '"kind": "timeline", "model": "[^"]*", "variant": "[^"]*"\|"wall_us": [0-9.]*\|"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*'; }
date +%T
python3 bench/step_timeline.py --model gemma-4-31b --quantization int8 --out /tmp/t31 \
  --ablations attention-no-pdl,attention-stages1,attention-block16,attention-block16-stages1 --variants no-pdl 2>&1 \
  | grep -v Warn | tee $OUT/tl-31b-int8.log | show
date +%T
python3 bench/step_timeline.py --model qwen3-30b-a3b --out /tmp/tq \
  --ablations attention-no-pdl,attention-stages1,attention-block16-stages1 --variants no-pdl 2>&1 \
  | grep -v Warn | tee $OUT/tl-qwen-bf16.log | show
date +%T
