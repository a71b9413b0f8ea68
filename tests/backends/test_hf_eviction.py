"""KV eviction policies of the Hugging Face backend: each policy's eviction order on a hand-built cache, and
the budget a runner with a policy never exceeds."""

from __future__ import annotations

import pytest
import torch

from inference_server.backends.hf.eviction_config import EvictionConfig
from inference_server.backends.hf.sequence_kv import SequenceKV
from inference_server.backends.hf_eviction import AttentionSink, HeavyHitters, LeastRecentlyUsed, make_policy

from .hf_testkit import drive, hf_runner, tiny_models

POSITIONS = torch.arange(10)


def test_sink_keeps_the_first_tokens_and_the_most_recent() -> None:
    sink = AttentionSink(sink_tokens=2)
    assert sink.keep(POSITIONS, sink.fresh(POSITIONS), 6).tolist() == [0, 1, 6, 7, 8, 9]
    # A layer that no longer holds the sinks (a sliding window) keeps its most recent tokens.
    window = torch.arange(5, 10)
    assert sink.keep(window, sink.fresh(window), 3).tolist() == [2, 3, 4]
    assert sink.keep(POSITIONS, sink.fresh(POSITIONS), 10).tolist() == list(range(10))


def test_h2o_keeps_the_heaviest_older_tokens_and_the_recent_window() -> None:
    h2o = HeavyHitters(recent_fraction=0.5)
    scores = torch.tensor([5.0, 0.1, 3.0, 0.2, 3.0, 0.3, 9.0, 0.0, 0.0, 0.0])
    # capacity 6: the 3 most recent (7, 8, 9), then the 3 heaviest of 0..6: 6 (9.0), 0 (5.0) and, of the
    # two tied at 3.0, the newer (4).
    assert h2o.keep(POSITIONS, scores, 6).tolist() == [0, 4, 6, 7, 8, 9]


def test_h2o_accumulates_attention_over_heads_queries_and_steps() -> None:
    h2o = HeavyHitters()
    weights = torch.tensor([[[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]]])  # [1, 2, 2, 3]
    observed = h2o.observe(weights, torch.tensor([[3, 4]]))
    assert observed.tolist() == [[pytest.approx(1.7), pytest.approx(0.8), pytest.approx(1.5)]]
    assert h2o.merge(torch.tensor([1.0, 1.0, 0.0]), observed[0]).tolist() == pytest.approx([2.7, 1.8, 1.5])


def test_lru_marks_each_querys_top_keys_as_used_and_evicts_the_least_recent() -> None:
    lru = LeastRecentlyUsed(top_k=1)
    # One head, two queries at positions 10 and 11 over 4 keys: query 10's top key is 1, query 11's is 0;
    # the zero row is a padded query and uses nothing.
    weights = torch.tensor([[[[0.1, 0.6, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1], [0.0, 0.0, 0.0, 0.0]]]])
    observed = lru.observe(weights, torch.tensor([[10, 11, 11]]))
    assert observed.tolist() == [[11, 10, -1, -1]]
    positions = torch.tensor([0, 1, 2, 3])
    stats = lru.merge(lru.fresh(positions), observed[0])  # last use: [11, 10, 2, 3]
    assert lru.keep(positions, stats, 3).tolist() == [0, 1, 3]  # token 2 was used least recently
    # Equal last use: the newer token stays.
    assert lru.keep(positions, torch.tensor([5, 5, 5, 5]), 2).tolist() == [2, 3]


def test_sink_eviction_renumbers_positions_and_rerotates_keys() -> None:
    """After the middle leaves, a recent key equals the key the model computes at its new position."""
    model, _ = tiny_models("gemma3-tiny")
    runner = hf_runner(model)
    keys = torch.randn(2, 1, 16)
    layer = 3  # the full-attention layer
    at_seven = runner.rotation.shift(keys, layer, 7)
    assert torch.allclose(runner.rotation.shift(at_seven, layer, -5), runner.rotation.shift(keys, layer, 2),
                          atol=1e-5)
    kv = SequenceKV((None,))
    kv.append(0, torch.zeros(1, 10, 16), torch.zeros(1, 10, 16), torch.arange(10), torch.zeros(10))
    moved = []
    kv.make_room(AttentionSink(2), budget=8, incoming=2, shift_keys=lambda k, i, d: moved.append(d) or k + d,
                 pinned=2)
    layer_kv = kv.layers[0]
    assert layer_kv is not None
    assert layer_kv.positions.tolist() == [0, 1, 6, 7, 8, 9] and kv.rope_shift == 4 and moved == [-4]
    assert layer_kv.keys[0, :, 0].tolist() == [0, 0, -4, -4, -4, -4]  # the sinks did not move
    assert kv.rope_positions(torch.tensor([1, 10]), pinned=2).tolist() == [1, 6]


@pytest.mark.parametrize("policy", ["sink", "h2o", "lru"])
def test_a_runner_with_a_policy_never_holds_more_than_the_budget(policy: str, one_torch_thread: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences far longer than the budget (chunked prompts and decodes): no layer of any sequence holds more
    than the budget after a step, nor while attending (the keys each attention call sees)."""
    budget = 16
    model, _ = tiny_models("gemma3-tiny")
    runner = hf_runner(model, EvictionConfig(policy, budget, 2))
    widest: list[int] = []
    from inference_server.backends.hf import attention

    original = attention.step_attention

    def watching(module, query, key, value, mask, **kwargs):  # type: ignore[no-untyped-def]
        step = attention.CURRENT_STEP.get()
        assert step is not None
        index = step.layer_of(key, module.layer_idx)
        widest.append(int((step._kv_positions[index] >= 0).sum(dim=1).max()))
        return original(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(attention, "step_attention", watching)
    attention.register_attention()
    prompts = [list(range(3, 40)), list(range(100, 121))]
    try:
        outputs = drive(runner, prompts, new_tokens=12, chunk=24)
    finally:
        monkeypatch.undo()
        attention.register_attention()
    assert [len(out) for out in outputs] == [12, 12]
    assert widest and max(widest) <= budget
    for kv in runner.caches.values():
        assert kv.seen > budget and 0 < kv.max_len() <= budget


def test_make_policy_names() -> None:
    assert make_policy("none") is None
    assert [make_policy(name).name for name in ("sink", "h2o", "lru")] == ["sink", "h2o", "lru"]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown"):
        make_policy("fifo")
