"""Edit one entry of a tuned linear config file in place, to time a config inside the decode graph (with
``engine_bench.py``) before keeping it: isolated sweeps time a kernel back to back with itself, and in the PDL
graph a kernel's neighbours change what pays (docs/benchmarks.md: the reverted 31B re-tuning).

  python3 bench/set_linear_config.py int8 5376 8192 1 num_stages=2 block_n=4 num_warps=2

edits ``N=5376,K=8192`` (bf16 activations, this GPU's name) at token count 1 in
``src/inference_server/kernels/configs/int8_linear/`` (``dense`` for ``dense_linear/``) and prints the entry before
and after. Run it on a copy of the tree (the device machine's); keep an edit by writing it into the repo by hand
or by re-sweeping.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inference_server.kernels.int8_linear_configs import (
    CONFIG_DIR,
    DENSE_CONFIG_DIR,
    config_file_name,
    config_from_json,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("int8", "dense"))
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("tokens", type=int)
    parser.add_argument("fields", nargs="+", help="name=value pairs of Int8LinearConfig fields")
    parser.add_argument("--device-name", default=None, help="default: this GPU's name")
    args = parser.parse_args()
    device = args.device_name or torch.cuda.get_device_name()
    directory = CONFIG_DIR if args.kind == "int8" else DENSE_CONFIG_DIR
    path = directory / config_file_name(device, args.n, args.k, torch.bfloat16)
    body = json.loads(path.read_text())
    entry = dict(body["configs"][str(args.tokens)])
    before = dict(entry)
    for field in args.fields:
        name, _, value = field.partition("=")
        if name not in entry:
            raise SystemExit(f"{path.name}: no field {name!r} in {entry}")
        entry[name] = int(value)
    config_from_json(entry)  # a malformed entry fails here, not at the engine's start
    body["configs"][str(args.tokens)] = entry
    path.write_text(json.dumps(body, indent=1) + "\n")
    print(f"{path.name} T={args.tokens}: {before} -> {entry}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
