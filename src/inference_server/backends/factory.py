"""Assemble what the executor and the KV allocator own from settings and a loaded model.

Sizes the KV pools (device memory left after the weights on CUDA, ``KV_CACHE_TOKENS`` elsewhere), allocates
the paged storage and builds the step runner for the chosen backend.
"""

from __future__ import annotations

import attrs
import torch

from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.paged_kv import FULL_GROUP, SLIDING_GROUP, PagedKVStorage
from inference_server.config import Settings
from inference_server.core.kv_capacity import KVGeometry, plan_pool_sizes
from inference_server.core.kv_manager import KVManager
from inference_server.models.source import LoadedModel

CPU_DEFAULT_KV_TOKENS = 16_384  # 0.6 GB of fp32 KV for the embedded model: two full 8k contexts
CPU_MAX_MODEL_LEN = 8192


@attrs.frozen
class EngineLimits:
    """Runtime facts derived once: what admission validates against."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int


def max_model_len(settings: Settings, loaded: LoadedModel, device: torch.device) -> int:
    limit = loaded.spec.max_position_embeddings
    if settings.max_model_len:
        return min(settings.max_model_len, limit)
    return min(limit, CPU_MAX_MODEL_LEN) if device.type != "cuda" else limit


def kv_budget(settings: Settings, geometry: KVGeometry, device: torch.device) -> int:
    """Bytes for the KV pools."""
    if settings.kv_cache_tokens:
        return settings.kv_cache_tokens * geometry.bytes_per_token
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * settings.kv_cache_memory_fraction)
    return CPU_DEFAULT_KV_TOKENS * geometry.bytes_per_token


def build_kv(settings: Settings, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
             model_len: int) -> tuple[KVManager, PagedKVStorage]:
    """The KV manager (allocator state) and the matching device storage."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    geometry = KVGeometry.from_cache_layers(loaded.spec.cache_layers, dtype_bytes=dtype_bytes,
                                            block_size=settings.kv_block_size)
    sizes = plan_pool_sizes(geometry, kv_budget(settings, geometry, device),
                            min(settings.kv_expected_sequence_tokens, model_len))
    num_blocks = {FULL_GROUP: sizes.num_full_blocks}
    if sizes.num_sliding_blocks:
        num_blocks[SLIDING_GROUP] = sizes.num_sliding_blocks
    windows = {layer.window for layer in loaded.spec.cache_layers if layer.window is not None}
    kv = KVManager(block_size=settings.kv_block_size, num_full_blocks=sizes.num_full_blocks,
                   num_sliding_blocks=sizes.num_sliding_blocks, sliding_window=max(windows) if windows else None,
                   enable_prefix_cache=settings.enable_prefix_caching)
    storage = PagedKVStorage(loaded.spec.cache_layers, num_blocks, settings.kv_block_size, dtype, device)
    return kv, storage


def build_runner(settings: Settings, loaded: LoadedModel, storage: PagedKVStorage, device: torch.device,
                 backend: str) -> ModelRunner:
    """The step runner of the chosen backend (``reference`` or ``custom-cuda``)."""
    if backend == "custom-cuda":
        from inference_server.backends.cuda_backend import build_cuda_runner

        return build_cuda_runner(settings, loaded, storage, device)
    return ModelRunner(loaded.model, loaded.spec, storage, device)
