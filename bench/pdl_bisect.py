#!/usr/bin/env python3
"""Which kernel module's programmatic dependent launch changes a model's results (a GPU diagnosis script).

``tests/backends/test_pdl_runner.py`` runs two CUDA runners, ``pdl`` off and on, through the same teacher-forced
steps of a model cut to 2 layers and requires bitwise equal hidden states. When that fails, this script repeats the
comparison once per kernel module with that module's launches kept off PDL (its ``pdl_launch`` patched to the
off launch), and once with every module on. A module whose exclusion makes the runs equal is one side of the race:
the kernel that reads or writes before its wait, or the one that releases its dependents too early.

  python3 bench/pdl_bisect.py --model gemma-4-26b-a4b      # on the H200: ~1-2 min

Prints one line per run: ``PDL_BISECT {"excluded": module, "first_mismatch_step": n or null}``; first a control
with PDL off in both runners, and a run with every module kept off PDL (the runner's ``pdl`` option still on).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from runner_determinism import compare, runner_test_helpers  # noqa: E402  (bench/ is on the path)

MODULES = ("decode_attention", "fused_moe", "gated_activation", "greedy_head", "kv_store", "moe_decode",
           "norm_add", "qk_norm_rope", "rmsnorm", "rope", "router", "streamed_linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-4-26b-a4b")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    from inference_server.kernels import pdl

    if not pdl.pdl_supported():
        raise SystemExit("PDL needs an sm_90+ GPU and a Triton with launch_pdl")
    helpers = runner_test_helpers()
    off_launch = {"USE_PDL": False}
    control = compare(args.model, helpers, args.steps, {"pdl": False})["first_mismatch_step"]
    print("PDL_BISECT " + json.dumps({"model": args.model, "excluded": "control: PDL off in both runners",
                                      "first_mismatch_step": control}), flush=True)
    for excluded in (None, "every module", *MODULES):
        patched = []
        for name in (MODULES if excluded == "every module" else () if excluded is None else (excluded,)):
            module = importlib.import_module(f"inference_server.kernels.{name}")
            patched.append((module, module.pdl_launch))
            module.pdl_launch = lambda: dict(off_launch)  # type: ignore[attr-defined]
        try:
            step = compare(args.model, helpers, args.steps, {"pdl": False}, {"pdl": True})["first_mismatch_step"]
        finally:
            for module, original in patched:
                module.pdl_launch = original  # type: ignore[attr-defined]
            pdl.use_pdl(False)
        print("PDL_BISECT " + json.dumps({"model": args.model, "excluded": excluded, "first_mismatch_step": step}),
              flush=True)


if __name__ == "__main__":
    main()
