"""Triton MoE routing: softmax, top-k, renormalisation, per-expert scale and the cast in one launch.

The reference (``models/architectures/ops.torch_route``) is five to seven PyTorch kernels per MoE layer at
decode (softmax, topk, sum, divide, gather and multiply or cast); here one program per token row does all of it
in registers:

* ``p = softmax(logits)`` in fp32 over the row's E experts (E <= 1024, padded to a power of two);
* the top-k by K rounds of "take the largest, lowest expert id among equals" (descending, as ``torch.topk``).
  Exact ties happen with bf16 logits (8 bits of mantissa over 128 experts); ``torch.topk`` leaves their order
  unspecified (on the CPU it took the higher id first), so at a tie on the k-th place the two may route a
  token to different, equally weighted experts: within bf16's tolerance, never in fp32 tests;
* if ``renormalize``: ``w / sum(w)`` in fp32 (Qwen3-MoE with ``norm_topk_prob``, Gemma 4);
* if ``per_expert_scale`` is given: ``w * float(scale[id])`` (Gemma 4);
* ``w`` stored in ``out_dtype`` (Qwen casts to the activation dtype; Gemma keeps fp32), ids as int64.

fp32 results match the reference to within a few ulp (``exp`` and the summation order differ); the bf16 cast
is then exact or one bf16 ulp apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_route"]

MAX_EXPERTS = 1024


@triton.jit(do_not_specialize=["n_rows"])
def _route_kernel(
    logits_ptr,  # [T, E]
    scale_ptr,  # [E] or a dummy
    weights_ptr,  # [T, K] out
    ids_ptr,  # [T, K] int64 out
    n_rows,
    E,
    stride_row,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)  # [BE]
    valid = experts < E
    x = tl.load(logits_ptr + row * stride_row + experts, mask=valid, other=-float("inf")).to(tl.float32)
    shifted = tl.exp(x - tl.max(x, axis=0))
    shifted = tl.where(valid, shifted, 0.0)
    probs = shifted / tl.sum(shifted, axis=0)  # [BE]
    remaining = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 marks padding and taken experts
    slots = tl.arange(0, BLOCK_K)  # [BK]
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, experts, BLOCK_E), axis=0)
        top_w = tl.where(slots == k, best, top_w)
        top_id = tl.where(slots == k, best_id, top_id)
        remaining = tl.where(experts == best_id, -1.0, remaining)
    in_k = slots < K
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(in_k, top_w, 0.0), axis=0)
    if HAS_SCALE:
        top_w = top_w * tl.load(scale_ptr + top_id, mask=in_k, other=0.0).to(tl.float32)
    tl.store(weights_ptr + row * K + slots, top_w.to(weights_ptr.dtype.element_ty), mask=in_k)
    tl.store(ids_ptr + row * K + slots, top_id.to(tl.int64), mask=in_k)


def triton_route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,  # [E]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] (out_dtype, default fp32), ids [T, K] int64
    """``ops.torch_route`` in one launch (see the module docstring)."""
    T, E = router_logits.shape
    if not 1 <= top_k <= E <= MAX_EXPERTS:
        raise ValueError(f"routing needs 1 <= top_k <= experts <= {MAX_EXPERTS}, got top_k={top_k}, E={E}")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    weights = torch.empty((T, top_k), dtype=out_dtype or torch.float32, device=device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=device)
    if T == 0:
        return weights, ids
    scale = per_expert_scale if per_expert_scale is not None else weights  # a dummy pointer, never read
    _route_kernel[(T,)](
        logits, scale, weights, ids, T, E, logits.stride(0),
        K=top_k, RENORMALIZE=renormalize, HAS_SCALE=per_expert_scale is not None,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights, ids
