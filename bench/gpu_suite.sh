#!/usr/bin/env bash
# The whole default GPU suite (`pytest -m gpu`; sweeps stay behind `slow`) in one device call, with the 25
# slowest tests. Run from the project root on the device machine with `.whl` carried (`bash bench/device_wheels.sh`
# fills it here: ../shared/device/wheels.sh's set plus llguidance, partial-json-parser, jsonschema and its deps, and
# msgspec, at uv.lock's versions for Python 3.12). The suite took 525 s of the 575 s `GPU_SUITE_SECONDS=575` allows
# (90 tests, 2026-12-04): one call. tests/backends/test_long_context_gpu.py (two fp32 tiny presets prefilled to their
# real models' longest context, 262,144 and 131,072 tokens) came after and has not run on the H200 yet: if the suite
# no longer fits, run that file in a call of its own.
# Only the folders holding GPU tests are collected: the device image lacks the HTTP tests' client packages.
# The log under $OUT names every test with its time as it ends, so a run cut by the call's limit still says where
# the time went.
set -o pipefail
. bench/kit/device_call.sh
start=$SECONDS
timeout "${GPU_SUITE_SECONDS:-560}" python3 -m pytest -m gpu -v -o console_output_style=times -p no:cacheprovider --durations=25 -W ignore \
  ${*:-tests/kernels tests/backends tests/actors tests/test_schedule_invariance.py} 2>&1 \
  | tee "${OUT:-/tmp}/gpu_suite.log" | tail -40
echo "gpu suite wall: $((SECONDS - start)) s"
