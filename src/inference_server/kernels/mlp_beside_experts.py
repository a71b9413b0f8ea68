"""A Gemma 4 MoE layer's dense MLP beside its routed experts at decode: two launches that each run two
independent pieces of work, where the layer took four launches in a chain.

Gemma-4-26B-A4B's FFN has two branches that read the same residual through their own norms (one ``norm_add``
launch makes all three inputs): the dense MLP (gate/up GEMV with its gated activation, then down) and the routed
experts (router GEMV with top-k, then the experts' gate/up and down). Run one after the other at batch 1 that is
five launches: gated gate/up, down, router, expert gate/up, expert down. The router is latency (a few µs for under a
MB of weights) and each launch boundary costs about a microsecond (docs/benchmarks.md), while the branches do not
depend on each other. So:

1. ``_gated_gemv_and_route_kernel``: the router's programs (``router.linear_route_program``) and the dense
   gate/up's (``int8_gemv.gemv_program`` with the gated epilogue) in one grid; the router's latency-bound
   programs come first, so they are resident early and route while the GEMV streams.
2. ``_expert_gate_up_and_gemv_kernel``: the routed experts' gate/up programs (``moe_decode.gate_up_program``,
   which need the router's ids) and the dense down projection's (``gemv_program``, which needs the dense
   activation), both written by launch 1.
3. The experts' down projection with the k-sum (``moe_decode``'s own down launch).

Each program runs the code of its kernel's standalone launch, so its outputs are that launch's at the same
config: the dense GEMVs bit for bit (the fused launch is taken only at the config the projection alone would run,
a one-split CUDA-core GEMV, and with the same warps), the experts' gate/up bit for bit (its warps must equal the
GEMV's), the router up to the fp32 summation order of its logits and softmax (it runs with the GEMV's warps, where
alone it takes one warp at 1-2 rows; ``router``'s docstring: the expert choice can differ only within an ulp of a
tie). Under the interpreter warps do not exist and every output is bitwise the standalone path's.

PDL (``kernels.pdl``): each program keeps its own kernel's invariant (the GEMV's programs load their first weight
tiles before the wait, the others nothing), and each releases where its own kernel does. The router's arrival
counter counts the router's programs only; it is ``router``'s buffer, so these launches and the standalone
router's never run concurrently (stream order) and share it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_server.kernels.int8_gemv import GemvLaunch, gemv_arguments, gemv_outputs, gemv_program
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.moe_decode import (
    MoeDecodeConfig,
    gate_up_program,
    launch_down,
    moe_decode_config,
    moe_decode_launches,
)
from inference_server.kernels.pdl import pdl_launch
from inference_server.kernels.reference_moe import Activation
from inference_server.kernels.router import linear_route_program, route_arguments
from inference_server.kernels.streamed_linear import is_one_split_gemv

__all__ = ["expert_gate_up_beside_gemv", "gated_gemv_and_route", "shares_warps"]

# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernel is then an interpreter object.
_INTERPRETED = not isinstance(gemv_program, triton.runtime.JITFunction)


@triton.jit(do_not_specialize=["T", "r_n_rows", "gemv_token_blocks"])
def _gated_gemv_and_route_kernel(
    # int8_gemv.gemv_program's parameters, in its order (GemvLaunch.args)
    x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
    stride_scale, stride_os, stride_ot, half, up_ptr, stride_ut,
    # router.linear_route_program's, in its order (RouteLaunch.args)
    r_x_ptr, r_w_ptr, r_logits_ptr, r_counter_ptr, r_scale_ptr, r_weights_ptr, r_ids_ptr, r_res_ptr, r_norm_w_ptr,
    r_res_out_ptr, r_normed_ptr, r_n_rows, r_E, r_H, r_stride_x, r_stride_w, r_stride_r, r_stride_ro, r_stride_n,
    r_eps,
    gemv_token_blocks,  # the GEMV's programs along T (its standalone grid's first axis)
    route_groups,  # the router's expert groups (its standalone grid's first axis; its rows are r_n_rows)
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, W_WORDS: tl.constexpr, PRMT: tl.constexpr, GATED: tl.constexpr,
    UP_IN_MEMORY: tl.constexpr, LIBDEVICE_TANH: tl.constexpr, DEEP: tl.constexpr, INT_DOT: tl.constexpr,
    R_K: tl.constexpr, R_RENORMALIZE: tl.constexpr, R_HAS_SCALE: tl.constexpr, R_ROWS: tl.constexpr,
    R_BLOCK_E: tl.constexpr, R_BLOCK_K: tl.constexpr, R_EXPERTS_PER_PROGRAM: tl.constexpr, R_BLOCK_H: tl.constexpr,
    R_ADD_NORM: tl.constexpr, R_GEMMA_NORM: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):  # fmt: skip
    # The router's programs first: the block scheduler hands out programs in index order, so the latency-bound
    # routing (GEMV slice, arrival, top-k) starts at once and ends while the GEMV's programs still stream.
    pid = tl.program_id(0)
    route_programs = route_groups * r_n_rows
    if pid < route_programs:
        linear_route_program(
            pid % route_groups, (pid // route_groups).to(tl.int64), route_programs,
            r_x_ptr, r_w_ptr, r_logits_ptr, r_counter_ptr, r_scale_ptr, r_weights_ptr, r_ids_ptr, r_res_ptr,
            r_norm_w_ptr, r_res_out_ptr, r_normed_ptr, r_n_rows, r_E, r_H, r_stride_x, r_stride_w, r_stride_r,
            r_stride_ro, r_stride_n, r_eps, R_K, R_RENORMALIZE, R_HAS_SCALE, R_ROWS, R_BLOCK_E, R_BLOCK_K,
            R_EXPERTS_PER_PROGRAM, R_BLOCK_H, R_ADD_NORM, R_GEMMA_NORM, USE_PDL,
        )  # fmt: skip
    else:
        g = pid - route_programs
        gemv_program(
            g % gemv_token_blocks, g // gemv_token_blocks, 0,
            x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
            stride_scale, stride_os, stride_ot, half, up_ptr, stride_ut, BLOCK_N, BLOCK_T, BLOCK_K, SPLIT_K, EVEN_K,
            HAS_SCALE, W_WORDS, PRMT, USE_PDL, GATED, UP_IN_MEMORY, LIBDEVICE_TANH, DEEP, INT_DOT,
        )  # fmt: skip


@triton.jit(do_not_specialize=["T", "expert_pairs", "gemv_token_blocks"])
def _expert_gate_up_and_gemv_kernel(
    # int8_gemv.gemv_program's parameters, in its order (GemvLaunch.args)
    x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
    stride_scale, stride_os, stride_ot, half, up_ptr, stride_ut,
    # moe_decode.gate_up_program's, in its order (MoeDecodeLaunches.gate_up_args)
    e_x_ptr, e_w_ptr, e_ids_ptr, e_scale_ptr, e_out_ptr, e_num_experts, e_H, e_inter_size, e_stride_xt, e_stride_we,
    e_stride_wn, e_stride_se, e_stride_sn,
    gemv_token_blocks,  # the GEMV's programs along T (its standalone grid's first axis)
    expert_row_tiles,  # the experts' gate/up row tiles (its standalone grid's first axis)
    expert_pairs,  # the (token, k) pairs (its standalone grid's second axis)
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, W_WORDS: tl.constexpr, PRMT: tl.constexpr, GATED: tl.constexpr,
    UP_IN_MEMORY: tl.constexpr, LIBDEVICE_TANH: tl.constexpr, DEEP: tl.constexpr, INT_DOT: tl.constexpr,
    E_TOP_K: tl.constexpr, E_ACT: tl.constexpr, E_BLOCK_N: tl.constexpr, E_BLOCK_K: tl.constexpr,
    E_EVEN_K: tl.constexpr, E_W_INT8: tl.constexpr, E_W_WORDS: tl.constexpr, E_PRMT: tl.constexpr,
    E_INT_DOT: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):  # fmt: skip
    # The experts' programs first: they stream the most bytes, so they start in the first wave.
    pid = tl.program_id(0)
    expert_programs = expert_row_tiles * expert_pairs
    if pid < expert_programs:
        gate_up_program(
            pid % expert_row_tiles, pid // expert_row_tiles,
            e_x_ptr, e_w_ptr, e_ids_ptr, e_scale_ptr, e_out_ptr, e_num_experts, e_H, e_inter_size, e_stride_xt,
            e_stride_we, e_stride_wn, e_stride_se, e_stride_sn, E_TOP_K, E_ACT, E_BLOCK_N, E_BLOCK_K, E_EVEN_K,
            E_W_INT8, E_W_WORDS, E_PRMT, E_INT_DOT, USE_PDL,
        )  # fmt: skip
    else:
        g = pid - expert_programs
        gemv_program(
            g % gemv_token_blocks, g // gemv_token_blocks, 0,
            x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
            stride_scale, stride_os, stride_ot, half, up_ptr, stride_ut, BLOCK_N, BLOCK_T, BLOCK_K, SPLIT_K, EVEN_K,
            HAS_SCALE, W_WORDS, PRMT, USE_PDL, GATED, UP_IN_MEMORY, LIBDEVICE_TANH, DEEP, INT_DOT,
        )  # fmt: skip


def _check_gemv_config(config: Int8LinearConfig, in_features: int) -> None:
    if not is_one_split_gemv(config, in_features):
        raise ValueError(f"a GEMV beside other work must be a one-split CUDA-core GEMV config, not {config}")


def _gemv_launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, config: Int8LinearConfig,
                 out: torch.Tensor, gated: str | None) -> tuple[GemvLaunch, int]:
    """The GEMV's arguments (one split) and its number of programs."""
    launch = gemv_arguments(x, weight, scale, out, x.shape[1], 0, block_n=config.block_n, block_t=config.block_t,
                            block_k=config.block_k, split_k=1, num_warps=config.num_warps,
                            num_stages=config.num_stages, interpreted=_INTERPRETED, gated=gated)
    width, rows_per_program = gemv_outputs(weight.shape[0], config.block_n, paired=gated is not None)
    return launch, triton.cdiv(width, rows_per_program)


def gated_gemv_and_route(
    x: torch.Tensor,  # [T, K]: the dense MLP's input
    gate_up: torch.Tensor,  # [2I, K] fused [gate; up] (int8 with gate_up_scale, else x's dtype)
    gate_up_scale: torch.Tensor | None,  # [2I]
    act: str,  # gelu_tanh or silu (int8_gemv.GATED_ACTIVATIONS)
    config: Int8LinearConfig,  # gated_gemv.gated_gemv_config's: the config the projection alone runs
    router_x: torch.Tensor,  # [T, H]: the router's input (T <= router.MAX_FUSED_ROWS)
    router_weight: torch.Tensor,  # [E, H], router_x's dtype
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,  # [E]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # act(gate) * up [T, I], routing weights [T, K], ids [T, K]
    """``gated_gemv.gated_gemv(x, gate_up, gate_up_scale, act, config)`` and ``router.linear_route(router_x,
    router_weight, top_k, renormalize, per_expert_scale, out_dtype)`` in one launch (the module docstring's
    launch 1; the router at the GEMV's warps)."""
    T = x.shape[0]
    _check_gemv_config(config, x.shape[1])
    if router_x.shape[0] != T:
        raise ValueError(f"the router's input has {router_x.shape[0]} rows, the MLP's {T}")
    out = torch.empty(T, gate_up.shape[0] // 2, dtype=x.dtype, device=x.device)
    route, (_, _, weights, ids) = route_arguments(router_x, None, router_weight, top_k, renormalize,
                                                  per_expert_scale, out_dtype, experts_per_program=None,
                                                  block_h=None, num_warps=config.num_warps)
    if route is None:  # no tokens
        return out, weights, ids
    gemv, gemv_rows = _gemv_launch(x, gate_up, gate_up_scale, config, out, act)
    token_blocks = triton.cdiv(T, config.block_t)
    grid = (route.groups * route.rows + token_blocks * gemv_rows,)
    _gated_gemv_and_route_kernel[grid](
        *gemv.args, *route.args, token_blocks, route.groups, **gemv.constexprs,
        **{f"R_{name}": value for name, value in route.constexprs.items()},
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(loop="gemv"),
    )
    return out, weights, ids


def shares_warps(config: Int8LinearConfig, hidden_size: int, intermediate_size: int, element_size: int, *,
                 int8_experts: bool) -> bool:
    """Whether a GEMV of ``config`` can run beside the experts' gate/up programs bit for bit: both take the same
    warps (``moe_decode_config``'s for these experts)."""
    moe = moe_decode_config(hidden_size, intermediate_size, element_size, int8=int8_experts)
    return moe.gate_up_warps == config.num_warps


def expert_gate_up_beside_gemv(
    expert_x: torch.Tensor,  # [T, H]: the experts' input
    w_gate_up: torch.Tensor,  # [E, 2I', H]
    w_down: torch.Tensor,  # [E, H, I']
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    activation: Activation,
    dense_x: torch.Tensor,  # [T, K']: the dense projection's input
    dense_weight: torch.Tensor,  # [N, K'] (int8 with dense_scale, else dense_x's dtype)
    dense_scale: torch.Tensor | None,  # [N]
    dense_config: Int8LinearConfig,  # the config the projection alone runs: one split, the experts' warps
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    moe_config: MoeDecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # the experts' output [T, H], the dense projection's [T, N]
    """``moe_decode.fused_moe_decode(expert_x, ...)`` with the dense projection ``dense_x @ dense_weight.T`` run
    by extra programs of its gate/up launch (the module docstring's launches 2 and 3)."""
    T = expert_x.shape[0]
    _check_gemv_config(dense_config, dense_x.shape[1])
    if dense_x.shape[0] != T:
        raise ValueError(f"the dense projection's input has {dense_x.shape[0]} rows, the experts' {T}")
    dense_out = torch.empty(T, dense_weight.shape[0], dtype=dense_x.dtype, device=dense_x.device)
    moe, out = moe_decode_launches(expert_x, w_gate_up, w_down, topk_weights, topk_ids, activation,
                                   config=moe_config, w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
    if moe is None:  # no tokens
        return out, dense_out
    if moe.gate_up_warps != dense_config.num_warps:
        raise ValueError(f"the experts' gate/up takes {moe.gate_up_warps} warps, the GEMV's config "
                         f"{dense_config.num_warps} (shares_warps)")
    gemv, gemv_rows = _gemv_launch(dense_x, dense_weight, dense_scale, dense_config, dense_out, None)
    token_blocks = triton.cdiv(T, dense_config.block_t)
    row_tiles, pairs = moe.gate_up_grid
    grid = (row_tiles * pairs + token_blocks * gemv_rows,)
    _expert_gate_up_and_gemv_kernel[grid](
        *gemv.args, *moe.gate_up_args, token_blocks, row_tiles, pairs, **gemv.constexprs,
        **{f"E_{name}": value for name, value in moe.gate_up_constexprs.items()},
        num_warps=dense_config.num_warps, num_stages=dense_config.num_stages, **pdl_launch(loop="moe"),
    )
    launch_down(moe)
    return out, dense_out
