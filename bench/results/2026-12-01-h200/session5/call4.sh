#!/usr/bin/env bash
# Session 5, device call 4: the decode attention at batch 1 (K and V issued together, the split merge in one round
# trip over the G real heads, >= 64 keys a split): GPU tests, the kernel alone against 461fcc2 (.old), and the engine
# step (31B int8, Qwen3 bf16) against 461fcc2 in the same call, at the bench's model length and at a server's (32768).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
show() { grep -o '"variant": "[^"]*", "batch": 1, .*"replay_ms": [0-9.]*\|"overlap_tok_s": [0-9.]*' | sed 's/"context.*"replay_ms"/ "replay_ms"/'; }
date +%T
python3 -m pytest -q -m gpu tests/kernels/test_attention_kernels.py tests/kernels/test_norm_add_kernel.py \
  tests/kernels/test_qk_norm_rope_kernel.py tests/kernels/test_qk_norm_rope_kv_store.py 2>&1 | tail -4 | tee $OUT/gpu_tests.log
date +%T
python3 bench/decode_attention_bench.py --contexts 527,2048,8192 --old .old 2>&1 | tee $OUT/attention.log
date +%T
for len in 0 32768; do
  for m in "gemma-4-31b --quantization int8" "qwen3-30b-a3b"; do
    tag=$(echo $m | cut -d' ' -f1)-$len; extra=""; [ $len -gt 0 ] && extra="--max-model-len $len"
    python3 bench/engine_bench.py run --model $m --batches 1 --repeats 3 --skip-offline --profile-batches "" $extra \
      --out /tmp/new-$tag 2>&1 | grep -v Warn > /tmp/new-$tag.log; cat /tmp/new-$tag.log >> $OUT/engine-new.log
    (cd .old && PYTHONPATH=/tmp/site:$PWD/src python3 bench/engine_bench.py run --model $m --batches 1 --repeats 3 \
      --skip-offline --profile-batches "" $extra --out /tmp/old-$tag) 2>&1 | grep -v Warn > /tmp/old-$tag.log
    cat /tmp/old-$tag.log >> $OUT/engine-old.log
    echo "$tag new: $(show < /tmp/new-$tag.log | tr '\n' ' ')"; echo "$tag old: $(show < /tmp/old-$tag.log | tr '\n' ' ')"
  done
done
date +%T
