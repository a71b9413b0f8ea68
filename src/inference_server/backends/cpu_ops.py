"""The CPU engine's ops table and paged-attention functions (``factory.build_runner`` picks them for an int8 model
on the CPU; a float model on the CPU keeps the reference table, which the parity tests compare bit for bit).

A decode step of the embedded model at batch 1 is ~130 small matmuls and ~1,500 small tensor ops; on a small CPU
each op costs a few microseconds of dispatch whatever its size, so the CPU path is the reference's values in fewer
ops (figures: docs/quantization.md):

* the fused q/k/v and gate/up weights (``Ops.fused_weights``: one int8 matmul instead of three and two);
* decode attention over the paged cache as the reference's gather and two einsums per sequence
  (``cpu_decode_attention``: no mask, since a decode query sees every cached key of its window) and the KV store as
  one ``index_copy_`` per tensor (``cpu_store_kv``), where the reference masks and indexes for any chunk length.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn

from inference_server.kernels import cpu_int8
from inference_server.kernels.reference_attention import ref_store_kv
from inference_server.models.architectures import layers
from inference_server.models.architectures.blocks import GatedMLP, SelfAttention
from inference_server.models.architectures.layers import NormWeights
from inference_server.models.architectures.ops import REFERENCE_OPS, Fusions, Ops
from inference_server.models.spec import NormStyle


def cpu_int8_ops() -> Ops:
    """The CPU table of an int8 model: the reference with the CPU int8 matmul, the fused weights (bind it to a model
    whose weights ``fuse_weights`` fused), Gemma 3's norm in fewer ops and q/k norms and RoPE in one pass."""
    norm = CpuRmsNorm()
    return dataclasses.replace(REFERENCE_OPS, int8_linear=cpu_int8.cpu_int8_linear, norm=norm, fused_weights=True,
                               fusions=Fusions(qk_norm_rope=QkNormRope(norm)))


class CpuRmsNorm:
    """``layers.rms_norm`` (``NormFn``); the ``gemma3`` style of fp32 rows in 8 tensor ops instead of ~19, with the
    same values: ``x * x`` is what ``pow(x, 2)`` computes, ``mean`` is ``sum`` then a division by the row length, and
    the row length and ``eps`` are fp32 0-dim tensors kept here (a Python scalar costs a conversion per op), so each op
    rounds as the reference's does."""

    def __init__(self) -> None:
        self._scalars: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
        if style != "gemma3" or x.dtype != torch.float32:
            return layers.rms_norm(x, weight, eps, style)
        y = x * self.inverse_rms(x, eps)
        return y if weight is None else y.mul_(_plus_one(weight))

    def inverse_rms(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """``rsqrt(mean(x²) + eps)`` over the last dim of fp32 ``x``, keepdim."""
        scalars = self._scalars.get((x.shape[-1], eps))
        if scalars is None:
            scalars = torch.tensor(float(x.shape[-1])), torch.tensor(eps, dtype=torch.float32)
            self._scalars[(x.shape[-1], eps)] = scalars
        return torch.rsqrt((x * x).sum(-1, keepdim=True).div_(scalars[0]).add_(scalars[1]))


_PLUS_ONE = "_cpu_plus_one"  # set on a gemma3 norm weight: (its version counter when made, 1 + weight in fp32)


def _plus_one(weight: torch.Tensor) -> torch.Tensor:
    """``1 + weight`` in fp32 (the reference's ``1.0 + weight.float()``), kept on the weight tensor and remade when the
    weight was written since (its version counter moved)."""
    cached = getattr(weight, _PLUS_ONE, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    made = weight.detach().float() + 1.0
    setattr(weight, _PLUS_ONE, (weight._version, made))
    return made


class QkNormRope:
    """``Ops.qk_norm_rope`` of a Gemma 3 layer on the CPU (``Fusions.qk_norm_rope``): q and k normed and rotated as
    one ``[T, nH + nKV, D]`` tensor, with each head's ``1 + w`` norm weight stacked once per layer (kept by norm
    module for the table's life: the weights must not change after the first step). The same values as the
    composition: both are per (token, head) row. Other norms, dtypes and value norms: None (the composition)."""

    def __init__(self, norm: CpuRmsNorm) -> None:
        self.norm = norm
        self._weights: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()

    def __call__(self, q_raw: torch.Tensor, k_raw: torch.Tensor | None, v_raw: torch.Tensor | None, q_norm: NormWeights,
                 k_norm: NormWeights | None, v_norm: NormWeights | None, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        if k_raw is None or k_norm is None or v_norm is not None or q_raw.dtype != torch.float32 \
                or q_norm.style != "gemma3" or k_norm.style != "gemma3" or q_norm.eps != k_norm.eps \
                or q_norm.weight is None or k_norm.weight is None or not isinstance(q_norm, nn.Module):
            return None
        heads = q_raw.shape[1]
        weight = self._weights.get(q_norm)
        if weight is None or weight.shape[0] != heads + k_raw.shape[1]:
            weight = torch.cat((_plus_one(q_norm.weight).expand(heads, -1),
                                _plus_one(k_norm.weight).expand(k_raw.shape[1], -1)))  # [nH + nKV, D]
            self._weights[q_norm] = weight
        qk = torch.cat((q_raw, k_raw), dim=1)  # [T, nH + nKV, D]
        qk = (qk * self.norm.inverse_rms(qk, q_norm.eps)).mul_(weight)
        qk = layers.apply_rope(qk, cos, sin)
        return qk[:, :heads], qk[:, heads:], v_raw if v_raw is not None else k_raw


def fuse_weights(model: nn.Module) -> None:
    """Fuse every attention layer's q/k/v and every dense MLP's gate/up weights (after quantization: the int8 rows
    and their scales are concatenated, which is exact). Idempotent."""
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.fuse_qkv()
        elif isinstance(module, GatedMLP):
            module.fuse_gate_up()


def cpu_attention_kwargs() -> dict[str, Any]:
    """``PagedAttentionContext`` keyword arguments of the CPU runner: the decode attention and KV store below."""
    return {"store": cpu_store_kv, "decode_attention": cpu_decode_attention}


def cpu_store_kv(
    k: torch.Tensor,  # [T, nKV, D]
    v: torch.Tensor,  # [T, nKV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]; < 0 = skip
) -> None:
    """``ref_store_kv``: one ``index_copy_`` into each flattened cache when every row has a slot (always at decode),
    the reference's masked store otherwise."""
    if bool((slot_mapping < 0).any()):
        ref_store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def cpu_decode_attention(
    q: torch.Tensor,  # [B, nH, D], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    context_lens: torch.Tensor,  # int32 [B], including the query token; 0 = padded slot (output zeros)
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [B, nH, D]
    """``reference_attention.ref_paged_decode_attention``'s values, bit for bit (so a token's attention is the same in
    a decode-only step as in a mixed one, which takes the reference's prefill attention): the query of sequence ``b``
    sits at position ``context_lens[b] - 1`` and sees keys ``[lo, context_lens[b])``, with
    ``lo = max(0, context_lens[b] - window)`` under a window, so no mask is needed. Per sequence: the blocks holding
    those keys gathered (``index_select``), then the reference's two einsums, without its per-step host reads,
    masks and output copy."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q) if batch > 1 else None
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx == 0:
            if out is None:
                return torch.zeros_like(q)
            continue
        lo = max(0, ctx - window) if window is not None else 0
        first, end = lo // block_size, -(-ctx // block_size)
        blocks = block_tables[b, first:end]
        base = first * block_size
        k, v = k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)
        k = k.flatten(0, 1)[lo - base:ctx - base]  # [S, nKV, D]
        v = v.flatten(0, 1)[lo - base:ctx - base]
        # reference_attention._attend_one's ops for a one-token chunk (its causal and window masks hide nothing
        # here): the same operands and einsums, so the same bits as a decode row of a mixed step
        qf = q[b:b + 1].float().view(1, num_kv_heads, group, head_dim)  # [1, nKV, G, D]
        scores = torch.einsum("lhgd,shd->hgls", qf, k.float()) * scale  # [nKV, G, 1, S]
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgls,shd->lhgd", probs, v.float()).reshape(num_heads, head_dim).to(q.dtype)  # [nH, D]
        if out is None:
            return o.unsqueeze(0)
        out[b] = o
    assert out is not None
    return out
