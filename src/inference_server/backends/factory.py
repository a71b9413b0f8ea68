"""Assemble what the executor and the KV allocator own from settings and a loaded model.

Sizes the KV pools (device memory left after the weights on CUDA, ``KV_CACHE_TOKENS`` elsewhere), allocates
the paged storage and builds the step runner for the chosen backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import torch

from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.paged_kv import FULL_GROUP, SLIDING_GROUP, PagedKVStorage
from inference_server.config import Settings, SettingsError
from inference_server.core.kv_capacity import KVGeometry, plan_pool_sizes
from inference_server.core.kv_manager import KVManager
from inference_server.models.architectures.ops import REFERENCE_OPS, Ops
from inference_server.models.loading.source import LoadedModel
from inference_server.models.spec import ModelSpec
from inference_server.runtime import resolve_quantization
from inference_server.startup import phase

CPU_DEFAULT_KV_TOKENS = 16_384  # 0.6 GB of fp32 KV for the embedded model: two full 8k contexts
CPU_MAX_MODEL_LEN = 8192
CUDA_STEP_TOKEN_BUDGET = 2048
CPU_STEP_TOKEN_BUDGET = 256
"""Default step token budget off CUDA: a step must stay short (about a second on a small CPU, see
docs/reliability.md), because aborts, deadlines and new requests are honoured between steps."""
CUDA_PREFILL_BUDGET_FACTOR = 4
"""A CUDA step without decodes takes this many times the step budget by default (``MAX_PREFILL_TOKENS=0``): a long
prompt alone is prefilled in larger chunks, which run closer to the compute limit (docs/benchmarks.md, Prefill)."""


@attrs.frozen
class EngineLimits:
    """Runtime facts derived once (by `engine_limits`): what admission validates against and what the step
    runner sizes its static tables for. Nothing else derives its own model length."""

    max_model_len: int
    """Longest sequence (prompt + output) the engine accepts."""
    vocab_size: int
    kv_capacity_tokens: int
    """Tokens the full-attention KV pool holds: no single sequence can be longer."""
    step_token_budget: int
    """Tokens one step may compute (``MAX_NUM_BATCHED_TOKENS``, or the device's default when it is 0)."""
    prefill_token_budget: int
    """Tokens a step that carries no decodes may compute (``MAX_PREFILL_TOKENS``, or the device's default when it
    is 0); never below ``step_token_budget``. The largest step the runner compiles for."""


def _requested_model_len(settings: Settings, spec: ModelSpec, device: torch.device) -> int:
    """What ``MAX_MODEL_LEN`` and the model's config allow (the CPU default caps an unset length), before the
    KV pool is known. Only the pool's sizing reads it directly; everything else reads `engine_limits`."""
    limit = spec.max_position_embeddings
    if settings.max_model_len:
        return min(settings.max_model_len, limit)
    return min(limit, CPU_MAX_MODEL_LEN) if device.type != "cuda" else limit


def step_budgets(settings: Settings, device: torch.device) -> tuple[int, int]:
    """``(step_token_budget, prefill_token_budget)``: a step's tokens, and those of a step the scheduler gives the
    prefill budget (``MAX_NUM_BATCHED_TOKENS`` and ``MAX_PREFILL_TOKENS`` with the device's defaults)."""
    budget = settings.max_num_batched_tokens or (
        CUDA_STEP_TOKEN_BUDGET if device.type == "cuda" else CPU_STEP_TOKEN_BUDGET)
    prefill_budget = max(budget, settings.max_prefill_tokens or (
        CUDA_PREFILL_BUDGET_FACTOR * budget if device.type == "cuda" else budget))
    return budget, prefill_budget


def engine_limits(settings: Settings, spec: ModelSpec, device: torch.device, kv: KVManager) -> EngineLimits:
    """The engine's limits, from the settings, the model's config and the KV pool that was built.

    ``max_model_len`` is the requested length cut to the full-attention pool's capacity: a request longer
    than the whole pool could never run.
    """
    capacity = kv.full_pool.num_blocks * kv.block_size
    budget, prefill_budget = step_budgets(settings, device)
    return EngineLimits(max_model_len=min(_requested_model_len(settings, spec, device), capacity),
                        vocab_size=spec.vocab_size, kv_capacity_tokens=capacity, step_token_budget=budget,
                        prefill_token_budget=prefill_budget)


def kv_budget(settings: Settings, geometry: KVGeometry, device: torch.device, step_bytes: int = 0) -> int:
    """Bytes for the KV pools: ``KV_CACHE_TOKENS``' worth, or on CUDA ``KV_CACHE_MEMORY_FRACTION`` of the memory
    free now (after the weights) less ``step_bytes``, what the largest step needs beside them
    (``step_memory_reserve``)."""
    if settings.kv_cache_tokens:
        return settings.kv_cache_tokens * geometry.bytes_per_token
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(0, free - step_bytes) * settings.kv_cache_memory_fraction)
    return CPU_DEFAULT_KV_TOKENS * geometry.bytes_per_token


def step_memory_reserve(settings: Settings, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                        backend: str) -> int:
    """Device bytes the custom-cuda runner's largest step allocates beside the weights and the KV pool, measured
    by running it before the pool is sized (``cuda.step_memory.largest_step_bytes``, vLLM's profile run); 0 where
    the pool is not sized from the free memory (``KV_CACHE_TOKENS``, off CUDA, other backends). Without it the pool
    took its fraction of all that was free and Gemma-4-31B's 8,192-token warm-up step ran an 80 GB H100 out of
    memory."""
    if backend != "custom-cuda" or device.type != "cuda" or settings.kv_cache_tokens:
        return 0
    from inference_server.backends.cuda.step_memory import largest_step_bytes

    _, prefill_budget = step_budgets(settings, device)
    with phase("measuring the largest step's memory"):
        return largest_step_bytes(settings, loaded, device, dtype,
                                  max_model_len=_requested_model_len(settings, loaded.spec, device),
                                  largest_step_tokens=prefill_budget)


def build_kv_manager(settings: Settings, spec: ModelSpec, device: torch.device, dtype: torch.dtype, *,
                     prefix_cache: bool, step_bytes: int = 0) -> KVManager:
    """The KV manager (the allocator's block accounting), sized as the device storage would be (``kv_budget``)."""
    model_len = _requested_model_len(settings, spec, device)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    geometry = KVGeometry.from_cache_layers(spec.cache_layers, dtype_bytes=dtype_bytes,
                                            block_size=settings.kv_block_size)
    budget = kv_budget(settings, geometry, device, step_bytes)
    try:
        sizes = plan_pool_sizes(geometry, budget, min(settings.kv_expected_sequence_tokens, model_len))
    except ValueError:  # the budget is below the model's minimum: a setting's error, not a traceback
        least = -(-geometry.minimum_budget_bytes // geometry.bytes_per_token)
        setting = ("KV_CACHE_TOKENS" if settings.kv_cache_tokens or device.type != "cuda"
                   else "KV_CACHE_MEMORY_FRACTION")
        raise SettingsError(f"{setting}: the KV cache would hold {budget // geometry.bytes_per_token} tokens; "
                            f"this model needs at least {least} (one sliding window plus one full-attention "
                            "block)") from None
    windows = {layer.window for layer in spec.cache_layers if layer.window is not None}
    return KVManager(block_size=settings.kv_block_size, num_full_blocks=sizes.num_full_blocks,
                     num_sliding_blocks=sizes.num_sliding_blocks, sliding_window=max(windows) if windows else None,
                     enable_prefix_cache=prefix_cache)


def prepare_weights(loaded: LoadedModel, device: torch.device, backend: str) -> None:
    """Transform the loaded weights as the backend's runner will, before the KV pool is sized from the free device
    memory (``kv_budget``): the custom-cuda runner fuses q/k/v and gate/up (``cuda.runner.fuse_model_weights``),
    which copies each layer's weights before freeing the originals. Run after the pool had taken its fraction of
    what was free, that ran the device out of memory (Gemma-4-31B in bf16 on an 80 GB H100); here the copies use
    memory that is still free, and the originals go back to the device (``empty_cache``) before the pool is sized."""
    if backend != "custom-cuda":
        return
    from inference_server.backends.cuda.runner import fuse_model_weights

    with phase("fusing the projection weights"):
        fuse_model_weights(loaded.model)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_kv(settings: Settings, loaded: LoadedModel, device: torch.device,
             dtype: torch.dtype, step_bytes: int = 0) -> tuple[KVManager, PagedKVStorage]:
    """The KV manager (allocator state) and the matching device storage, leaving ``step_bytes`` free
    (``step_memory_reserve``)."""
    kv = build_kv_manager(settings, loaded.spec, device, dtype, prefix_cache=settings.enable_prefix_caching,
                          step_bytes=step_bytes)
    num_blocks = {FULL_GROUP: kv.full_pool.num_blocks}
    if kv.sliding_pool is not None and kv.sliding_pool.num_blocks:
        num_blocks[SLIDING_GROUP] = kv.sliding_pool.num_blocks
    storage = PagedKVStorage(loaded.spec.cache_layers, num_blocks, settings.kv_block_size, dtype, device)
    return kv, storage


def build_runner(settings: Settings, loaded: LoadedModel, storage: PagedKVStorage, device: torch.device,
                 backend: str, limits: EngineLimits) -> ModelRunner:
    """The step runner of the chosen backend (``reference`` or ``custom-cuda``). An int8 model on the CPU computes
    through the CPU table (``backends.cpu_ops``: the reference with the CPU int8 matmul of ``kernels.cpu_int8`` and
    the fused weights) and the CPU decode attention. ``DETERMINISTIC`` replaces the GEMMs and attention by the
    batch-invariant ones (``backends.deterministic``; the custom-cuda runner's table is ``op_table.cuda_ops``'s)."""
    ops: Ops = REFERENCE_OPS
    attention: dict[str, Any] = {}
    if resolve_quantization(settings, device, backend) == "int8" and device.type == "cpu":
        from inference_server.backends import cpu_ops
        from inference_server.kernels import cpu_int8

        if settings.deterministic:
            # the batch-invariant table is tested bitwise on the reference's unfused weights and norms: it keeps them
            ops = dataclasses.replace(REFERENCE_OPS, int8_linear=cpu_int8.cpu_int8_linear)
        else:
            cpu_ops.fuse_weights(loaded.model)
            ops, attention = cpu_ops.cpu_int8_ops(), cpu_ops.cpu_attention_kwargs()
            if cpu_int8._fbgemm_8bit_safe():  # the head runs through fbgemm: pack it now, not in the first request
                with phase("packing the int8 lm_head for fbgemm"):
                    cpu_int8.prepack_large_weights(loaded.model)
    if backend == "custom-cuda":
        from inference_server.backends.cuda.runner import build_cuda_runner

        return build_cuda_runner(settings, loaded, storage, device, max_model_len=limits.max_model_len,
                                 largest_step_tokens=limits.prefill_token_budget)
    if settings.deterministic:
        from inference_server.backends import deterministic

        ops, attention = deterministic.cpu_ops(ops), deterministic.cpu_attention_kwargs()
    return ModelRunner(loaded.model, loaded.spec, storage, device, ops=ops, attention_kwargs=attention,
                       deterministic=settings.deterministic)
