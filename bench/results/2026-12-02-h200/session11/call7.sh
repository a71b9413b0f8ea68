#!/usr/bin/env bash
# Session 11, device call 7: the two torch.compile figures still missing (docs/benchmarks.md, ninth session):
# Gemma-4-E4B's compile cold start (the "compile" variant first in its process) and Gemma-4-31B compile at B=64.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout $((150 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-e4b --variants compile --batches 1 \
  --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-e4b 2>&1 | grep -v Warn > $OUT/eb-gemma-4-e4b-compile.log
grep -o '"kind": "capture".*\|"variant": "compile", "batch": [0-9]*, .*"overlap_tok_s": [0-9.]*' $OUT/eb-gemma-4-e4b-compile.log | cut -c1-300
date +%T
timeout $((300 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-31b --variants compile,after --batches 64 \
  --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-31b 2>&1 | grep -v Warn > $OUT/eb-gemma-4-31b-compile.log
grep -o '"kind": "capture".*\|"variant": "[a-z]*", "batch": [0-9]*, .*"overlap_tok_s": [0-9.]*' $OUT/eb-gemma-4-31b-compile.log | cut -c1-300
date +%T
