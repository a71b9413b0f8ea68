#!/usr/bin/env bash
# Issue 42, head_dim-512 prefill attention at 2 value slices (128x32 tile, 8 warps, 2 stages) in one device call
# (~5 minutes): the GPU tests that run the long-chunk path at real shapes (the prefill kernel against its reference at
# the three layer kinds, the 26B-A4B cut preset's bf16 error against the reference runner's), then engine_bench Gemma-4-26B-A4B prefill of 30,000 tokens in
# 8,192-token steps (dummy weights; wall median of 3 and device time per kernel). Run from the project root
# on the device machine with `.whl` carried. Back under $OUT: tests.log, engine-prefill.log, engine_bench.jsonl.
. bench/kit/device_call.sh
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore "tests/kernels/test_attention_kernels.py::test_gpu_prefill_at_every_layer_kind" \
  "tests/backends/test_cuda_backend.py::test_bf16_error_within_reference_bf16_error[gemma-4-26b-a4b]" \
  > $OUT/tests.log 2>&1; tail -5 $OUT/tests.log
timeout 170 python3 bench/engine_bench.py run --model gemma-4-26b-a4b --batches 1 --steps 4 --profile-batches "" \
  --skip-offline --prefill 30000 --prefill-chunk 8192 --out $OUT > $OUT/engine-prefill.log 2>&1
echo "== engine_bench (t=${SECONDS} s)"; python3 - "$OUT/engine_bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "prefill":
        top = "; ".join(f"{t['name'][:40]} {t['ms']} ({t['launches']})" for t in r.get("top", [])[:5])
        print(r["prompt_len"], r["chunk"], r["wall_ms"], "ms", r["floor_fraction"], "|", top)
PY

