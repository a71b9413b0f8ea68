#!/usr/bin/env bash
# Session 12, device call 3: a layer's q/k norm, RoPE and KV store inside the decode attention launch
# (fused_kv_norm_rope_attention; "separate-kv-rope" = qk_norm_rope's launch with the store, as before), on the final
# tree (the earlier keys before the attention's wait only at 1-2 sequences of head_dim <= 128). GPU tests first (the
# attention in a PDL graph with the new key computed and stored in the launch; the runner bitwise with PDL on and
# off), then the A/B at B = 1 and 64 per model, median of 3 each.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 90 python3 -m pytest -q tests/kernels/test_attention_kernels.py -k "gpu_new_key or gpu_query_key" 2>&1 \
  | grep -v "Warn\|warn" | tail -3 | tee $OUT/gpu_tests.log
timeout $((220 - SECONDS)) python3 -m pytest -q tests/backends/test_pdl_runner.py 2>&1 | grep -v "Warn\|warn" | tail -3 \
  | tee -a $OUT/gpu_tests.log
date +%T
for m in qwen3-30b-a3b gemma-4-26b-a4b gemma-4-e4b gemma-4-31b gemma-4-e2b; do
  [ $SECONDS -lt 400 ] || break
  timeout $((460 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after,separate-kv-rope \
    --batches 1,64 --repeats 3 --skip-offline --profile-batches "" --out /tmp/eb-$m 2>&1 | grep -v Warn > $OUT/eb-$m.log
  grep -o '"kernels_b1": [0-9]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$m.log | sed 's/, "bucket.*"replay_ms"/ "replay_ms"/' | paste -sd' ' | sed "s/^/$m: /"
  date +%T
done
