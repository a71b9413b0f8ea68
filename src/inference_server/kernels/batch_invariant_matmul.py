"""A batch-invariant Triton GEMM for ``DETERMINISTIC=true`` on CUDA: ``y = x @ weight.T (+ bias)`` whose every output
row is bitwise the same whatever the number of rows ``M`` and whatever the other rows hold.

Contract (``torch.nn.functional.linear`` is the reference): ``x [M, K]``, ``weight [N, K]`` (any strides, one float
dtype), ``bias [N]`` or None; products accumulated in fp32 by ``tl.dot`` over K in ``BLOCK_K`` steps from k = 0
upwards (no TF32 for fp32 inputs), rounded once to x's dtype.

Why it is invariant: one tile configuration for every shape (``CONFIG``: no M buckets, no autotuning, no split-K),
and a program's K loop visits the same K blocks in the same order whichever M-tile the row sits in; rows of a tile
do not interact in ``tl.dot``. What the default path does instead: cuBLAS picks a kernel (and a split-K) by M, and
the engine's Triton GEMV takes small M with a split-K chosen by shape (``kernels.dense_linear``).

The price is speed at decode: a 64-row tile for one token wastes the tensor cores' rows, and without split-K a
narrow N runs few programs (docs/architecture.md, Deterministic inference; bench figures in docs/benchmarks.md).
"""

from __future__ import annotations

import os

import attrs
import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@attrs.frozen
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


CONFIG = MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
"""The one tile configuration: every M, N and K runs it (what makes the rows invariant)."""


@triton.jit
def _invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                             stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                             HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 operands' raw bits in tl.dot: fp32 there (never compiled in)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP32_DOT:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.LinearFn``: ``F.linear(x, weight, bias)`` for ``x [..., K]``, batch-invariant per row (module doc)."""
    flat = x.reshape(-1, x.shape[-1])
    m, k = flat.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        c = CONFIG
        grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n))
        _invariant_matmul_kernel[grid](
            flat, weight, bias if bias is not None else weight, y, m, n, k,
            flat.stride(0), flat.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
            HAS_BIAS=bias is not None, FP32_DOT=x.dtype == torch.float32,
            UPCAST=_INTERPRETED and x.dtype != torch.float32,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    return y.reshape(*x.shape[:-1], n)
