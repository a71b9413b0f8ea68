"""Pure-PyTorch oracle of the fused MoE block (``kernels.fused_moe``, ``kernels.moe_decode``,
``kernels.mlp_beside_experts``): (token, k) pairs are grouped by expert with one stable sort and the loop runs over
the *active* experts only.

Numerics (what parity with HF transformers depends on, see reference/models.md §2.7 and §4):

* Per expert: ``gu = x @ W_gu[e].T`` in the activation dtype (one rounding), ``h = act(gate) * up``
  in the activation dtype (act and product each rounded, as torch does for bf16),
  ``y = h @ W_down[e].T`` in the activation dtype, then ``y * w`` with torch type promotion:
  **the dtype of ``topk_weights`` decides the weighting precision.**
  - Qwen3-MoE casts the routing weights to the activation dtype *before* weighting
    (``router_top_value.to(router_logits.dtype)``), so pass bf16 weights: ``y * w`` is rounded to bf16.
  - Gemma 4 keeps them fp32 (after renormalisation and ``per_expert_scale``), so pass fp32 weights:
    ``y * w`` is exact-ish fp32.
* The sum over k (``accumulate``):
  - ``"pairs"`` (default) mirrors HF's default ``grouped_mm`` experts path: every weighted pair is
    written to a ``[T, K, H]`` buffer of dtype ``promote(act dtype, weights dtype)`` and summed over
    k with ``.sum(dim=1)`` (torch reduces low-precision floats in fp32, k = 0..K-1), then cast to
    the activation dtype once. The Triton kernel does the same (fp32, k ascending).
  - ``"index_add"`` mirrors HF's eager experts loop: ``out.index_add_`` in the activation dtype,
    experts in ascending id order, one rounding per added pair. In bf16 this differs from "pairs"
    by rounding; pin the HF ``experts_implementation`` when comparing bitwise.

int8 experts (``fused_moe_int8_reference``): each expert GEMM is ``reference_int8.int8_linear_reference`` (the
int8 weight times the activations accumulated in fp32, times the per-row scale, one rounding to the activation
dtype), everything after it as above: the same contract as the int8 path of the Triton kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from inference_server.kernels.reference_int8 import int8_linear_reference
from inference_server.kernels.reference_moe import Activation

Accumulate = Literal["pairs", "index_add"]

ExpertLinear = Callable[[torch.Tensor, int], torch.Tensor]  # (rows [n, in], expert) -> [n, out] in rows' dtype


def apply_activation(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``silu`` (Qwen3-MoE) or ``gelu_tanh`` (Gemma 4, HF ``gelu_pytorch_tanh``), in x's dtype."""
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {activation!r}")


def _group_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Stable sort of the flat (token, k) pair ids by expert; returns (order [T*K], counts per expert)."""
    flat = topk_ids.reshape(-1)  # [T*K]
    order = torch.sort(flat, stable=True).indices  # [T*K] pair ids grouped by expert, token order inside
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # host sync: fine on the CPU path
    return order, counts


def fused_moe_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    accumulate: Accumulate = "pairs",
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = Σ_k w[t,k] · down_e(act(gate_e(x_t)) · up_e(x_t)),  e = topk_ids[t, k].

    Shapes: ``hidden [T, H]``, ``w_gate_up [E, 2I, H]`` (gate rows first, then up), ``w_down [E, H, I]``,
    ``topk_weights [T, K]`` (float; its dtype sets the weighting precision, see the module docstring),
    ``topk_ids [T, K]`` (int, every id in [0, E)). Returns ``[T, H]`` in ``hidden.dtype``.
    Weights must share ``hidden``'s dtype. Host-syncs once (bincount) to loop over active experts.
    With ``w_gate_up_scale [E, 2I]`` and ``w_down_scale [E, H]`` the experts are int8: ``fused_moe_int8_reference``
    (only the active experts' weights are read).
    """
    if w_gate_up_scale is not None or w_down_scale is not None:
        if w_gate_up_scale is None or w_down_scale is None:
            raise ValueError("int8 experts need both w_gate_up_scale and w_down_scale")
        return fused_moe_int8_reference(hidden, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_weights,
                                        topk_ids, activation, accumulate)
    return _moe(hidden, lambda x, e: x @ w_gate_up[e].T, lambda h, e: h @ w_down[e].T, w_gate_up.shape[0],
                w_gate_up.shape[1] // 2, topk_weights, topk_ids, activation, accumulate)


def fused_moe_int8_reference(
    hidden: torch.Tensor,
    q_gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    q_down: torch.Tensor,
    down_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    accumulate: Accumulate = "pairs",
) -> torch.Tensor:
    """``fused_moe_reference`` with int8 experts: ``q_gate_up [E, 2I, H]`` int8 with ``gate_up_scale [E, 2I]``,
    ``q_down [E, H, I]`` int8 with ``down_scale [E, H]`` (``reference_int8``'s format). Each expert GEMM is
    ``int8_linear_reference`` (fp32 accumulation, scale after the reduction, rounded to ``hidden.dtype``)."""
    return _moe(hidden, lambda x, e: int8_linear_reference(x, q_gate_up[e], gate_up_scale[e]),
                lambda h, e: int8_linear_reference(h, q_down[e], down_scale[e]), q_gate_up.shape[0],
                q_gate_up.shape[1] // 2, topk_weights, topk_ids, activation, accumulate)


def _moe(
    hidden: torch.Tensor,
    gate_up: ExpertLinear,
    down: ExpertLinear,
    E: int,
    inter: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    accumulate: Accumulate,
) -> torch.Tensor:
    """The MoE block around the expert GEMMs ``gate_up`` (``[n, H] -> [n, 2I]``) and ``down`` (``[n, I] -> [n, H]``)."""
    T, H = hidden.shape
    K = topk_ids.shape[1]
    order, counts = _group_pairs_by_expert(topk_ids, E)
    flat_w = topk_weights.reshape(-1)  # [T*K]
    buf_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    if accumulate == "pairs":
        acc = torch.zeros(T * K, H, dtype=buf_dtype, device=hidden.device)  # [T*K, H]
    elif accumulate == "index_add":
        acc = torch.zeros(T, H, dtype=hidden.dtype, device=hidden.device)  # [T, H]
    else:
        raise ValueError(f"unknown accumulate {accumulate!r}")
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]  # [n] flat pair ids t*K + k, ascending
        start += n
        tokens = pairs // K  # [n]
        gu = gate_up(hidden[tokens], e)  # [n, 2I]
        h = apply_activation(gu[:, :inter], activation) * gu[:, inter:]  # [n, I]
        y = down(h, e) * flat_w[pairs, None]  # [n, H], dtype promote(act, weights)
        if accumulate == "pairs":
            acc[pairs] = y.to(buf_dtype)
        else:
            acc.index_add_(0, tokens, y.to(hidden.dtype))
    if accumulate == "pairs":
        return acc.view(T, K, H).sum(dim=1).to(hidden.dtype)  # [T, H], fp32 reduction over k
    return acc
