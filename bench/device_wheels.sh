#!/usr/bin/env bash
# Fill .whl/ with every wheel a device call needs (carry ".whl"): ../shared/device/wheels.sh's set, then the
# packages the GPU tests and the engine split import that the device image lacks, at the versions uv.lock pins,
# for the device's Python 3.12. llguidance ships only a cp39-abi3 manylinux_2_31 wheel for x86_64, which
# wheels.sh's platform list does not take, so it is fetched apart. Run from the project root.
set -euo pipefail
bash ../shared/device/wheels.sh >/dev/null
pin() { python3 -c "import sys, tomllib; lock = tomllib.load(open('uv.lock', 'rb'))
print(next(p['version'] for p in lock['package'] if p['name'] == sys.argv[1]))" "$1"; }
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl "$@"; }
get --abi abi3 --platform manylinux_2_31_x86_64 "llguidance==$(pin llguidance)"
for p in partial-json-parser jsonschema jsonschema-specifications referencing rpds-py msgspec; do
  get --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "$p==$(pin $p)"
done
# py-spy (not a project dependency): a sampling profile of the serving processes on the device's host CPU
# (`/tmp/site/bin/py-spy record --subprocesses -f raw ...`), where the engine process's per-step host work shows.
get --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 py-spy==0.4.3
ls .whl | wc -l
