"""A batch-invariant Triton GEMM for ``DETERMINISTIC=true`` on CUDA: ``y = x @ weight.T (+ bias)`` whose every output
row is bitwise the same whatever the number of rows ``M`` and whatever the other rows hold.

Contract (``torch.nn.functional.linear`` is the reference): ``x [M, K]``, ``weight [N, K]`` (any strides, one float
dtype), ``bias [N]`` or None; products accumulated in fp32 by ``tl.dot`` over K in ``BLOCK_K`` steps from k = 0
upwards (no TF32 for fp32 inputs), rounded once to x's dtype.

Why it is invariant: one tile configuration for every shape (``CONFIG``: no M buckets, no autotuning), and a split
of K that depends on N and K alone (``split_k``): a program sums its K blocks from its split's first upwards, the
splits' fp32 partials are added in split order by a second kernel, and rows of a tile do not interact in ``tl.dot``.
So a row's arithmetic is the same whichever M-tile it sits in and however many rows the call has. What the default
path does instead: cuBLAS picks a kernel (and a split-K) by M, and the engine's Triton GEMV takes small M with its
own reduction (``kernels.dense_linear``).

Why split K: at decode a call has one M-tile, so without a split a projection of narrow N runs N / BLOCK_N programs
(22 for a 2,816-wide output) and reads its weight far below the memory bandwidth. Small calls therefore give each
split a program of its own and sum the fp32 partials in a second launch; large calls (a prefill chunk), whose tiles
already fill the GPU, run one program per tile that accumulates each split from zero in turn and adds it to the
running total in split order. Both compute ``((0 + p_0) + p_1) + ... + bias`` with the same ``p_s``, so which one a
call takes (by its size) changes no bit; the second costs no workspace and no extra launch.
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
TARGET_PROGRAMS = 256
"""Programs one M-tile's call aims at (``split_k``): enough to spread a decode GEMM's weight read over the GPU."""
MAX_SPLIT = 16
ONE_LAUNCH_TILES = TARGET_PROGRAMS
"""Calls with at least this many output tiles (or one split) run every split in one program, in one launch."""


def split_k(n: int, k: int, config: MatmulConfig = CONFIG) -> int:
    """How many K ranges a ``[*, K] @ [K, N]`` product is cut into: a function of N and K only (never of M, which
    would make a row's sum depend on its batch), ~``TARGET_PROGRAMS`` programs per M-tile, at least one K block each."""
    n_tiles = triton.cdiv(n, config.block_n)
    k_blocks = triton.cdiv(k, config.block_k)
    return max(1, min(k_blocks, MAX_SPLIT, triton.cdiv(TARGET_PROGRAMS, n_tiles)))


@triton.jit
def _invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, K_PER_SPLIT, SPLITS,
                             stride_xm, stride_xk, stride_wn, stride_wk, stride_ys, stride_ym, stride_yn,
                             HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
                             ALL_SPLITS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile. ``ALL_SPLITS``: the program sums the ``SPLITS`` K ranges of
    ``K_PER_SPLIT`` in order, each from zero, adds the bias and stores the output. Otherwise it computes the one
    range of ``program_id(2)``: with one split the output itself (bias added, cast), else fp32 partials at
    ``y_ptr + split * stride_ys``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if ALL_SPLITS:
        first, last = 0, SPLITS
    else:
        first = tl.program_id(2)
        last = first + 1
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for split in range(first, last):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * K_PER_SPLIT
        k_end = tl.minimum(K, k_start + K_PER_SPLIT)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0.0)
            if UPCAST:  # the interpreter multiplies bf16 operands' raw bits in tl.dot: fp32 there (never compiled in)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if FP32_DOT:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        total += acc
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr if ALL_SPLITS else y_ptr + first * stride_ys
    tl.store(out + rm[:, None] * stride_ym + rn[None, :] * stride_yn, total.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, M, N, SPLITS, stride_ys, stride_ym, stride_out_m, stride_out_n,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``y = sum over splits in split order (+ bias)``, fp32, cast once: partials ``[SPLITS, M, N]`` contiguous."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    row = offs // N
    col = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + s * stride_ys + row * stride_ym + col, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_out_m + col * stride_out_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.LinearFn``: ``F.linear(x, weight, bias)`` for ``x [..., K]``, batch-invariant per row (module doc)."""
    flat = x.reshape(-1, x.shape[-1])
    m, k = flat.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        c = CONFIG
        k_per_split = triton.cdiv(triton.cdiv(k, c.block_k), split_k(n, k)) * c.block_k
        splits = triton.cdiv(k, k_per_split)  # no empty split
        tiles = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n))
        flags = dict(FP32_DOT=x.dtype == torch.float32, UPCAST=_INTERPRETED and x.dtype != torch.float32,
                     BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
                     num_stages=c.num_stages)
        b = bias if bias is not None else weight
        if splits == 1 or tiles[0] * tiles[1] >= ONE_LAUNCH_TILES:  # one launch (module doc: the same bits)
            _invariant_matmul_kernel[(*tiles, 1)](
                flat, weight, b, y, m, n, k, k_per_split, splits, flat.stride(0), flat.stride(1), weight.stride(0),
                weight.stride(1), 0, y.stride(0), y.stride(1), HAS_BIAS=bias is not None, ALL_SPLITS=True, **flags)
        else:
            partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
            _invariant_matmul_kernel[(*tiles, splits)](
                flat, weight, b, partials, m, n, k, k_per_split, splits, flat.stride(0), flat.stride(1),
                weight.stride(0), weight.stride(1), partials.stride(0), partials.stride(1), partials.stride(2),
                HAS_BIAS=False, ALL_SPLITS=False, **flags)
            block = 1024
            _sum_splits_kernel[(triton.cdiv(m * n, block),)](
                partials, b, y, m, n, splits, partials.stride(0), partials.stride(1), y.stride(0), y.stride(1),
                HAS_BIAS=bias is not None, BLOCK=block)
    return y.reshape(*x.shape[:-1], n)
