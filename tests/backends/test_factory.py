"""``engine_limits``: the one place ``max_model_len`` is derived (settings, model config, KV pool)."""

from __future__ import annotations

import re

import pytest
import torch

from inference_server.backends.factory import (
    CPU_MAX_MODEL_LEN,
    CPU_STEP_TOKEN_BUDGET,
    CUDA_PREFILL_BUDGET_FACTOR,
    CUDA_STEP_TOKEN_BUDGET,
    build_kv_manager,
    engine_limits,
)
from inference_server.config import Settings, SettingsError
from inference_server.core.kv_manager import KVManager
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import parse_model_spec

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only the device type is read; nothing is allocated
QWEN = parse_model_spec(preset_config("qwen3-30b-a3b"))  # max_position_embeddings 40960


def pool(tokens: int, block_size: int = 16) -> KVManager:
    return KVManager(block_size=block_size, num_full_blocks=tokens // block_size)


@pytest.mark.parametrize(
    ("device", "configured", "pool_tokens", "expected"),
    [
        (CPU, 0, 1_000_000, CPU_MAX_MODEL_LEN),  # CPU default cap on an unset length
        (CUDA, 0, 1_000_000, 40960),  # the model's own limit on CUDA
        (CPU, 20_000, 1_000_000, 20_000),  # MAX_MODEL_LEN overrides the CPU cap
        (CUDA, 100_000, 1_000_000, 40960),  # ... but never the model's limit
        (CUDA, 0, 4096, 4096),  # a pool smaller than the context cuts it
        (CPU, 2048, 4096, 2048),
    ],
)
def test_max_model_len_is_the_smallest_of_settings_model_and_pool(
    device: torch.device, configured: int, pool_tokens: int, expected: int
) -> None:
    limits = engine_limits(Settings(max_model_len=configured), QWEN, device, pool(pool_tokens))
    assert limits.max_model_len == expected
    assert limits.kv_capacity_tokens == pool_tokens
    assert limits.vocab_size == QWEN.vocab_size


@pytest.mark.parametrize(
    ("device", "configured", "expected"),
    [
        (CPU, 0, CPU_STEP_TOKEN_BUDGET),  # a short step on a CPU: aborts and deadlines wait at most one step
        (CUDA, 0, CUDA_STEP_TOKEN_BUDGET),
        (CPU, 4096, 4096),  # MAX_NUM_BATCHED_TOKENS wins wherever it is set
        (CUDA, 512, 512),
    ],
)
def test_the_step_token_budget_is_sized_to_the_device(device: torch.device, configured: int, expected: int) -> None:
    limits = engine_limits(Settings(max_num_batched_tokens=configured), QWEN, device, pool(65_536))
    assert limits.step_token_budget == expected
    assert CPU_STEP_TOKEN_BUDGET < CUDA_STEP_TOKEN_BUDGET


@pytest.mark.parametrize(
    ("device", "step", "prefill", "expected"),
    [
        (CPU, 0, 0, CPU_STEP_TOKEN_BUDGET),  # a CPU step stays short with or without decodes
        (CUDA, 0, 0, CUDA_PREFILL_BUDGET_FACTOR * CUDA_STEP_TOKEN_BUDGET),
        (CUDA, 512, 0, CUDA_PREFILL_BUDGET_FACTOR * 512),  # follows a configured step budget
        (CPU, 0, 1024, 1024),  # MAX_PREFILL_TOKENS wins wherever it is set...
        (CUDA, 4096, 1024, 4096),  # ...but never below the step budget
    ],
)
def test_the_prefill_step_budget(device: torch.device, step: int, prefill: int, expected: int) -> None:
    settings = Settings(max_num_batched_tokens=step, max_prefill_tokens=prefill)
    assert engine_limits(settings, QWEN, device, pool(65_536)).prefill_token_budget == expected


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gemma-4-e2b"])  # full attention only; sliding + full
def test_a_kv_cache_too_small_for_the_model_is_a_settings_error(preset: str) -> None:
    """A ``KV_CACHE_TOKENS`` below one sliding window plus one full-attention block used to stop start-up with a
    ``ValueError`` traceback (or, without a sliding group, build an empty pool); it is a ``SettingsError`` naming
    the setting and the least value that works, and that value builds (a ``BlockPool`` refuses zero blocks)."""
    spec = parse_model_spec(preset_config(preset))
    with pytest.raises(SettingsError, match="KV_CACHE_TOKENS") as refused:
        build_kv_manager(Settings(kv_cache_tokens=1), spec, CPU, torch.float32, prefix_cache=False)
    least = int(re.search(r"at least (\d+)", str(refused.value)).group(1))  # type: ignore[union-attr]
    with pytest.raises(SettingsError):
        build_kv_manager(Settings(kv_cache_tokens=least - 1), spec, CPU, torch.float32, prefix_cache=False)
    build_kv_manager(Settings(kv_cache_tokens=least), spec, CPU, torch.float32, prefix_cache=False)  # builds


def test_prepare_weights_fuses_as_the_custom_cuda_runner_reads_them_and_keeps_every_value() -> None:
    """``prepare_weights`` (run before the KV pool is sized) fuses q/k/v and gate/up for custom-cuda only; the
    projections' weights become views of the fused matrix with the same values, so the model computes the same."""
    from inference_server.backends.factory import prepare_weights
    from inference_server.models.architectures.blocks import GatedMLP, SelfAttention
    from inference_server.models.loading.source import load_model

    settings = Settings(model="gemma-4-26b-a4b-tiny", dummy_weights=True, quantization="none")
    loaded = load_model(settings, torch.device("cpu"), torch.float32)
    attention = [m for m in loaded.model.modules() if isinstance(m, SelfAttention) and m.layer.computes_kv]
    mlps = [m for m in loaded.model.modules() if isinstance(m, GatedMLP)]
    assert attention and mlps
    before = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    prepare_weights(loaded, torch.device("cpu"), "reference")
    assert all(m.qkv_weight is None for m in attention) and all(m.gate_up_weight is None for m in mlps)
    prepare_weights(loaded, torch.device("cpu"), "custom-cuda")
    assert all(m.qkv_weight is not None for m in attention) and all(m.gate_up_weight is not None for m in mlps)
    assert mlps[0].gate_proj.weight.data_ptr() == mlps[0].gate_up_weight.data_ptr()
    after = loaded.model.state_dict()
    assert before.keys() <= after.keys() and all(torch.equal(after[name], t) for name, t in before.items())


def test_the_engine_prepares_the_weights_before_it_sizes_the_kv_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order that lets Gemma-4-31B start on an 80 GB GPU: the weights' fusion copies need free memory, and
    the KV pool takes a fraction of what is free when it is built."""
    from inference_server import engine_factory

    calls: list[str] = []
    prepare, build = engine_factory.prepare_weights, engine_factory.build_kv

    def spy_prepare(*args: object) -> None:
        calls.append("prepare_weights")
        prepare(*args)  # type: ignore[arg-type]

    def spy_reserve(*args: object) -> int:
        calls.append("step_memory_reserve")
        return 12_345

    def spy_build(*args: object) -> object:
        calls.append(f"build_kv leaving {args[4]}")
        return build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_factory, "prepare_weights", spy_prepare)
    monkeypatch.setattr(engine_factory, "step_memory_reserve", spy_reserve)
    monkeypatch.setattr(engine_factory, "build_kv", spy_build)
    engine_factory.build_engine_parts(Settings(model="qwen3-30b-a3b-tiny", dummy_weights=True))
    assert calls == ["prepare_weights", "step_memory_reserve", "build_kv leaving 12345"]


def test_the_kv_pool_leaves_the_largest_step_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the pool takes ``KV_CACHE_MEMORY_FRACTION`` of the free memory less what the largest step needs
    (never below zero); ``KV_CACHE_TOKENS`` sizes it alone."""
    from inference_server.backends.factory import kv_budget
    from inference_server.core.kv_capacity import KVGeometry

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    spec = parse_model_spec(preset_config("qwen3-30b-a3b-tiny"))
    geometry = KVGeometry.from_cache_layers(spec.cache_layers, dtype_bytes=2, block_size=16)
    cuda = torch.device("cuda")
    assert kv_budget(Settings(), geometry, cuda) == int(10 * gib * 0.9)
    assert kv_budget(Settings(), geometry, cuda, step_bytes=2 * gib) == int(8 * gib * 0.9)
    assert kv_budget(Settings(), geometry, cuda, step_bytes=11 * gib) == 0
    assert kv_budget(Settings(kv_cache_tokens=100), geometry, cuda, step_bytes=2 * gib) == \
        100 * geometry.bytes_per_token


def test_the_largest_step_is_measured_only_where_the_pool_is_sized_from_free_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """custom-cuda on CUDA without ``KV_CACHE_TOKENS``: the step of the prefill budget (8,192 tokens by default)
    at the requested model length; elsewhere nothing runs and nothing is reserved."""
    from inference_server.backends.cuda import step_memory
    from inference_server.backends.factory import step_memory_reserve
    from inference_server.models.loading.source import LoadedModel

    measured: list[dict[str, int]] = []

    def fake(settings: Settings, loaded: object, device: torch.device, dtype: torch.dtype, **sizes: int) -> int:
        measured.append(sizes)
        return 777

    monkeypatch.setattr(step_memory, "largest_step_bytes", fake)
    spec = parse_model_spec(preset_config("qwen3-30b-a3b-tiny"))
    loaded = LoadedModel(model=None, spec=spec, tokenizer=None, name="tiny", load_seconds=0.0)  # type: ignore[arg-type]
    cuda = torch.device("cuda")
    assert step_memory_reserve(Settings(), loaded, cuda, torch.bfloat16, "custom-cuda") == 777
    assert measured == [dict(max_model_len=spec.max_position_embeddings, largest_step_tokens=8192)]
    assert step_memory_reserve(Settings(kv_cache_tokens=4096), loaded, cuda, torch.bfloat16, "custom-cuda") == 0
    assert step_memory_reserve(Settings(), loaded, cuda, torch.bfloat16, "hf") == 0
    assert step_memory_reserve(Settings(), loaded, CPU, torch.float32, "reference") == 0
    assert len(measured) == 1
