"""A norm with its residual add and the GEMV that reads its output in one launch, where the unfused path takes a
norm launch and the GEMV's. Two forms (``int8_gemv.gemv_program``'s ``NORM_IN``):

* ``norm_add_gemv``, a Gemma sandwich norm: ``y = residual + norm(a; wa) [* s]``, then ``y @ W.T`` (or a gated
  projection of y). Gemma 4's E2B/E4B layers end their MLP with ``h = residual + post_ffn_norm(mlp_out)`` and feed
  ``h`` as it is to the per-layer-input gate (``act(h @ G.T) * per_layer_input``).
* ``add_norm_gemv``, a pre-norm after the residual add: ``h = residual + x``, then ``norm(h; w) @ W.T`` (qwen
  convention). Qwen3-MoE's layers start with the input norm of ``residual + previous FFN output``, whose output
  only the fused q/k/v projection reads.

At decode both are latency: the norm is one row of a few thousand elements, and the launch boundary between it and
the GEMV costs a few microseconds of the step (docs/benchmarks.md). Here every program of the CUDA-core GEMV
reduces its tokens' rows to their inverse roots itself (the rows are a few KB, read from L2 by each program), the
first row block's programs store the residual stream's new value (y, or h), and the K loop builds each activation
tile from the tiles of the input, the residual and the norm weight with the same arithmetic. The norm weight and
the scale are weights, loaded before the PDL wait with the first weight tiles.

Numerics: the stored row and the GEMV's input are those of the unfused kernels (``kernels.norm_add``, or
``kernels.rmsnorm.fused_add_rmsnorm``: every rounding of the op-by-op PyTorch path) up to the order of the fp32
sum of squares, which here runs over the GEMV's warps; the GEMV is the one its config runs alone (one K split,
the same row sums). So against the two launches the result can differ only where that last fp32 bit of the
inverse root moves a rounding; under the interpreter (numpy sums of the same padded row) it is equal. The stored
``h = residual + x`` of the pre-norm form does not depend on the sum at all.

Contract: the input and ``residual`` ``[T, K]`` of one float dtype with contiguous rows; the norm weight ``[K]`` of
that dtype or fp32 (the pre-norm's: of that dtype, as the qwen convention's final multiply then stays in it);
``scale`` a one-element tensor of the activation dtype (read on the device) or None; the projection's weight and
config as ``gated_gemv`` / ``streamed_linear`` take them, the config a one-split CUDA-core GEMV
(``streamed_linear.is_one_split_gemv``). K at most ``MAX_NORM_COLUMNS``: each program holds its rows whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_server.kernels.int8_gemv import (
    GATED_ACTIVATIONS,
    NORM_ADD_FIRST,
    NORM_SANDWICH,
    check_gemv_weight,
    gemv_arguments,
    gemv_outputs,
    gemv_program,
)
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.pdl import pdl_launch
from inference_server.kernels.streamed_linear import is_one_split_gemv

__all__ = ["MAX_NORM_COLUMNS", "add_norm_gemv", "norm_add_gemv"]

MAX_NORM_COLUMNS = 4096
"""The widest row the prologue reduces: 32 elements a thread at the GEMV's 4 warps (Gemma-4-E2B/E4B: 1536/2560,
Qwen3-30B-A3B: 2048)."""

# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernel is then an interpreter object.
_INTERPRETED = not isinstance(gemv_program, triton.runtime.JITFunction)


@triton.jit(do_not_specialize=["T"])
def _norm_add_gemv_kernel(
    # int8_gemv.gemv_program's parameters, in its order (GemvLaunch.args); x_ptr is the block output a
    x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
    stride_scale, stride_os, stride_ot, half, up_ptr, stride_ut,
    # the norm's
    res_ptr, stride_rt, wa_ptr, s_ptr, y_ptr, stride_yt, eps_a,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr, W_WORDS: tl.constexpr, PRMT: tl.constexpr,
    GATED: tl.constexpr, UP_IN_MEMORY: tl.constexpr, LIBDEVICE_TANH: tl.constexpr, DEEP: tl.constexpr,
    INT_DOT: tl.constexpr, NORM_IN: tl.constexpr, HAS_S: tl.constexpr, NORM_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    gemv_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
        stride_scale, stride_os, stride_ot, half, up_ptr, stride_ut, BLOCK_N, BLOCK_T, BLOCK_K, SPLIT_K, EVEN_K,
        HAS_SCALE, W_WORDS, PRMT, USE_PDL, GATED, UP_IN_MEMORY, LIBDEVICE_TANH, DEEP, INT_DOT,
        NORM_IN, res_ptr, stride_rt, wa_ptr, s_ptr, y_ptr, stride_yt, eps_a, HAS_S, NORM_BLOCK,
    )  # fmt: skip


def norm_add_gemv(
    a: torch.Tensor,  # [T, K]: a block's output
    wa: torch.Tensor,  # [K]: its post-norm's weight (gemma convention)
    eps_a: float,
    residual: torch.Tensor,  # [T, K]
    scale: torch.Tensor | None,  # one element, applied last (Gemma 4's layer scalar), or None
    weight: torch.Tensor,  # [N, K]: int8 with w_scale, else float of a's dtype
    w_scale: torch.Tensor | None,  # [N]
    config: Int8LinearConfig,  # a one-split CUDA-core GEMV config
    *,
    gated: str | None = None,  # an activation of int8_gemv.GATED_ACTIVATIONS: the gated epilogue (gated_gemv)
    up: torch.Tensor | None = None,  # [T, N] with gated: act(y @ weight.T) * up; else weight is [gate; up]
) -> tuple[torch.Tensor, torch.Tensor]:  # y [T, K], the projection of y: [T, N], or [T, N / 2] gated and paired
    """``y = residual + norm(a; wa) [* scale]`` and its projection ``y @ weight.T`` (gated with ``gated``, as
    ``gated_gemv``) in one launch; see the module docstring."""
    _check_norm_inputs(a, wa, residual, (a.dtype, torch.float32), config)
    if scale is not None and (scale.numel() != 1 or scale.dtype != a.dtype):
        raise ValueError(f"scale must be one {a.dtype} element, got {tuple(scale.shape)} {scale.dtype}")
    if gated is not None and gated not in GATED_ACTIVATIONS:
        raise ValueError(f"gated must be one of {tuple(GATED_ACTIVATIONS)}, not {gated!r}")
    return _launch(NORM_SANDWICH, a, wa, eps_a, residual, scale, weight, w_scale, config, gated, up)


def add_norm_gemv(
    x: torch.Tensor,  # [T, K]: a block's output, not yet added to the residual stream
    norm_weight: torch.Tensor,  # [K]: the next pre-norm's weight (qwen convention), of x's dtype
    eps: float,
    residual: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]: int8 with w_scale, else float of x's dtype
    w_scale: torch.Tensor | None,  # [N]
    config: Int8LinearConfig,  # a one-split CUDA-core GEMV config
) -> tuple[torch.Tensor, torch.Tensor]:  # h = residual + x [T, K], norm(h) @ weight.T [T, N]
    """``h = residual + x`` and the projection of its qwen-convention RMSNorm, ``norm(h; norm_weight) @ weight.T``,
    in one launch (``kernels.rmsnorm.fused_add_rmsnorm`` then the GEMV, fused); see the module docstring."""
    _check_norm_inputs(x, norm_weight, residual, (x.dtype,), config)
    return _launch(NORM_ADD_FIRST, x, norm_weight, eps, residual, None, weight, w_scale, config, None, None)


def _check_norm_inputs(a: torch.Tensor, wa: torch.Tensor, residual: torch.Tensor, norm_dtypes: tuple[torch.dtype, ...],
                       config: Int8LinearConfig) -> None:
    """The contract's checks of the norm's operands and the config (the weight's are ``check_gemv_weight``'s)."""
    if a.dim() != 2 or residual.shape != a.shape or residual.dtype != a.dtype or a.stride(-1) != 1 \
            or residual.stride(-1) != 1:
        raise ValueError(f"the input and the residual must be [T, K] of one dtype with contiguous rows, got "
                         f"{tuple(a.shape)} {a.dtype} and {tuple(residual.shape)} {residual.dtype}")
    k = a.shape[1]
    if tuple(wa.shape) != (k,) or wa.dtype not in norm_dtypes or wa.stride(0) != 1:
        raise ValueError(f"the norm weight must be [{k}] of {' or '.join(map(str, norm_dtypes))}, got "
                         f"{tuple(wa.shape)} {wa.dtype}")
    if k > MAX_NORM_COLUMNS:
        raise ValueError(f"rows of at most {MAX_NORM_COLUMNS} columns, got {k}")
    if not is_one_split_gemv(config, k):
        raise ValueError(f"the fused norm runs a CUDA-core GEMV config of one split, not {config}")


def _launch(norm_in: int, a: torch.Tensor, wa: torch.Tensor, eps_a: float, residual: torch.Tensor,
            scale: torch.Tensor | None, weight: torch.Tensor, w_scale: torch.Tensor | None, config: Int8LinearConfig,
            gated: str | None, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of ``_norm_add_gemv_kernel`` with ``NORM_IN = norm_in`` on checked operands: the residual
    stream's new value [T, K] and the projection [T, N] (gated and paired: [T, N / 2])."""
    check_gemv_weight(a, weight, w_scale)
    tokens, k = a.shape
    width, rows_per_program = gemv_outputs(weight.shape[0], config.block_n, paired=gated is not None and up is None)
    y = torch.empty_like(a)
    out = torch.empty(tokens, width, dtype=a.dtype, device=a.device)
    if tokens == 0:
        return y, out
    launch = gemv_arguments(a, weight, w_scale, out, k, 0, block_n=config.block_n, block_t=config.block_t,
                            block_k=config.block_k, split_k=1, num_warps=config.num_warps,
                            num_stages=config.num_stages, interpreted=_INTERPRETED, gated=gated, up=up)
    grid = (triton.cdiv(tokens, config.block_t), triton.cdiv(width, rows_per_program), 1)
    _norm_add_gemv_kernel[grid](
        *launch.args, residual, residual.stride(0), wa, scale if scale is not None else wa, y, y.stride(0), eps_a,
        **launch.constexprs, NORM_IN=norm_in, HAS_S=scale is not None, NORM_BLOCK=triton.next_power_of_2(k),
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch(loop="gemv"),
    )  # fmt: skip
    return y, out
