#!/usr/bin/env bash
# Session 5, device call 7: per-kernel profiles at the real context (the fixed engine_bench profile) at B=64 for
# Gemma-4-E4B and Gemma-4-26B-A4B bf16, and B=1 / 64 step timelines of E4B, for the next session's issue-12 work.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
for m in gemma-4-e4b gemma-4-26b-a4b; do
  python3 bench/engine_bench.py run --model $m --batches 64 --repeats 1 --skip-offline --profile-batches 64 \
    --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m-b64.log
  date +%T
done
python3 bench/step_timeline.py --model gemma-4-e4b --batch 64 --out /tmp/tl 2>&1 | grep -v Warn > $OUT/tl-e4b-b64.log
date +%T
