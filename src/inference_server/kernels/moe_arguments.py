"""The argument contract shared by the two Triton MoE paths (``fused_moe``'s grouped GEMMs and ``moe_decode``'s
GEMVs): expert shapes, routing shapes, int8 scales, the activation and the output buffer, checked once here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ACT_CODES", "MoeShapes", "check_moe_arguments", "moe_output"]

ACT_CODES: dict[str, int] = {"silu": 0, "gelu_tanh": 1}
"""The kernels' ``ACT`` constexpr for each supported activation."""


@dataclass(frozen=True)
class MoeShapes:
    """T tokens of hidden size H, E experts of intermediate size I, K experts per token; int8 experts or not."""

    tokens: int
    hidden: int
    experts: int
    intermediate: int
    top_k: int
    int8: bool


def check_moe_arguments(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                        w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None) -> MoeShapes:
    """ValueError unless ``hidden [T, H]``, ``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]``, ``topk_weights`` and
    ``topk_ids [T, K]`` agree, the weights have hidden's dtype (or are both int8 with float scales ``[E, 2I]`` and
    ``[E, H]``), and the activation is one the kernels compute."""
    T, H = hidden.shape
    E, two_i, h_w = w_gate_up.shape
    inter_size = two_i // 2
    K = topk_ids.shape[1]
    if h_w != H or two_i != 2 * inter_size or tuple(w_down.shape) != (E, H, inter_size):
        raise ValueError(f"bad expert shapes {tuple(w_gate_up.shape)}, {tuple(w_down.shape)} for H={H}")
    if tuple(topk_ids.shape) != (T, K) or tuple(topk_weights.shape) != (T, K):
        raise ValueError("topk_ids and topk_weights must both be [T, K]")
    int8 = w_gate_up_scale is not None or w_down_scale is not None
    if int8:
        if w_gate_up_scale is None or w_down_scale is None:
            raise ValueError("int8 experts need both w_gate_up_scale and w_down_scale")
        if w_gate_up.dtype != torch.int8 or w_down.dtype != torch.int8:
            raise ValueError("with scales, the expert weights must be int8")
        if tuple(w_gate_up_scale.shape) != (E, two_i) or tuple(w_down_scale.shape) != (E, H):
            raise ValueError(f"scales must be [{E}, {two_i}] and [{E}, {H}], not "
                             f"{tuple(w_gate_up_scale.shape)}, {tuple(w_down_scale.shape)}")
        if not (w_gate_up_scale.is_floating_point() and w_down_scale.is_floating_point()):
            raise ValueError("scales must be float tensors")
    elif w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype:
        raise ValueError("expert weights must have hidden's dtype")
    if activation not in ACT_CODES:
        raise ValueError(f"unknown activation {activation!r}")
    return MoeShapes(T, H, E, inter_size, K, int8)


def moe_output(hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to be ``[T, H]`` of hidden's dtype with a contiguous last dim, or a new such tensor."""
    T, H = hidden.shape
    if out is None:
        return torch.empty(T, H, dtype=hidden.dtype, device=hidden.device)
    if tuple(out.shape) != (T, H) or out.dtype != hidden.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {H}] {hidden.dtype} with a contiguous last dim")
    return out
