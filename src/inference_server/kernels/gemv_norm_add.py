"""A projection and the sandwich norm after it in one launch: ``norm_add(x @ W.T, ...)`` (``kernels.norm_add``'s
formula with ``a`` the projection's output), for steps of a few tokens.

Gemma 4 ends each block with a projection (attention's ``o_proj``, the MLP's ``down_proj``, the per-layer input's
``per_layer_projection``) and then normalises its output and adds it to the residual stream (``kernels.norm_add``).
At decode both are short launches, and the boundary between two launches costs about a microsecond of the H200's
step (grid drain, memory flush, the dependent's wait: ``bench/ablate_decode.py``). Here the CUDA-core GEMV
(``kernels/int8_gemv.py``, int8 or float weights, one K split) runs first; each program then counts itself in on an
arrival counter (``kernels.arrival_counters``), and the last program to arrive, which then sees every program's
output, runs the norm chain over the step's rows (``norm_add.norm_add_row``) and puts the counter back to zero.

Results: the projection's output is the unfused GEMV's with the same config, bit for bit (the same code, the same
program layout), and it is still written (``a``, in x's dtype). The norm chain is ``norm_add``'s code on the same
values; its row reductions run over this launch's warps instead of ``norm_add``'s (the GEMV config's
``num_warps``), so a norm's sum of squares may round differently: the new hidden state agrees with the two-launch
path to bf16 rounding, not always bit for bit.

Bounds: the last program handles every row alone, so the fusion is for ``MAX_TOKENS`` tokens at most (decode);
``gemv_norm_add_config`` says when it applies (the projection alone would be a one-split CUDA-core GEMV). Two
launches of this kernel share one counter, which stream order (and PDL's wait before the counter) keeps apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from inference_server.kernels.arrival_counters import arrival_counters
from inference_server.kernels.gated_gemv import gated_gemv_config
from inference_server.kernels.int8_gemv import gemv_arguments, int8_gemv_kernel
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.norm_add import load_norm_add_weights, norm_add_operands, norm_add_row
from inference_server.kernels.pdl import pdl_launch
from inference_server.kernels.streamed_linear import MIN_DOT_TOKENS, effective_split_k

__all__ = ["MAX_TOKENS", "gemv_norm_add", "gemv_norm_add_config"]

MAX_TOKENS = 2
"""The most tokens a fused launch takes: the last program runs the norm chain of every row by itself."""

# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernel is then an interpreter object.
_INTERPRETED = not isinstance(int8_gemv_kernel, triton.runtime.JITFunction)


@triton.jit(do_not_specialize=["T"])
def _gemv_norm_add_kernel(
    # the GEMV (int8_gemv_kernel's arguments, in its order; a_ptr is its output [T, N])
    x_ptr, w_ptr, scale_ptr, a_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk, stride_scale,
    stride_os, stride_at, half, up_ptr, stride_ut,
    counter_ptr,  # int32 [1]: programs done; zero between launches
    # the norm chain (norm_add_row's arguments after a_ptr)
    b_ptr, res_ptr, y_ptr, z0_ptr, z1_ptr, z2_ptr, sb, sr, sy, sz0, sz1, sz2,
    wa_ptr, wb_ptr, ws_ptr, wz0_ptr, wz1_ptr, wz2_ptr, layer_scale_ptr,
    eps_a, eps_b, eps_s, eps_z0, eps_z1, eps_z2,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr, W_WORDS: tl.constexpr, PRMT: tl.constexpr,
    GATED: tl.constexpr, UP_IN_MEMORY: tl.constexpr, LIBDEVICE_TANH: tl.constexpr, DEEP: tl.constexpr,
    INT_DOT: tl.constexpr,
    HAS_B: tl.constexpr, HAS_SUM_NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_LAYER_SCALE: tl.constexpr,
    NUM_Z: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    tl.static_assert(SPLIT_K == 1 and GATED == 0, "the norm epilogue needs whole, ungated sums")
    # The GEMV: stores this program's tile of a (its PDL wait comes before any dependent access, its release after
    # the weight stream).
    int8_gemv_kernel(x_ptr, w_ptr, scale_ptr, a_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
                     stride_scale, stride_os, stride_at, half, up_ptr, stride_ut, BLOCK_N=BLOCK_N, BLOCK_T=BLOCK_T,
                     BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, EVEN_K=EVEN_K, HAS_SCALE=HAS_SCALE, W_WORDS=W_WORDS,
                     PRMT=PRMT, USE_PDL=USE_PDL, GATED=GATED, UP_IN_MEMORY=UP_IN_MEMORY,
                     LIBDEVICE_TANH=LIBDEVICE_TANH, DEEP=DEEP, INT_DOT=INT_DOT)  # fmt: skip
    # The last program to arrive runs the norm chain. The barrier puts all of this program's stores before the
    # counter's release (acq_rel, GPU scope); the last program's acquire makes the other programs' stores visible,
    # and it reads a past L1 (.cg).
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1)
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        wa, wb, ws, wz0, wz1, wz2, s = load_norm_add_weights(wa_ptr, wb_ptr, ws_ptr, wz0_ptr, wz1_ptr, wz2_ptr,
                                                             layer_scale_ptr, cols, mask, HAS_B, HAS_SUM_NORM,
                                                             HAS_LAYER_SCALE, NUM_Z, BLOCK)
        for row in range(0, T):
            norm_add_row(row, a_ptr, b_ptr, res_ptr, y_ptr, z0_ptr, z1_ptr, z2_ptr, stride_at, sb, sr,
                         sy, sz0, sz1, sz2, wa, wb, ws, wz0, wz1, wz2, s, eps_a, eps_b, eps_s, eps_z0, eps_z1,
                         eps_z2, cols, mask, N, HAS_B, HAS_SUM_NORM, HAS_RES, HAS_LAYER_SCALE, NUM_Z, BLOCK,
                         A_BYPASS_L1=True)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch (stream order keeps launches apart)


def gemv_norm_add_config(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> Int8LinearConfig | None:
    """The config of the projection ``x [T, K] @ weight.T`` alone (``gated_gemv_config`` unpaired) when the fused
    launch can run it: a one-split CUDA-core GEMV of at most ``MAX_TOKENS`` tokens; None otherwise (the caller then
    runs the projection and ``norm_add`` apart)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        return None
    return gated_gemv_config(x, weight, scale, paired=False)


def gemv_norm_add(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]: int8 with scale, else float of x's dtype
    scale: torch.Tensor | None,  # [N]
    config: Int8LinearConfig,  # from gemv_norm_add_config
    wa: torch.Tensor,
    eps_a: float,
    *,
    b: torch.Tensor | None = None,
    wb: torch.Tensor | None = None,
    eps_b: float = 0.0,
    ws: torch.Tensor | None = None,
    eps_s: float = 0.0,
    residual: torch.Tensor | None = None,
    layer_scale: torch.Tensor | None = None,
    out_norms: Sequence[tuple[torch.Tensor, float]] = (),
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # y [T, N], one z [T, N] per out norm
    """``norm_add.norm_add(x @ weight.T, wa, eps_a, ...)`` in one launch (``layer_scale`` is ``norm_add``'s
    ``scale``); the module docstring gives the contract."""
    if x.dim() != 2 or x.stride(-1) != 1 or not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"x must be [T, K] with 1-{MAX_TOKENS} rows and a contiguous last dim, got {tuple(x.shape)}")
    if scale is None and weight.dtype != x.dtype:
        raise ValueError(f"float weights must have x's dtype {x.dtype}, not {weight.dtype}")
    if scale is not None and (weight.dtype != torch.int8 or tuple(scale.shape) != (weight.shape[0],)):
        raise ValueError("int8 weights need int8 values and one scale per row")
    if config.block_t >= MIN_DOT_TOKENS or effective_split_k(config, x.shape[1]) != 1:
        raise ValueError(f"gemv_norm_add runs a CUDA-core GEMV config of one split, not {config}")
    T, K = x.shape
    N = weight.shape[0]
    norm = norm_add_operands(T, N, x.dtype, x.device, wa, eps_a, b=b, wb=wb, eps_b=eps_b, ws=ws, eps_s=eps_s,
                             residual=residual, scale=layer_scale, out_norms=out_norms)
    a = torch.empty(T, N, dtype=x.dtype, device=x.device)
    gemv_args, gemv_constexprs = gemv_arguments(x, weight, scale, a, K, 0, block_n=config.block_n,
                                                block_t=config.block_t, block_k=config.block_k, split_k=1,
                                                num_stages=config.num_stages, interpreted=_INTERPRETED)
    flags = dict(norm.flags)
    flags["HAS_LAYER_SCALE"] = flags.pop("HAS_SCALE")
    grid = (triton.cdiv(T, config.block_t), triton.cdiv(N, config.block_n), 1)
    _gemv_norm_add_kernel[grid](
        *gemv_args, arrival_counters("gemv_norm_add", 1, x.device), *norm.pointers, *norm.strides, *norm.weights,
        *norm.eps, **gemv_constexprs, **flags, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch(),
    )  # fmt: skip
    return norm.y, norm.zs
