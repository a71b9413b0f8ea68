"""Paged KV storage on the device and the attention context a forward step reads it through.

KV-cache layers fall into *block groups*: group ``FULL_GROUP`` holds the full-attention layers and
group ``SLIDING_GROUP`` the sliding-window layers. Each group has its own block ids and block tables, so
the KV manager can hand sliding blocks that left every window back to the pool while a sequence runs
(see ``core/kv_layout.py`` for the tensor layout). A model with only one kind of layer has one group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import torch

from inference_server.core.kv_layout import CacheLayerSpec
from inference_server.kernels.reference_attention import ref_paged_prefill_attention, ref_store_kv
from inference_server.models.architectures.ops import Ops, RMSNorm
from inference_server.models.spec import LayerSpec

FULL_GROUP = 0
SLIDING_GROUP = 1

StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
AttentionFn = Callable[..., torch.Tensor]
QKV = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]
NormRopeStoreFn = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", RMSNorm, RMSNorm, "RMSNorm | None", torch.Tensor, torch.Tensor,
     torch.Tensor, torch.Tensor, torch.Tensor], "QKV | None"]
"""``ops.qk_norm_rope`` of a layer that computes K/V, also writing k and v into ``(k_cache, v_cache)`` at
``slot_mapping`` as ``StoreFn`` would (the last three arguments); None, having written nothing, when it does not
apply to these inputs (the context then takes the unfused path)."""


class NormRopeDecodeFn(Protocol):
    """Decode attention of a raw q that the attention launch norms and rotates itself (a layer that reads another
    layer's KV: its q is all ``qk_norm_rope`` has to do)."""

    def accepts(self, q_raw: torch.Tensor, q_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether ``__call__`` takes these inputs (asked before the context skips the q norm)."""
        ...

    def __call__(self, q_raw: torch.Tensor, q_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """The decode attention's output ``[B, nH, D]`` for ``rope(q_norm(q_raw))``."""
        ...


def group_of(layer: CacheLayerSpec) -> int:
    return SLIDING_GROUP if layer.window is not None else FULL_GROUP


class PagedKVStorage:
    """K and V tensors ``[num_blocks[group], block_size, nKV, D]`` for every KV-cache layer."""

    def __init__(self, cache_layers: tuple[CacheLayerSpec, ...], num_blocks: dict[int, int], block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.cache_layers = cache_layers
        self.block_size = block_size
        self.num_blocks = dict(num_blocks)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in cache_layers:
            shape = (num_blocks[group_of(layer)], block_size, layer.num_kv_heads, layer.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_block(cache_layers: tuple[CacheLayerSpec, ...], block_size: int, dtype_bytes: int) -> dict[int, int]:
        """Device bytes one block of each group costs (over all the group's layers, K and V)."""
        per_group: dict[int, int] = {}
        for layer in cache_layers:
            group = group_of(layer)
            per_group[group] = per_group.get(group, 0) + block_size * layer.bytes_per_token(dtype_bytes)
        return per_group


@attrs.frozen
class StepTensors:
    """Device tensors describing one step's packed batch (built once per step by the runner).

    ``block_tables[g]`` int32 [B, max_blocks_g]; ``slot_mappings[g]`` int64 [T] (slot of each new token in
    group g, negative = do not store); ``context_lens`` int32 [B] counts cached plus new tokens.
    """

    positions: torch.Tensor  # int64 [T]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]
    block_tables: dict[int, torch.Tensor]
    slot_mappings: dict[int, torch.Tensor]
    is_decode_only: bool


class PagedAttentionContext:
    """``AttentionContext`` over paged storage: store the layer's new K/V, then attend through block tables.

    With ``norm_rope_store`` the K/V store happens in ``qk_norm_rope`` instead, in the kernel that computes k and
    v (one launch fewer per layer); ``attend`` then skips the store for the k it was handed back. With
    ``norm_rope_decode``, at decode-only steps a layer that reads another layer's KV gets its raw q back from
    ``qk_norm_rope``, and ``attend`` of that q runs the attention launch that norms and rotates it (one launch fewer
    per such layer)."""

    def __init__(self, storage: PagedKVStorage, step: StepTensors, store: StoreFn = ref_store_kv,
                 prefill_attention: AttentionFn = ref_paged_prefill_attention,
                 decode_attention: AttentionFn | None = None, norm_rope_store: NormRopeStoreFn | None = None,
                 norm_rope_decode: NormRopeDecodeFn | None = None) -> None:
        self.storage = storage
        self.step = step
        self.positions = step.positions
        self._store = store
        self._prefill = prefill_attention
        self._decode = decode_attention
        self._norm_rope_store = norm_rope_store
        self._stored: dict[int, torch.Tensor] = {}  # KV slot -> the k already in its cache, until attended
        self._norm_rope_decode = norm_rope_decode if decode_attention is not None and step.is_decode_only else None
        self._raw_q: tuple[torch.Tensor, RMSNorm, torch.Tensor, torch.Tensor] | None = None  # q handed back raw

    def _cache_of(self, layer: LayerSpec) -> tuple[torch.Tensor, torch.Tensor, int]:
        slot = layer.kv_slot
        return self.storage.keys[slot], self.storage.values[slot], group_of(self.storage.cache_layers[slot])

    def qk_norm_rope(self, ops: Ops, layer: LayerSpec, q_raw: torch.Tensor, k_raw: torch.Tensor | None,
                     v_raw: torch.Tensor | None, q_norm: RMSNorm, k_norm: RMSNorm | None, v_norm: RMSNorm | None,
                     cos: torch.Tensor, sin: torch.Tensor) -> QKV:
        """``ops.qk_norm_rope``; with ``norm_rope_store``, a layer that computes K/V also stores them here; with
        ``norm_rope_decode``, a layer without K/V gets q back raw, for ``attend`` to norm and rotate."""
        if k_raw is None and self._norm_rope_decode is not None \
                and self._norm_rope_decode.accepts(q_raw, q_norm, cos, sin):
            self._raw_q = (q_raw, q_norm, cos, sin)
            return q_raw, None, None
        if self._norm_rope_store is not None and k_raw is not None and k_norm is not None:
            k_cache, v_cache, group = self._cache_of(layer)
            fused = self._norm_rope_store(q_raw, k_raw, v_raw, q_norm, k_norm, v_norm, cos, sin, k_cache, v_cache,
                                          self.step.slot_mappings[group])
            if fused is not None:
                assert fused[1] is not None
                self._stored[layer.kv_slot] = fused[1]
                return fused
        return ops.qk_norm_rope(q_raw, k_raw, v_raw, q_norm, k_norm, v_norm, cos, sin)

    def attend(self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               scale: float, logit_softcap: float | None) -> torch.Tensor:
        if logit_softcap is not None:
            raise NotImplementedError("attention logit softcapping is not supported by the paged kernels")
        k_cache, v_cache, group = self._cache_of(layer)
        if k is not None and v is not None and self._stored.pop(layer.kv_slot, None) is not k:
            self._store(k, v, k_cache, v_cache, self.step.slot_mappings[group])
        tables = self.step.block_tables[group]
        raw, self._raw_q = self._raw_q, None
        if raw is not None and raw[0] is q and self._norm_rope_decode is not None:
            return self._norm_rope_decode(q, raw[1], raw[2], raw[3], k_cache, v_cache, tables,
                                          self.step.context_lens, scale, layer.window)
        if self.step.is_decode_only and self._decode is not None:
            return self._decode(q, k_cache, v_cache, tables, self.step.context_lens, scale, layer.window)
        return self._prefill(q, k_cache, v_cache, tables, self.step.cu_seqlens_q, self.step.context_lens,
                             scale, layer.window)
