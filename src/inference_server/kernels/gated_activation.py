"""Triton gated activation: ``act(gate) * up`` in one launch (two elementwise kernels in PyTorch).

The MLP of every Gemma 4 layer (and its per-layer-input gate on E2B/E4B) computes ``act(gate) * up``; PyTorch
runs the activation and the product as two kernels, each rounding to the activation dtype. This kernel keeps
both roundings, so it gives PyTorch's result: ``a = act(float(gate))`` rounded to the output dtype, then
``float(a) * float(up)`` rounded again. Activations: ``gelu_tanh`` (``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
x^3)))``, tanh from CUDA's ``tanhf`` through libdevice, the function PyTorch's kernel calls: a tanh built
from ``exp`` differs from it by up to ~1e-7 near -1, which moves ``1 + tanh`` in the negative tail by half a bf16
ulp and changed ~3 % of bf16 outputs on the H200; the interpreter, which has no libdevice, builds it from
``exp(-2|y|)``) and ``silu`` (``x * sigmoid(x)``); the fp32 results can differ from
PyTorch's by a few ulp (the transcendental functions), which the rounding to bf16 almost always absorbs.

``gate`` and ``up`` are ``[T, I]`` with any row stride and a contiguous last dim, e.g. the two halves of a
fused gate/up GEMM's output.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait

__all__ = ["SUPPORTED", "gated_activation", "gated_product"]

SUPPORTED = ("gelu_tanh", "silu")
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a compiled kernel reads only constexpr globals
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["n_rows"])
def _gated_activation_kernel(
    gate_ptr, up_ptr, out_ptr,  # [T, I]
    n_rows, width, stride_gate, stride_up, stride_out,
    GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE_TANH: tl.constexpr,  # False only under the interpreter
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): gate and up are the previous GEMM's output, so wait before the first load and store; a short
    # kernel, so release the next launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    y = gated_product(g, u, out_ptr.dtype.element_ty, GELU_TANH, LIBDEVICE_TANH)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_product(g, u, OUT_DTYPE: tl.constexpr, GELU_TANH: tl.constexpr, LIBDEVICE_TANH: tl.constexpr):
    """``act(g) * u`` in fp32 for fp32 ``g``/``u`` holding values of ``OUT_DTYPE``, with PyTorch's first rounding
    (``act(g)`` to ``OUT_DTYPE``) done; the caller rounds the product when it stores it. Shared by this kernel and
    the gate/up GEMV's gated epilogue (``int8_gemv``), so the two give the same bits."""
    if GELU_TANH:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        if LIBDEVICE_TANH:
            tanh = libdevice.tanh(inner)
        else:
            e = tl.exp(-2.0 * tl.abs(inner))  # in (0, 1]: no overflow at any input
            tanh = tl.where(inner >= 0, (1.0 - e) / (1.0 + e), (e - 1.0) / (1.0 + e))
        a = 0.5 * g * (1.0 + tanh)
    else:
        a = g * tl.sigmoid(g)
    a = a.to(OUT_DTYPE).to(tl.float32)  # PyTorch rounds act(gate) before the product
    return a * u


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for ``[T, I]`` inputs of one dtype (see the module docstring)."""
    if act not in SUPPORTED:
        raise ValueError(f"gated_activation supports {SUPPORTED}, not {act!r}")
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must be [T, I] of one dtype, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("gate and up need a contiguous last dim")
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    if rows == 0 or width == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    _gated_activation_kernel[(rows, triton.cdiv(width, block))](
        gate, up, out, rows, width, gate.stride(0), up.stride(0), out.stride(0),
        GELU_TANH=act == "gelu_tanh", BLOCK=block, LIBDEVICE_TANH=not _INTERPRETED, **pdl_launch(),
    )
    return out
