#!/usr/bin/env python3
"""Do two CUDA runners with the same options compute bitwise equal steps? Which option makes them differ?

The engine promises that a step's result depends only on its inputs (``schedule_invariance.py``): two runners over
the same model, fed the same teacher-forced plans (``tests/backends/test_cuda_backend.Script``: prefill three
prompts, decode, a fourth joins later), must give bitwise equal hidden states on the plans' rows. This GPU
diagnosis script checks that once with the default options and once per variant below (one lever switched off
each); a variant whose runners agree while the default's do not names the part that is not deterministic.

  python3 bench/runner_determinism.py --model gemma-4-26b-a4b     # on the H200: ~4 s a variant

Prints one line per variant: ``DETERMINISM {"variant": ..., "first_mismatch_step": n or null, "max_abs_diff": x,
"rows": [...]}`` (the differing rows of the first mismatching step).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "eager (no CUDA graphs)": {"cuda_graphs": False},
    "reference ops": {"reference_ops": True},
    "attention merge in its own launch": {"_fused_reduce": False},
}


def runner_test_helpers():  # type: ignore[no-untyped-def]
    """``tests/backends/test_cuda_backend.py`` as a module: its model builder, storage and teacher-forced
    ``Script`` (also used by ``pdl_bisect.py``)."""
    spec = importlib.util.spec_from_file_location("cuda_backend_test", ROOT / "tests/backends/test_cuda_backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(name: str, helpers, steps: int, options: dict[str, Any],  # type: ignore[no-untyped-def]
            second: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run two runners with ``options`` through the same plans (the second with ``second`` on top, e.g. PDL on);
    the first step whose plan rows differ, or ``{"first_mismatch_step": None}``."""
    from inference_server.backends.cuda.options import CudaRunnerOptions
    from inference_server.backends.cuda.runner import CudaModelRunner
    from inference_server.kernels import decode_attention

    options = dict(options)
    max_fused_heads = decode_attention._MAX_FUSED_HEADS
    if not options.pop("_fused_reduce", True):  # the merge in the reduce kernel, as past _MAX_FUSED_HEADS kv heads
        decode_attention._MAX_FUSED_HEADS = 0
    try:
        dtype, device = torch.bfloat16, "cuda"
        spec, model = helpers.build(name, dtype, device)
        script = helpers.Script(spec, helpers.num_groups(spec), steps, seed=3, num_seqs=4, join=5,
                                prompt_lens=(20, 60))
        n, m = len(script.seqs), script.blocks_per_seq
        runners, seen = [], []
        for extra in ({}, second or {}):
            runner = CudaModelRunner(model, spec, helpers.storage_for(spec, n, m, dtype, device), torch.device(device),
                                     CudaRunnerOptions(max_model_len=m * helpers.BLOCK, max_batch_size=4,
                                                       **(options | extra)))
            out: list[torch.Tensor] = []
            forward = runner._forward

            def tapped(plan, forward=forward, out=out):  # type: ignore[no-untyped-def]
                hidden = forward(plan)
                out.append(hidden.detach().clone())
                return hidden

            runner._forward = tapped  # type: ignore[method-assign]
            runners.append(runner)
            seen.append(out)
        for _ in range(steps + 1):
            plan = script.plan()
            first = helpers.tokens_of(runners[0])(plan)
            helpers.tokens_of(runners[1])(plan)
            rows = plan.num_tokens  # a decode graph's padding rows are garbage nobody reads
            a, b = seen[0][-1][:rows].float(), seen[1][-1][:rows].float()
            if not torch.equal(a, b):
                differ = (a != b).any(dim=1).nonzero().flatten().tolist()
                return {"first_mismatch_step": int(script.step), "max_abs_diff": float((a - b).abs().max()),
                        "tokens": rows, "rows": differ[:16]}
            script.advance(plan, first)
        return {"first_mismatch_step": None}
    finally:
        decode_attention._MAX_FUSED_HEADS = max_fused_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-4-26b-a4b")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma separated names from VARIANTS")
    args = parser.parse_args()
    helpers = runner_test_helpers()
    for variant in args.variants.split(","):
        result = compare(args.model, helpers, args.steps, VARIANTS[variant])
        print("DETERMINISM " + json.dumps({"model": args.model, "variant": variant, **result}), flush=True)


if __name__ == "__main__":
    main()
