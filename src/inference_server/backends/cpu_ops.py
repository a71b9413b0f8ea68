"""The CPU engine's ops table and paged-attention functions (``factory.build_runner`` picks them for an int8 model
on the CPU; a float model on the CPU keeps the reference table, which the parity tests compare bit for bit).

A decode step of the embedded model at batch 1 is ~130 small matmuls and ~1,500 small tensor ops; on a small CPU
each op costs a few microseconds of dispatch whatever its size, so the CPU path is the reference's values in fewer
ops (figures: docs/quantization.md):

* the fused q/k/v and gate/up weights (``Ops.fused_weights``: one int8 matmul instead of three and two);
* decode attention over the paged cache as the reference's gather and the two batched matmuls of its einsums per
  sequence (``CpuPagedAttention.decode_attention``: no mask, since a decode query sees every cached key of its
  window; the cache slots each sequence reads found once per step, not once per layer) and the KV store as one
  ``index_copy_`` per tensor (``CpuPagedAttention.store``), where the reference masks and indexes for any chunk
  length.
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
        # addcdiv is eps + 1 * (sum / n): the reference's division then addition, rounded the same, in one op
        return torch.addcdiv(scalars[1], (x * x).sum(-1, keepdim=True), scalars[0]).rsqrt_()


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
    composition: both are per (token, head) row. Other norms, dtypes and value norms: None (the composition).

    RoPE is ``layers.apply_rope``'s ``x * cos + cat(-x2, x1) * sin`` computed as ``x * cos + cat(x2, x1) * sin'``
    with ``sin' = cat(-sin1, sin2)``: a product's rounding does not depend on the operands' signs, so the same bits,
    in 4 ops instead of 8; ``sin'`` and the broadcast ``cos`` are made once per step's table (recognised by the
    ``cos`` tensor, which the decoder makes once a step per layer type and never writes)."""

    def __init__(self, norm: CpuRmsNorm) -> None:
        self.norm = norm
        self._weights: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # id(cos) -> cos, cos', sin'

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
        qk = _adjacent_heads(q_raw, k_raw)  # [T, nH + nKV, D]
        qk = (qk * self.norm.inverse_rms(qk, q_norm.eps)).mul_(weight)
        qk = self._rope(qk, cos, sin)
        return qk[:, :heads], qk[:, heads:], v_raw if v_raw is not None else k_raw

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``layers.apply_rope(x, cos, sin)`` of a contiguous ``x [T, H, D]`` (see the class docstring)."""
        tokens, heads, dim = x.shape
        tables = self._tables.get(id(cos))
        if tables is None or tables[0] is not cos:
            if len(self._tables) >= 4:  # a step has one table per layer type
                self._tables.clear()
            half = dim // 2
            tables = cos, cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]
            self._tables[id(cos)] = tables
        swapped = x.view(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)  # cat(x2, x1)
        return (x * tables[1]).add_(swapped.mul_(tables[2]))


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``torch.cat((q, k), dim=1)`` of ``[T, nH, D]`` and ``[T, nKV, D]``; when k's heads follow q's in memory with
    the same strides (slices of the fused projection's output, ``SelfAttention._split_qkv``), a view of both instead
    of a copy (its readers only read it)."""
    if q.dtype == k.dtype and q.stride() == k.stride() and q.shape[0] == k.shape[0] \
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size():
        return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
    return torch.cat((q, k), dim=1)


def fuse_weights(model: nn.Module) -> None:
    """Fuse every attention layer's q/k/v and every dense MLP's gate/up weights (after quantization: the int8 rows
    and their scales are concatenated, which is exact). Idempotent."""
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.fuse_qkv()
        elif isinstance(module, GatedMLP):
            module.fuse_gate_up()


def cpu_attention_kwargs() -> dict[str, Any]:
    """``PagedAttentionContext`` keyword arguments of the CPU runner: the decode attention and KV store of one
    ``CpuPagedAttention`` (one per runner: it keeps the current step's gather indices)."""
    paged = CpuPagedAttention()
    return {"store": paged.store, "decode_attention": paged.decode_attention}


_Gather = tuple[torch.Tensor, int] | None
"""One sequence's keys for one (block table, window): the cache slots of its first visible block's start up to its
last key, int64 ``[n]``, and how many of them precede its first visible key; None for a padded slot (context 0)."""
KEPT_SLOT_MAPPINGS = 16
"""Slot mappings whose "every row has a slot" check is kept (two groups a step: the last 8 steps')."""


class CpuPagedAttention:
    """The CPU runner's KV store and decode attention over the paged cache (``PagedAttentionContext``'s ``store`` and
    ``decode_attention``), the reference's values in fewer ops: what depends only on the step (which cache slots each
    sequence reads, whether every new token has a slot) is computed once per step and kept, not once per layer.

    The step is recognised by its tensors' identity: the runner makes fresh ``context_lens``, block tables and slot
    mappings for every step and never writes them in place (``ModelRunner._step_tensors``); a caller that does must
    not share one instance across those writes. Not thread-safe (the runner's thread calls it)."""

    def __init__(self) -> None:
        self._context_lens: torch.Tensor | None = None  # the step whose gathers are kept
        self._lens: list[int] = []
        self._gathers: dict[tuple[int, int | None], tuple[torch.Tensor, list[_Gather]]] = {}
        self._slots_valid: dict[int, tuple[torch.Tensor, bool]] = {}
        self._flat: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(cache) -> (cache, [slots, nKV, D] view)

    def _flat_view(self, cache: torch.Tensor) -> torch.Tensor:
        kept = self._flat.get(id(cache))
        if kept is None or kept[0] is not cache:
            if len(self._flat) > 4 * KEPT_SLOT_MAPPINGS * 8:  # a runner has two per layer; anything else: start over
                self._flat.clear()
            kept = cache, cache.view(-1, *cache.shape[2:])
            self._flat[id(cache)] = kept
        return kept[1]

    def store(
        self,
        k: torch.Tensor,  # [T, nKV, D]
        v: torch.Tensor,  # [T, nKV, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D], contiguous
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [T]; < 0 = skip
    ) -> None:
        """``ref_store_kv``: one ``index_copy_`` into each flattened cache when every row has a slot (always at
        decode; checked once per slot mapping), the reference's masked store otherwise."""
        kept = self._slots_valid.get(id(slot_mapping))
        if kept is None or kept[0] is not slot_mapping:
            if len(self._slots_valid) >= KEPT_SLOT_MAPPINGS:
                self._slots_valid.clear()
            kept = slot_mapping, not bool((slot_mapping < 0).any())
            self._slots_valid[id(slot_mapping)] = kept
        if not kept[1]:
            ref_store_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        self._flat_view(k_cache).index_copy_(0, slot_mapping, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
        self._flat_view(v_cache).index_copy_(0, slot_mapping, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))

    def _step_gathers(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                      window: int | None) -> list[_Gather]:
        """Each sequence's ``_Gather`` for this block table and window, computed at the step's first layer."""
        if context_lens is not self._context_lens:
            self._context_lens, self._lens = context_lens, context_lens.tolist()
            self._gathers.clear()
        kept = self._gathers.get((id(block_tables), window))
        if kept is not None and kept[0] is block_tables:
            return kept[1]
        offsets = torch.arange(block_size, dtype=torch.int64)
        gathers: list[_Gather] = []
        for b, ctx in enumerate(self._lens):
            if ctx == 0:
                gathers.append(None)
                continue
            lo = max(0, ctx - window) if window is not None else 0
            first, end = lo // block_size, -(-ctx // block_size)
            blocks = block_tables[b, first:end].long()
            slots = (blocks[:, None] * block_size + offsets).flatten()[:ctx - first * block_size]
            gathers.append((slots, lo - first * block_size))
        self._gathers[(id(block_tables), window)] = block_tables, gathers
        return gathers

    def decode_attention(
        self,
        q: torch.Tensor,  # [B, nH, D], one query token per sequence
        k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # int32 [B, max_blocks]
        context_lens: torch.Tensor,  # int32 [B], including the query token; 0 = padded slot (output zeros)
        scale: float,
        window: int | None,
    ) -> torch.Tensor:  # [B, nH, D]
        """``reference_attention.ref_paged_decode_attention``'s values, bit for bit (so a token's attention is the
        same in a decode-only step as in a mixed one, which takes the reference's prefill attention): the query of
        sequence ``b`` sits at position ``context_lens[b] - 1`` and sees keys ``[lo, context_lens[b])``, with
        ``lo = max(0, context_lens[b] - window)`` under a window, so no mask is needed. Per sequence: the keys and
        values of its visible blocks gathered from the cache slots kept for the step, then sliced from the first
        visible key, as the reference gathers and slices them (the same tensor layout), and the two batched matmuls
        that the reference's einsums run on those operands (``torch.einsum`` reduces a two-operand contraction to
        one ``bmm`` of permuted views: here those views directly), without its per-step host reads, masks and
        output copy."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        gathers = self._step_gathers(block_tables, context_lens, k_cache.shape[1], window)
        k_flat, v_flat = self._flat_view(k_cache), self._flat_view(v_cache)
        out = torch.zeros_like(q) if batch > 1 else None
        for b, gather in enumerate(gathers):
            if gather is None:
                if out is None:
                    return torch.zeros_like(q)
                continue
            slots, skip = gather
            k = k_flat.index_select(0, slots)[skip:]  # [S, nKV, D]
            v = v_flat.index_select(0, slots)[skip:]
            if k.dtype != torch.float32:
                k, v = k.float(), v.float()
            qf = q[b] if q.dtype == torch.float32 else q[b].float()
            # reference_attention._attend_one's einsums for a one-token chunk (its causal and window masks hide
            # nothing here): "lhgd,shd->hgls" is bmm([nKV, G, D], [nKV, D, S]) and "hgls,shd->lhgd" is
            # bmm([nKV, G, S], [nKV, S, D]) of these views, so the same bits as a decode row of a mixed step
            scores = torch.bmm(qf.view(num_kv_heads, group, head_dim), k.permute(1, 2, 0)) * scale  # [nKV, G, S]
            probs = torch.softmax(scores, dim=-1)
            o = torch.bmm(probs, v.transpose(0, 1)).view(num_heads, head_dim)  # [nH, D]
            if o.dtype != q.dtype:
                o = o.to(q.dtype)
            if out is None:
                return o.unsqueeze(0)
            out[b] = o
        assert out is not None
        return out
