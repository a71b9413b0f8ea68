#!/usr/bin/env bash
# Session 13, device call 3 (run as one command line): the default tree at B = 1, 16, 64, 256 on the two models whose
# default the release place changed (Qwen3-30B-A3B, Gemma-4-E2B), median of 3, for the README's figures.
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
for m in qwen3-30b-a3b gemma-4-e2b; do
  timeout $((500 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after --batches 1,16,64,256 \
    --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb3-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]\|"overlap_fraction": [0-9.]*' \
    $OUT/eb-$m.log | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
done
