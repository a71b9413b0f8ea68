#!/usr/bin/env python3
"""What each small launch of a decode step costs inside the graph: time the step with one op taken out.

An upper bound for a fusion: if taking a launch out of the step entirely (its op replaced by one that returns its
inputs, so later kernels read stale or random data) saves X µs per step, fusing that launch into a neighbour
saves at most X. ``empty-*`` keeps a launch that does nothing but the PDL wait and release, so the difference to
``no-*`` is the launch boundary alone and to the full op the op's own work. The results are wrong numbers by
design: the ablations only time; nothing here checks or serves.

Ablations (comma separated ``--ablations``; ``none`` is the engine as it is):

* ``no-norm-add``: Gemma's sandwich ``ops.norm_add`` returns the residual (or its input) as the new hidden state and as
  every out norm: no launch.
* ``empty-norm-add``: the same, after an empty PDL launch.
* ``no-qk-norm``: the attention's q/k norm + RoPE (+ KV store) returns the raw q/k/v: no launch, nothing stored.
* ``no-attention``: the decode attention returns q (or the output buffer it was given): no launch.
* ``empty-attention``: the same, after an empty PDL launch.
* ``attention-1split``, ``attention-4split``, ``attention-16split``: the decode attention with that many KV splits
  (the engine picks them from the batch, the heads and the model length).
* ``attention-no-pdl``: the decode attention launched without PDL (the other kernels keep it).
* ``attention-stages1``, ``attention-block16``, ``attention-block16-stages1``: the decode attention with one
  pipeline stage and / or 16-key tiles (less shared memory a program).

  python3 bench/ablate_decode.py --model gemma-4-31b --quantization int8 --out $OUT/abl
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_bench
from inference_server.backends.cuda import attention_ops, runner
from inference_server.kernels.decode_attention import paged_decode_attention as _paged_decode_attention
from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_requested, pdl_wait, use_pdl


@triton.jit
def _empty_kernel(x_ptr, USE_PDL: tl.constexpr = False):
    """Nothing but the PDL wait and release (x is never read)."""
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)


def _empty_launch(like: torch.Tensor) -> None:
    _empty_kernel[(1,)](like, num_warps=4, **pdl_launch())


def _skip_norm_add(empty: bool):
    def norm_add(a: torch.Tensor, a_norm, b=None, b_norm=None, *, sum_norm=None, residual=None, scale=None,
                 out_norms: Sequence = ()) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if empty:
            _empty_launch(a)
        # the residual stream, unchanged, as the new hidden state and every out norm: finite values (the greedy
        # tokens fed back must stay valid ids), no launch
        kept = residual if residual is not None else a
        return kept, tuple(kept for _ in out_norms)
    return norm_add


def _skip_qk_norm_store(q_raw, k_raw, v_raw, q_norm, k_norm, v_norm, cos, sin, k_cache, v_cache, slot_mapping):
    return q_raw, k_raw, v_raw if v_raw is not None else k_raw


def _splits_attention(num_splits: int):
    def attention(*args: object, **kwargs: object) -> torch.Tensor:
        kwargs.pop("num_splits", None)
        return _paged_decode_attention(*args, num_splits=num_splits, **kwargs)  # type: ignore[arg-type]
    return attention


def _configured_attention(pdl: bool = True, **config: int):
    """The decode attention with ``config`` (``block_n``, ``num_stages``) and, with ``pdl`` False, launched without
    programmatic dependent launch (the rest of the step keeps it)."""
    def attention(*args: object, **kwargs: object) -> torch.Tensor:
        previous = use_pdl(pdl and pdl_requested())
        try:
            return _paged_decode_attention(*args, **kwargs, **config)  # type: ignore[arg-type]
        finally:
            use_pdl(previous)
    return attention


def _empty_attention(q: torch.Tensor, *args: object, out: torch.Tensor | None = None,
                     **kwargs: object) -> torch.Tensor:
    _empty_launch(q)
    return out if out is not None else q


def _skip_attention(q: torch.Tensor, *args: object, out: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
    # q itself (finite, the output's shape): no launch, and the greedy tokens fed back stay valid ids
    if out is not None:
        return out
    return q


@contextlib.contextmanager
def ablated(name: str) -> Iterator[None]:
    """Patch the CUDA runner's module functions for one ablation (the runner binds them when it is built; the decode
    attention also where ``attention_ops`` calls it)."""
    patches = {
        "none": {},
        "no-norm-add": {"triton_norm_add": _skip_norm_add(False)},
        "empty-norm-add": {"triton_norm_add": _skip_norm_add(True)},
        "no-qk-norm": {"triton_qk_norm_rope_store": _skip_qk_norm_store},
        "no-attention": {"paged_decode_attention": _skip_attention},
        "empty-attention": {"paged_decode_attention": _empty_attention},
        "attention-1split": {"paged_decode_attention": _splits_attention(1)},
        "attention-4split": {"paged_decode_attention": _splits_attention(4)},
        "attention-16split": {"paged_decode_attention": _splits_attention(16)},
        "attention-no-pdl": {"paged_decode_attention": _configured_attention(pdl=False)},
        "attention-stages1": {"paged_decode_attention": _configured_attention(num_stages=1)},
        "attention-block16": {"paged_decode_attention": _configured_attention(block_n=16)},
        "attention-block16-stages1": {"paged_decode_attention": _configured_attention(block_n=16, num_stages=1)},
    }[name]
    modules = [m for m in (runner, attention_ops) for attr in patches if hasattr(m, attr)]
    saved = [(m, attr, getattr(m, attr)) for m in dict.fromkeys(modules) for attr in patches if hasattr(m, attr)]
    try:
        for m, attr, _ in saved:
            setattr(m, attr, patches[attr])
        yield
    finally:
        for m, attr, fn in saved:
            setattr(m, attr, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ablations", default="none,no-norm-add,empty-norm-add,no-qk-norm,no-attention")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="none", choices=("none", "int8"))
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--smoke", action="store_true", help="the -tiny preset on the CPU interpreter (checks the script)")
    a = ap.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.ablations.split(","):
        engine_bench.VARIANTS.setdefault(name, {})
        with ablated(name):
            engine_bench.bench_decode(a.model, a.model + ("-tiny" if a.smoke else ""),
                                      [int(b) for b in a.batches.split(",")], a.context, a.steps,
                                      a.out, device, (name,), a.repeats, a.quantization, (1,),
                                      max_model_len=a.max_model_len)


if __name__ == "__main__":
    main()
