#!/usr/bin/env bash
# The whole default GPU suite (`pytest -m gpu`; sweeps stay behind `slow`) in one device call, with the 25
# slowest tests. Run from the project root on the device machine with `.whl` carried (`bash bench/device_wheels.sh`
# fills it here: ../shared/device/wheels.sh's set plus llguidance, partial-json-parser, jsonschema and its deps, and
# msgspec, at uv.lock's versions for Python 3.12). The suite, tests/backends/test_long_context_gpu.py included (two fp32
# tiny presets prefilled to their real models' longest context, 262,144 and 131,072 tokens: 13 and 4 s), took 503 s
# of the 570 s `GPU_SUITE_SECONDS=570` allows (92 tests, 2026-12-05): one call.
# Only the folders holding GPU tests are collected: the device image lacks the HTTP tests' client packages.
# The log under $OUT names every test with its time as it ends, so a run cut by the call's limit still says where
# the time went.
set -o pipefail
. bench/kit/device_call.sh
start=$SECONDS
timeout "${GPU_SUITE_SECONDS:-560}" python3 -m pytest -m gpu -v -o console_output_style=times -p no:cacheprovider --durations=25 -W ignore \
  ${*:-tests/kernels tests/backends tests/actors tests/test_schedule_invariance.py tests/test_deterministic_cuda.py} 2>&1 \
  | tee "${OUT:-/tmp}/gpu_suite.log" | tail -40
echo "gpu suite wall: $((SECONDS - start)) s"
