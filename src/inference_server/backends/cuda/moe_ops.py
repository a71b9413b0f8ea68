"""The CUDA runner's MoE ops: routing, the router GEMV in the routing launch (with the residual add + norm before it),
the routed experts (decode GEMVs or grouped GEMMs) and Gemma 4's dense MLP paired with them. The fused ones are
``ops.Fusions``: None where they do not take the inputs (then the table composes its primitives).
"""

from __future__ import annotations

import torch
from torch import nn

from inference_server.backends.cuda.norm_ops import add_norm_kernel_mode
from inference_server.backends.cuda.projection_ops import (
    gated_projection_config,
    installed_gemv_takes,
)
from inference_server.kernels.fused_moe import fused_moe
from inference_server.kernels.gated_gemv import gated_gemv_config
from inference_server.kernels.mlp_beside_experts import expert_gate_up_beside_gemv, gated_gemv_and_route, shares_warps
from inference_server.kernels.moe_decode import fused_moe_decode
from inference_server.kernels.router import MAX_EXPERTS, add_norm_linear_route, linear_route
from inference_server.models.architectures import layers
from inference_server.models.architectures.blocks import FusedExperts, GatedMLP
from inference_server.models.architectures.gemma4 import Gemma4Router
from inference_server.models.architectures.quantized import projection_weights
from inference_server.models.spec import NormStyle

FUSED_ROUTER_MAX_TOKENS = 16
"""Steps of at most this many tokens compute the router logits inside the routing launch (``triton_linear_route``);
larger ones run the router GEMM (cuBLAS), whose launch cost is then small against its work."""


def _router_gemv_fits(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether ``kernels.router``'s fused router GEMV takes these inputs: a decode-sized step of [T, H] rows, a
    float [E, H] weight of x's dtype, contiguous last dims, 1 <= top_k <= E <= MAX_EXPERTS."""
    return (x.dim() == 2 and 0 < x.shape[0] <= FUSED_ROUTER_MAX_TOKENS and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype and x.stride(-1) == 1
            and weight.stride(-1) == 1 and 1 <= top_k <= weight.shape[0] <= MAX_EXPERTS)


def triton_linear_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                        per_expert_scale: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Ops.linear_route`` in one Triton launch at decode sizes (``kernels.router.linear_route``: the router GEMV
    and the routing, one launch instead of two); None (the router GEMM, then ``route``) for larger steps and for
    inputs the kernel does not take."""
    if not _router_gemv_fits(x, weight, top_k):
        return None
    return linear_route(x, weight, top_k, renormalize, per_expert_scale, out_dtype)


def triton_add_norm_linear_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor | None,
                                  eps: float, style: NormStyle, weight: torch.Tensor, top_k: int, renormalize: bool,
                                  per_expert_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``Ops.add_norm_route`` in one Triton launch at decode sizes (``kernels.router.add_norm_linear_route``:
    the residual add, the norm, the router GEMV and the routing); None (``add_rms_norm`` then ``linear_route``) for
    larger steps and inputs the kernel does not take."""
    mode = add_norm_kernel_mode(x, residual, style)
    if mode is None or norm_weight is None or norm_weight.dtype != x.dtype or not _router_gemv_fits(x, weight, top_k):
        return None
    return add_norm_linear_route(x, residual, norm_weight, eps, mode, weight, top_k, renormalize, per_expert_scale,
                                 out_dtype)


def triton_mlp_beside_experts(mlp: nn.Module, router: nn.Module, experts: nn.Module, x: torch.Tensor,
                              residual: torch.Tensor, router_input: torch.Tensor | None, expert_input: torch.Tensor,
                              *, decode_max_tokens: int,
                              dense_max_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Ops.mlp_beside_experts`` at decode in two launches of paired work and the experts' down launch
    (``kernels.mlp_beside_experts``), where the table's primitives would run the pieces as one-launch GEMVs: steps of
    at most ``decode_max_tokens`` tokens (the MoE decode GEMVs'), the fused weights in use, the router's input
    normed by the caller. Each pairing is taken on its own: the dense gate/up with the router where the gated
    projection is a one-split CUDA-core GEMV (``triton_gated_projection``'s rule) and the fused router GEMV takes
    the router; the dense down with the experts' gate/up where the down projection is a one-split CUDA-core GEMV
    of the experts' warps. The rest runs through the modules (``Ops.mlp_beside_experts``' calls); None where no
    pairing can be taken."""
    tokens = x.shape[0]
    if not (isinstance(mlp, GatedMLP) and isinstance(router, Gemma4Router) and isinstance(experts, FusedExperts)
            and mlp.ops.fused_weights and mlp.gate_up_weight is not None and router_input is not None
            and x.dim() == 2 and 0 < tokens <= decode_max_tokens and x.stride(-1) == 1
            and expert_input.stride(-1) == 1 and experts.gate_up_proj.stride(-1) == 1
            and experts.down_proj.stride(-1) == 1):
        return None
    act = layers.canonical_activation(mlp.act_name)
    gate_config = gated_projection_config(x, mlp.gate_up_weight, mlp.gate_up_scale, act, None,
                                           dense_max_tokens=dense_max_tokens)
    router_weight = router.proj.weight
    if gate_config is not None and _router_gemv_fits(router_input, router_weight, router.top_k):
        activated, weights, ids = gated_gemv_and_route(x, mlp.gate_up_weight, mlp.gate_up_scale, act, gate_config,
                                                       router_input, router_weight, router.top_k,
                                                       router.renormalize, router.per_expert_scale)
    else:
        activated = mlp.activated(x)
        weights, ids = router(residual, router_input)
    down_weight, down_scale = projection_weights(mlp.down_proj)
    down_config = gated_gemv_config(activated, down_weight, down_scale, paired=False) \
        if installed_gemv_takes(activated, down_weight, down_scale, dense_max_tokens=dense_max_tokens) else None
    w_gate_up, w_down = experts.gate_up_proj, experts.down_proj
    if down_config is not None and shares_warps(down_config, w_gate_up.shape[2], w_down.shape[2],
                                                expert_input.element_size(),
                                                int8_experts=experts.gate_up_proj_scale is not None):
        moe, m = expert_gate_up_beside_gemv(expert_input, w_gate_up, w_down, weights, ids,
                                            experts.activation,  # type: ignore[arg-type]
                                            activated, down_weight, down_scale, down_config,
                                            w_gate_up_scale=experts.gate_up_proj_scale,
                                            w_down_scale=experts.down_proj_scale)
        return m, moe
    return mlp.down_proj(activated), experts(expert_input, weights, ids)


def triton_fused_moe(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: str, *,
                     w_gate_up_scale: torch.Tensor | None = None,
                     w_down_scale: torch.Tensor | None = None, decode_max_tokens: int = 0) -> torch.Tensor:
    """``ops.MoEFn`` through Triton, no host sync: steps of at most ``decode_max_tokens`` tokens as the decode
    GEMVs (``kernels.moe_decode``: gate/up, then down with the k-sum, two launches), larger ones as the grouped
    GEMMs (``kernels.fused_moe``: align + gate/up + down + k-sum). int8 experts (scales given) dequantise their
    weight tiles in registers on both paths."""
    if 0 < hidden.shape[0] <= decode_max_tokens and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1 \
            and hidden.stride(-1) == 1:
        return fused_moe_decode(hidden, w_gate_up, w_down, topk_weights, topk_ids, act,  # type: ignore[arg-type]
                                w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
    return fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids, act,  # type: ignore[arg-type]
                     w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
