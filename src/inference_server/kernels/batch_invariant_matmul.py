"""A batch-invariant Triton GEMM for ``DETERMINISTIC=true`` on CUDA: ``y = x @ weight.T (+ bias)`` whose every output
row is bitwise the same whatever the number of rows ``M`` and whatever the other rows hold.

Contract (``torch.nn.functional.linear`` is the reference): ``x [M, K]``, ``weight [N, K]`` (any strides, one float
dtype), ``bias [N]`` or None; products accumulated in fp32 by ``tl.dot`` over K in ``BLOCK_K`` steps from k = 0
upwards (no TF32 for fp32 inputs), rounded once to x's dtype.

Why it is invariant: one tile configuration for every shape (``CONFIG``: no M buckets, no autotuning), and a split
of K that depends on N and K alone (``split_k``): each split's fp32 partial is summed over its K blocks from its
first upwards, the partials are added from zero in split order, and rows of a tile do not interact in ``tl.dot``.
So a row's arithmetic is the same whichever M-tile it sits in and however many rows the call has. What the default
path does instead: cuBLAS picks a kernel (and a split-K) by M, and the engine's Triton GEMV takes small M with its
own reduction (``kernels.dense_linear``).

Why split K: at decode a call has one M-tile, so without a split a projection of narrow N runs N / BLOCK_N programs
(22 for a 2,816-wide output) and reads its weight far below the memory bandwidth. Small calls (fewer than
``ONE_LAUNCH_TILES`` tiles) therefore give each split a program of its own, which stores its fp32 partial to a
per-call workspace and counts itself in on the tile's arrival counter (``kernels.arrival_counters``); the tile's
last program to arrive folds the tile's partials from zero in split order, adds the bias, stores the output and
puts the counter back to zero, in the same launch. Large calls (a prefill chunk), whose tiles already fill the GPU,
run one program per tile that accumulates each split from zero in turn and adds it to the running total in split
order. Both compute ``((0 + p_0) + p_1) + ... + bias`` in fp32 with the same ``p_s``, rounded once, so which one a
call takes (by its size) changes no bit, nor does which split program happens to arrive last; the second needs no
workspace and no counters. Two split launches must not run concurrently (one stream: the counters are shared), and
the first split launch on a device must not be inside a CUDA graph capture (the runners' eager warm-up of each
bucket comes first).
"""

from __future__ import annotations

import os

import attrs
import torch
import triton
import triton.language as tl

from inference_server.kernels.arrival_counters import arrival_counters

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
"""Calls with at least this many output tiles (or one split) run every split in one program; smaller calls give
each split a program and fold the partials in the tile's last one."""
FOLD_COUNTERS = ONE_LAUNCH_TILES
"""Arrival counters of the split launch, one per output tile: its calls have fewer tiles than ``ONE_LAUNCH_TILES``."""


def split_k(n: int, k: int, config: MatmulConfig = CONFIG) -> int:
    """How many K ranges a ``[*, K] @ [K, N]`` product is cut into: a function of N and K only (never of M, which
    would make a row's sum depend on its batch), ~``TARGET_PROGRAMS`` programs per M-tile, at least one K block each."""
    n_tiles = triton.cdiv(n, config.block_n)
    k_blocks = triton.cdiv(k, config.block_k)
    return max(1, min(k_blocks, MAX_SPLIT, triton.cdiv(TARGET_PROGRAMS, n_tiles)))


@triton.jit
def _store_output(total, b_ptr, y_ptr, rm, rn, tile_mask, N, stride_ym, stride_yn, HAS_BIAS: tl.constexpr):
    """``total (+ bias)`` in fp32, rounded once to y's dtype and stored: both paths' last step, one code."""
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, total.to(y_ptr.dtype.element_ty),
             mask=tile_mask)


@triton.jit
def _invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, counter_ptr, M, N, K, K_PER_SPLIT, SPLITS,
                             stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                             stride_ps, stride_pm, stride_pn,
                             HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
                             ALL_SPLITS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile. ``ALL_SPLITS``: the program sums the ``SPLITS`` K ranges of
    ``K_PER_SPLIT`` in order, each from zero, adds the bias and stores the output (``part_ptr`` and
    ``counter_ptr`` unused). Otherwise (``SPLITS > 1``) it computes the one range of ``program_id(2)``, stores its
    fp32 partial at ``part_ptr + split * stride_ps``, and the tile's last program to arrive (its int32 counter at
    ``counter_ptr + pid_m * num_programs(1) + pid_n``, zero before the launch and put back to zero) folds the
    tile's partials in split order from zero, adds the bias and stores the output."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    tile_mask = (rm[:, None] < M) & (rn[None, :] < N)
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
    if ALL_SPLITS:
        _store_output(total, b_ptr, y_ptr, rm, rn, tile_mask, N, stride_ym, stride_yn, HAS_BIAS)
    else:
        # ``total`` (``0 + p_s``; the compiler reads no loop variable after its loop) has ``p_s``'s bits but for a -0
        # made +0, which changes no sum started at +0: such a sum is never -0, and x + 0 == x + -0 for every x but -0
        tile = rm[:, None] * stride_pm + rn[None, :] * stride_pn
        tl.store(part_ptr + first * stride_ps + tile, total, mask=tile_mask)
        # Each split program counts itself in; the last to arrive folds (as invariant_decode_attention's fused
        # fold: the barrier puts this program's partial stores before the counter's release, acq_rel at GPU scope;
        # the last program's acquire makes the others' visible, and its loads bypass L1).
        tl.debug_barrier()
        counter = counter_ptr + pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1)
        if arrived == SPLITS - 1:
            folded = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in range(0, SPLITS):  # from zero in split order: ALL_SPLITS's ``total``, the same bits
                folded += tl.load(part_ptr + split * stride_ps + tile, mask=tile_mask, other=0.0,
                                  cache_modifier=".cg")
            _store_output(folded, b_ptr, y_ptr, rm, rn, tile_mask, N, stride_ym, stride_yn, HAS_BIAS)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (stream order keeps launches apart)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.LinearFn``: ``F.linear(x, weight, bias)`` for ``x [..., K]``, batch-invariant per row (module doc)."""
    flat = x.reshape(-1, x.shape[-1])
    m, k = flat.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        c = CONFIG
        k_per_split = triton.cdiv(triton.cdiv(k, c.block_k), split_k(n, k, c)) * c.block_k
        splits = triton.cdiv(k, k_per_split)  # no empty split
        tiles = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n))
        flags = dict(FP32_DOT=x.dtype == torch.float32, UPCAST=_INTERPRETED and x.dtype != torch.float32,
                     BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
                     num_stages=c.num_stages)
        b = bias if bias is not None else weight
        if splits == 1 or tiles[0] * tiles[1] >= ONE_LAUNCH_TILES:  # every split in one program (module doc)
            _invariant_matmul_kernel[(*tiles, 1)](
                flat, weight, b, y, y, y, m, n, k, k_per_split, splits, flat.stride(0), flat.stride(1),
                weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), 0, 0, 0,
                HAS_BIAS=bias is not None, ALL_SPLITS=True, **flags)
        else:  # a program a split, the tile's last to arrive folds: still one launch
            assert tiles[0] * tiles[1] <= FOLD_COUNTERS, (tiles, FOLD_COUNTERS)
            partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
            counters = arrival_counters("batch_invariant_matmul", FOLD_COUNTERS, x.device)
            _invariant_matmul_kernel[(*tiles, splits)](
                flat, weight, b, y, partials, counters, m, n, k, k_per_split, splits, flat.stride(0), flat.stride(1),
                weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), *partials.stride(),
                HAS_BIAS=bias is not None, ALL_SPLITS=False, **flags)
    return y.reshape(*x.shape[:-1], n)
