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
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODULES = ("decode_attention", "fused_moe", "gated_activation", "greedy_head", "kv_store", "moe_decode",
           "norm_add", "qk_norm_rope", "rmsnorm", "rope", "router", "streamed_linear")


def _test_helpers():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("cuda_backend_test", ROOT / "tests/backends/test_cuda_backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_mismatch(name: str, helpers, steps: int, second_pdl: bool = True) -> int | None:  # type: ignore[no-untyped-def]
    """The first step whose final hidden states differ between the pdl=False and pdl=``second_pdl`` runners (None:
    none). ``second_pdl=False`` is the control: two runners without PDL must agree, or the difference is not PDL's."""
    from inference_server.backends.cuda_backend import CudaModelRunner, CudaRunnerOptions

    dtype, device = torch.bfloat16, "cuda"
    spec, model = helpers.build(name, dtype, device)
    script = helpers.Script(spec, helpers.num_groups(spec), steps, seed=3, num_seqs=4, join=5, prompt_lens=(20, 60))
    n, m = len(script.seqs), script.blocks_per_seq
    runners, seen = {}, {}
    for use_pdl in (False, True):
        options = CudaRunnerOptions(max_model_len=m * helpers.BLOCK, max_batch_size=4, pdl=use_pdl and second_pdl)
        runner = CudaModelRunner(model, spec, helpers.storage_for(spec, n, m, dtype, device), torch.device(device),
                                 options)
        seen[use_pdl] = []
        forward = runner._forward

        def tapped(plan, forward=forward, out=seen[use_pdl]):  # type: ignore[no-untyped-def]
            hidden = forward(plan)
            out.append(hidden.detach().clone())
            return hidden

        runner._forward = tapped  # type: ignore[method-assign]
        runners[use_pdl] = runner
    for _ in range(steps + 1):
        plan = script.plan()
        off = helpers.tokens_of(runners[False])(plan)
        helpers.tokens_of(runners[True])(plan)
        rows = plan.num_tokens  # a decode graph's padding rows are garbage nobody reads (backends/cuda_graphs.py)
        if not torch.equal(seen[True][-1][:rows], seen[False][-1][:rows]):
            return int(script.step)
        script.advance(plan, off)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-4-26b-a4b")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    from inference_server.kernels import pdl

    if not pdl.pdl_supported():
        raise SystemExit("PDL needs an sm_90+ GPU and a Triton with launch_pdl")
    helpers = _test_helpers()
    off_launch = {"USE_PDL": False}
    control = first_mismatch(args.model, helpers, args.steps, second_pdl=False)
    print("PDL_BISECT " + json.dumps({"model": args.model, "excluded": "control: PDL off in both runners",
                                      "first_mismatch_step": control}), flush=True)
    for excluded in (None, "every module", *MODULES):
        patched = []
        for name in (MODULES if excluded == "every module" else () if excluded is None else (excluded,)):
            module = importlib.import_module(f"inference_server.kernels.{name}")
            patched.append((module, module.pdl_launch))
            module.pdl_launch = lambda: dict(off_launch)  # type: ignore[attr-defined]
        try:
            step = first_mismatch(args.model, helpers, args.steps)
        finally:
            for module, original in patched:
                module.pdl_launch = original  # type: ignore[attr-defined]
            pdl.use_pdl(False)
        print("PDL_BISECT " + json.dumps({"model": args.model, "excluded": excluded, "first_mismatch_step": step}),
              flush=True)


if __name__ == "__main__":
    main()
