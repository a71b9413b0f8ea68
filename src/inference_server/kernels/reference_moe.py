"""Pure-PyTorch softmax-top-k routing as in HF Qwen3-MoE / Gemma 4 (``ops.torch_route``'s first step, the oracle of
``kernels.router``) and the activations the MoE kernels take."""

from __future__ import annotations

from typing import Literal

import torch

Activation = Literal["silu", "gelu_tanh"]

__all__ = ["Activation", "route_softmax_topk"]


def route_softmax_topk(
    router_logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-top-k routing as in HF Qwen3-MoE / Gemma 4.

    ``router_logits [T, E]`` (any float dtype) -> ``(weights [T, K] fp32, ids [T, K] int64)``.
    The softmax is taken in fp32 over all E experts, then ``torch.topk`` (descending; ties go the way
    torch.topk breaks them), then, if ``renormalize``, ``w / w.sum(-1)`` in fp32.
    The caller applies model specifics afterwards: Qwen casts the weights to the activation dtype,
    Gemma multiplies them by ``per_expert_scale[ids]`` and keeps fp32.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, K], [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
