#!/usr/bin/env bash
# Session 10, device call 4: the one-launch experts with fewer, wider down programs (64-256 rows),
# against the atomic spin with tickets and the two launches; bench/moe_decode.py at 1 and 2 tokens.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
date +%T
timeout 100 python3 -m pytest -q -x tests/kernels/test_moe_decode_one_launch.py -k "gpu" 2>&1 | grep -v "Warn\|warn" | tail -2
timeout $((280 - SECONDS)) python3 bench/moe_decode.py --tokens 1,2 --reps 10 > $OUT/moe_decode.md 2> $OUT/moe_decode.err
cat $OUT/moe_decode.md; grep "one launch" $OUT/moe_decode.err | sed 's/OneLaunchConfig//; s/gate_up_block_n=16, gate_up_block_k=256, //'
date +%T
