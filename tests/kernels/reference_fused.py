"""Pure-PyTorch oracles of the fused kernels: each is the unfused path, op by op, with every rounding the
PyTorch ops make (``kernels.norm_add``, ``kernels.norm_add_gemv``, ``kernels.qk_norm_rope``, ``kernels.router``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tests.kernels.reference_moe import apply_activation
from tests.kernels.reference_norm import rmsnorm_reference

from inference_server.kernels.reference_int8 import int8_linear_reference
from inference_server.kernels.reference_moe import route_softmax_topk
from inference_server.kernels.rmsnorm import NormMode


def norm_add_reference(
    a: torch.Tensor, wa: torch.Tensor, eps_a: float, *, b: torch.Tensor | None = None,
    wb: torch.Tensor | None = None, eps_b: float = 0.0, ws: torch.Tensor | None = None, eps_s: float = 0.0,
    residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    out_norms: Sequence[tuple[torch.Tensor, float]] = (),
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The same as PyTorch tensor ops (``reference_norm``'s gemma norm, each op rounding to a's dtype)."""
    y = rmsnorm_reference(a, None, wa, eps_a, "gemma")[0]
    if b is not None:
        y = y + rmsnorm_reference(b, None, wb, eps_b, "gemma")[0]
    if ws is not None:
        y = rmsnorm_reference(y, None, ws, eps_s, "gemma")[0]
    if residual is not None:
        y = residual + y
    if scale is not None:
        y = y * scale
    return y, tuple(rmsnorm_reference(y, None, w, eps, "gemma")[0] for w, eps in out_norms)


def norm_add_gemv_reference(
    a: torch.Tensor, wa: torch.Tensor, eps_a: float, residual: torch.Tensor, scale: torch.Tensor | None,
    weight: torch.Tensor, w_scale: torch.Tensor | None, *, gated: str | None = None, up: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as PyTorch ops: ``norm_add_reference``'s y, then ``F.linear`` (or the int8 reference with
    ``w_scale``) of y, and with ``gated`` the activation of the gate times up (the second half of the rows when
    ``up`` is None), each op rounding to a's dtype."""
    y, _ = norm_add_reference(a, wa, eps_a, residual=residual, scale=scale)
    projected = torch.nn.functional.linear(y, weight) if w_scale is None else int8_linear_reference(y, weight, w_scale)
    if gated is None:
        return y, projected

    def act(t: torch.Tensor) -> torch.Tensor:
        return apply_activation(t, gated)  # type: ignore[arg-type]

    if up is None:
        gate, up_half = projected.chunk(2, dim=-1)
        return y, act(gate) * up_half
    return y, act(projected) * up


def add_norm_gemv_reference(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor, weight: torch.Tensor,
    w_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as PyTorch ops: ``h = x + residual`` in x's dtype and the qwen RMSNorm of h (``reference_norm``), then
    ``F.linear`` (or the int8 reference with ``w_scale``) of the normed rows."""
    normed, h = rmsnorm_reference(x, residual, norm_weight, eps, "qwen")
    projected = torch.nn.functional.linear(normed, weight) if w_scale is None \
        else int8_linear_reference(normed, weight, w_scale)
    return h, projected


def reference_qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, q_weight: torch.Tensor,
    k_weight: torch.Tensor | None, eps: float, mode: NormMode, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The unfused PyTorch path: ``reference_norm`` per head, then ``layers.apply_rope``'s NeoX half-split
    rotation."""

    def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos[:, None, :]) + (rotated * sin[:, None, :])

    def norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return rmsnorm_reference(x, None, weight, eps, mode)[0]

    return (apply_rope(norm(q, q_weight), cos, sin), apply_rope(norm(k, k_weight), cos, sin) if k is not None else None,
            norm(v, None) if v is not None else None)


def reference_linear_route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
    per_expert_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_route``'s formula in PyTorch: logits accumulated in fp32 (here fp64, rounded to fp32: the exact
    sum, which any fp32 order is within a few ulp of), rounded to x's dtype, then ``ops.torch_route``'s routing
    (``reference_moe.route_softmax_topk``, the per-expert scale, the cast)."""
    logits = (x.double() @ weight.double().T).float().to(x.dtype)
    weights, ids = route_softmax_topk(logits, top_k, renormalize)
    if per_expert_scale is not None:
        weights = weights * per_expert_scale[ids]
    return (weights if out_dtype is None else weights.to(out_dtype)), ids


def reference_add_norm_linear_route(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, mode: NormMode,
    weight: torch.Tensor, top_k: int, renormalize: bool, per_expert_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_norm_linear_route``'s formula in PyTorch: the residual add rounded to x's dtype, the norm in the
    ``reference_norm`` convention, then ``reference_linear_route`` of the normed rows."""
    normed, summed = rmsnorm_reference(x, residual, norm_weight, eps, mode)
    return (normed, summed, *reference_linear_route(normed, weight, top_k, renormalize, per_expert_scale,
                                                     out_dtype))
