#!/usr/bin/env bash
# Session 12, device call 1: the decode attention's earlier keys before its PDL wait (kv_before_wait), and the MoE
# down launch's expert ids and first weight tiles before its wait ("down-after-wait" = without). Its GPU tests
# (the query's K/V stored by the launch before, in a PDL graph; the runner bitwise with PDL on and off), then the A/B
# on Qwen3-30B-A3B and Gemma-4-26B-A4B at B = 1 and 64 ("kv-after-wait" = before, "after" = with it; the order
# after, kv-after-wait, after so that neither sits only first), median of 3 each; and a split sweep of the attention
# alone at B = 16 and 64 (PDL off there, so kv_before_wait plays no part).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 150 python3 -m pytest -q tests/kernels/test_attention_kernels.py -k "gpu" 2>&1 | grep -v "Warn\|warn" | tail -3 \
  | tee $OUT/gpu_tests.log
timeout $((260 - SECONDS)) python3 -m pytest -q tests/backends/test_pdl_runner.py 2>&1 | grep -v "Warn\|warn" | tail -3 \
  | tee -a $OUT/gpu_tests.log
date +%T
for m in qwen3-30b-a3b gemma-4-26b-a4b; do
  timeout $((500 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after,kv-after-wait,down-after-wait,after \
    --batches 1,64 --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' $OUT/eb-$m.log \
    | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
timeout $((585 - SECONDS)) python3 bench/decode_attention_bench.py --contexts 527 --batches 16,64 --splits auto,1,2,3,4 \
  --layers "gemma-4-e4b sliding,gemma-4-e4b full,qwen3-30b-a3b,gemma-4-26b-a4b sliding" --launches 30 2>&1 \
  | grep -v Warn | tee $OUT/attention_splits.txt
date +%T
