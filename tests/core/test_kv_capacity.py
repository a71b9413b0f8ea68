"""KV capacity figures, checked against the per-token bytes of models.md section 3 and pinned to the table
in docs/kv_cache.md (Gemma 4 family and Qwen3-30B-A3B on one H200). The capacity calculators below (a KV budget,
the longest sequence, how many sequences fit) compute only that table, so they live here, beside it."""

from __future__ import annotations

import pytest

from inference_server.core.kv_capacity import KVGeometry, PoolSizes, plan_pool_sizes
from inference_server.core.kv_layout import CacheLayerSpec

H200_BYTES = 141 * 10**9


def kv_budget_bytes(device_bytes: int, weight_bytes: int, *, headroom_fraction: float = 0.10) -> int:
    """Bytes left for KV: the device memory less a headroom fraction (activations, CUDA graphs, allocator
    slack, the CUDA context) less the weights."""
    budget = int(device_bytes * (1.0 - headroom_fraction)) - weight_bytes
    if budget <= 0:
        raise ValueError(f"no KV budget: {device_bytes} B device, {weight_bytes} B weights")
    return budget


def sequence_bytes(geometry: KVGeometry, num_tokens: int, *, window_aware: bool) -> int:
    """KV bytes one sequence of ``num_tokens`` tokens occupies, in whole blocks."""
    num_blocks = -(-num_tokens // geometry.block_size)
    if not window_aware:
        return num_blocks * geometry.block_size * geometry.bytes_per_token
    return num_blocks * geometry.full_block_bytes + geometry.sliding_blocks_per_sequence(num_tokens) * (
        geometry.sliding_block_bytes
    )


def max_sequence_tokens(geometry: KVGeometry, budget_bytes: int, *, window_aware: bool) -> int:
    """Longest single sequence (whole blocks) whose KV fits in ``budget_bytes``."""
    block = geometry.block_size
    if not window_aware or geometry.sliding_window is None:
        return budget_bytes // (block * geometry.bytes_per_token) * block
    if geometry.full_bytes_per_token == 0:
        raise ValueError("a window-aware cache without full-attention layers holds unbounded context")
    window_blocks = geometry.sliding_blocks_per_window
    if budget_bytes < window_blocks * block * geometry.bytes_per_token:
        return budget_bytes // (block * geometry.bytes_per_token) * block
    num_blocks = (budget_bytes - window_blocks * geometry.sliding_block_bytes) // geometry.full_block_bytes
    return num_blocks * block


def max_concurrent_sequences(
    geometry: KVGeometry, budget_bytes: int, sequence_tokens: int, *, window_aware: bool
) -> int:
    """How many sequences of ``sequence_tokens`` tokens fit in ``budget_bytes`` at once."""
    return budget_bytes // sequence_bytes(geometry, sequence_tokens, window_aware=window_aware)


def gemma4_cache_layers(
    num_sliding: int, num_full: int, sliding_kv_heads: int, full_kv_heads: int, window: int
) -> list[CacheLayerSpec]:
    """Gemma 4 cache layers: sliding head_dim 256, full head_dim 512 (K=V layers still cache K and V)."""
    return [CacheLayerSpec(sliding_kv_heads, 256, window)] * num_sliding + [
        CacheLayerSpec(full_kv_heads, 512, None)
    ] * num_full


MODELS: dict[str, tuple[list[CacheLayerSpec], int]] = {  # cache layers, bf16 weight bytes
    "gemma-4-E2B": (gemma4_cache_layers(12, 3, 1, 1, 512), 9_260_000_000),
    "gemma-4-E4B": (gemma4_cache_layers(20, 4, 2, 2, 512), 14_930_000_000),
    "gemma-4-26B-A4B": (gemma4_cache_layers(25, 5, 8, 2, 1024), 50_470_000_000),
    "gemma-4-31B": (gemma4_cache_layers(50, 10, 16, 4, 1024), 61_390_000_000),
    "Qwen3-30B-A3B": ([CacheLayerSpec(4, 128, None)] * 48, 61_060_000_000),
}


def geometry(model: str) -> KVGeometry:
    return KVGeometry.from_cache_layers(MODELS[model][0], dtype_bytes=2, block_size=16)


def budget(model: str) -> int:
    return kv_budget_bytes(H200_BYTES, MODELS[model][1], headroom_fraction=0.10)


@pytest.mark.parametrize(
    ("model", "bytes_below_window", "bytes_beyond_window"),
    [
        ("gemma-4-E2B", 18_432, 6_144),
        ("gemma-4-E4B", 57_344, 16_384),
        ("gemma-4-26B-A4B", 225_280, 20_480),
        ("gemma-4-31B", 901_120, 81_920),
        ("Qwen3-30B-A3B", 98_304, 98_304),
    ],
)
def test_bytes_per_token_match_models_md(model: str, bytes_below_window: int, bytes_beyond_window: int) -> None:
    assert geometry(model).bytes_per_token == bytes_below_window
    assert geometry(model).full_bytes_per_token == bytes_beyond_window


def test_gemma4_31b_on_one_h200() -> None:
    g, kv_budget = geometry("gemma-4-31B"), budget("gemma-4-31B")
    assert kv_budget == 65_510_000_000  # 0.9 x 141 GB - 61.39 GB
    assert g.sliding_window == 1024 and g.sliding_blocks_per_window == 65
    assert sequence_bytes(g, 8192, window_aware=True) == 8192 * 81_920 + 65 * 16 * 819_200  # 1.52 GB
    unaware = max_sequence_tokens(g, kv_budget, window_aware=False)
    aware = max_sequence_tokens(g, kv_budget, window_aware=True)
    assert (unaware, aware) == (72_688, 789_280)
    assert aware / unaware == pytest.approx(10.86, abs=0.01)
    assert max_concurrent_sequences(g, kv_budget, 8192, window_aware=False) == 8
    assert max_concurrent_sequences(g, kv_budget, 8192, window_aware=True) == 43
    assert max_concurrent_sequences(g, kv_budget, 131_072, window_aware=False) == 0
    assert max_concurrent_sequences(g, kv_budget, 131_072, window_aware=True) == 5
    # Below the window both layouts store the same thing.
    assert max_concurrent_sequences(g, kv_budget, 1024, window_aware=True) == 70
    assert max_concurrent_sequences(g, kv_budget, 1024, window_aware=False) == 70


@pytest.mark.parametrize(
    ("model", "unaware", "aware", "seqs_8k_unaware", "seqs_8k_aware"),
    [
        ("gemma-4-E2B", 6_382_368, 19_146_064, 779, 2_070),
        ("gemma-4-E4B", 1_952_592, 6_832_784, 238, 718),
        ("gemma-4-26B-A4B", 339_264, 3_721_520, 41, 200),
        ("gemma-4-31B", 72_688, 789_280, 8, 43),
        ("Qwen3-30B-A3B", 669_744, 669_744, 81, 81),
    ],
)
def test_docs_table(model: str, unaware: int, aware: int, seqs_8k_unaware: int, seqs_8k_aware: int) -> None:
    g, kv_budget = geometry(model), budget(model)
    assert max_sequence_tokens(g, kv_budget, window_aware=False) == unaware
    assert max_sequence_tokens(g, kv_budget, window_aware=True) == aware
    assert max_concurrent_sequences(g, kv_budget, 8192, window_aware=False) == seqs_8k_unaware
    assert max_concurrent_sequences(g, kv_budget, 8192, window_aware=True) == seqs_8k_aware


def test_small_budget_below_one_window() -> None:
    g = KVGeometry(block_size=16, full_bytes_per_token=10, sliding_bytes_per_token=90, sliding_window=1024)
    assert max_sequence_tokens(g, 16 * 100 * 3 + 5, window_aware=True) == 48
    sliding_only = KVGeometry(block_size=16, full_bytes_per_token=0, sliding_bytes_per_token=90, sliding_window=64)
    with pytest.raises(ValueError):
        max_sequence_tokens(sliding_only, 10**9, window_aware=True)


def test_plan_pool_sizes_fits_the_budget_and_the_expected_workload() -> None:
    g, kv_budget = geometry("gemma-4-31B"), budget("gemma-4-31B")
    sizes = plan_pool_sizes(g, kv_budget, expected_sequence_tokens=8192)
    assert sizes == PoolSizes(num_full_blocks=22_030, num_sliding_blocks=2_795)
    used = sizes.num_full_blocks * g.full_block_bytes + sizes.num_sliding_blocks * g.sliding_block_bytes
    assert kv_budget - g.full_block_bytes < used <= kv_budget
    # 43 sequences of 8k tokens fit both pools at once.
    assert sizes.num_full_blocks >= 43 * 512 and sizes.num_sliding_blocks >= 43 * 65
    tiny = plan_pool_sizes(g, 2 * 10**9, expected_sequence_tokens=10**7)
    assert tiny.num_sliding_blocks == g.sliding_blocks_per_window  # always one whole window
    qwen = plan_pool_sizes(geometry("Qwen3-30B-A3B"), budget("Qwen3-30B-A3B"), 8192)
    assert qwen == PoolSizes(num_full_blocks=41_859, num_sliding_blocks=0)
    with pytest.raises(ValueError):
        plan_pool_sizes(g, 10**6, 8192)


def test_kv_budget_rejects_weights_that_do_not_fit() -> None:
    with pytest.raises(ValueError):
        kv_budget_bytes(H200_BYTES, 130 * 10**9)
