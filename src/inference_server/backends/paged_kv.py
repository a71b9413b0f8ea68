"""Paged KV storage on the device and the attention context a forward step reads it through.

KV-cache layers fall into *block groups*: group ``FULL_GROUP`` holds the full-attention layers and
group ``SLIDING_GROUP`` the sliding-window layers. Each group has its own block ids and block tables, so
the KV manager can hand sliding blocks that left every window back to the pool while a sequence runs
(see ``core/kv_layout.py`` for the tensor layout). A model with only one kind of layer has one group.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from inference_server.core.kv_layout import CacheLayerSpec
from inference_server.kernels.reference_attention import ref_paged_prefill_attention, ref_store_kv
from inference_server.models.spec import LayerSpec

FULL_GROUP = 0
SLIDING_GROUP = 1

StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
AttentionFn = Callable[..., torch.Tensor]


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
    """``AttentionContext`` over paged storage: store the layer's new K/V, then attend through block tables."""

    def __init__(self, storage: PagedKVStorage, step: StepTensors, store: StoreFn = ref_store_kv,
                 prefill_attention: AttentionFn = ref_paged_prefill_attention,
                 decode_attention: AttentionFn | None = None) -> None:
        self.storage = storage
        self.step = step
        self.positions = step.positions
        self._store = store
        self._prefill = prefill_attention
        self._decode = decode_attention

    def attend(self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               scale: float, logit_softcap: float | None) -> torch.Tensor:
        if logit_softcap is not None:
            raise NotImplementedError("attention logit softcapping is not supported by the paged kernels")
        slot = layer.kv_slot
        group = group_of(self.storage.cache_layers[slot])
        k_cache, v_cache = self.storage.keys[slot], self.storage.values[slot]
        if k is not None and v is not None:
            self._store(k, v, k_cache, v_cache, self.step.slot_mappings[group])
        tables = self.step.block_tables[group]
        if self.step.is_decode_only and self._decode is not None:
            return self._decode(q, k_cache, v_cache, tables, self.step.context_lens, scale, layer.window)
        return self._prefill(q, k_cache, v_cache, tables, self.step.cu_seqlens_q, self.step.context_lens,
                             scale, layer.window)
