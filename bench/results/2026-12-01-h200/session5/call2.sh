#!/usr/bin/env bash
# Session 5, device call 2: why the decode attention costs 1.3 ms of a 31B int8 B=1 replay (call 1's ablation) when
# its spans add up to 0.3 ms: the replay's timeline (bench/step_timeline.py) with attention as it is, removed, an
# empty launch, and 1 / 4 / 16 KV splits; the server's model length (8192); and the same on Qwen3 and 26B-A4B bf16.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
show() { grep -o '"kind": "\(timeline\|decode\)", "model": "[^"]*", "variant": "[^"]*".\{0,60\}\|"wall_us": [0-9.]*, "busy_us": [0-9.]*, "idle_us": [0-9.]*\|"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*'; }
date +%T
python3 bench/step_timeline.py --model gemma-4-31b --quantization int8 --out /tmp/t31 \
  --ablations none,no-attention,empty-attention,attention-1split,attention-4split,attention-16split 2>&1 \
  | grep -v Warn | tee $OUT/tl-31b-int8.log | show
date +%T
python3 bench/step_timeline.py --model gemma-4-31b --quantization int8 --out /tmp/t31l --max-model-len 8192 \
  --ablations none 2>&1 | grep -v Warn | tee $OUT/tl-31b-int8-len8192.log | show
date +%T
python3 bench/step_timeline.py --model qwen3-30b-a3b --out /tmp/tq --ablations none,no-attention,attention-1split \
  2>&1 | grep -v Warn | tee $OUT/tl-qwen-bf16.log | show
date +%T
python3 bench/step_timeline.py --model gemma-4-26b-a4b --out /tmp/t26 --ablations none,no-attention,attention-1split \
  2>&1 | grep -v Warn | tee $OUT/tl-26b-bf16.log | show
date +%T
