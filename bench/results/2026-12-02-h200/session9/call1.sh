#!/usr/bin/env bash
# Session 9, device call 1: torch.compile at real size (issue 12's item: compile time and step time per model),
# the HBM read ceiling beside Gemma-4-31B's B=1 (its GEMVs ran 14.71 against 13.89 ms in session 8), and the
# first tuned GEMV files for Gemma-4-E2B's shapes (written under $OUT, checked in after the call).
# "compile" is the default variant with CUSTOM_BACKEND_COMPILE: its capture record's seconds include Dynamo's and
# Inductor's compile of every bucket (the warm-up forward before each capture), "after"'s are capture alone.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
summary() {
  grep -o '"variant": "[a-z-]*", "buckets.*kernels_b1": [0-9a-z]*\|"variant": "[a-z-]*", "batch": [0-9]*, .*"replay_ms": [0-9.]*\|"overlap_tok_s_runs": \[[^]]*\]' \
    $OUT/eb-$1.log | sed 's/"buckets": \[[0-9, ]*\], / /; s/, "bucket.*"replay_ms"/ "replay_ms"/' \
    | paste -sd' ' | sed "s/^/$1: /"
}
timeout 60 python3 bench/read_bandwidth.py --gib 2 --reps 20 > $OUT/read_bandwidth.log 2>&1; tail -8 $OUT/read_bandwidth.log
date +%T
export TORCH_LOGS=recompiles
for m in qwen3-30b-a3b gemma-4-e4b; do
  timeout $((400 - SECONDS)) python3 bench/engine_bench.py run --model $m --variants after,compile \
    --batches 1,16,64 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-$m.log
  summary $m
  grep -c "Recompiling" $OUT/eb-$m.log
  date +%T
done
unset TORCH_LOGS
timeout $((470 - SECONDS)) python3 bench/dense_linear.py --sweep --write --models gemma-4-e2b --tokens 1,2 \
  --budget-s 60 --out-dir $OUT/dense_linear > $OUT/dense_linear_sweep.log 2>&1; tail -12 $OUT/dense_linear_sweep.log
date +%T
timeout $((560 - SECONDS)) python3 bench/engine_bench.py run --model gemma-4-31b --variants after \
  --batches 1 --repeats 3 --skip-offline --out /tmp/eb 2>&1 | grep -v Warn > $OUT/eb-gemma-4-31b.log
summary gemma-4-31b
timeout $((590 - SECONDS)) python3 bench/read_bandwidth.py --gib 2 --reps 20 > $OUT/read_bandwidth2.log 2>&1; tail -3 $OUT/read_bandwidth2.log
date +%T
