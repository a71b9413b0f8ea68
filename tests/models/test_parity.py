"""Our forwards against transformers' eager forward on tiny perturbed fixtures (fp32, one torch thread)."""

from __future__ import annotations

import pytest
import torch
from tests.models.conftest import load_hf_folder
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

BATCH, SEQ = 2, 12  # sequences longer than the fixtures' window of 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def input_ids() -> torch.Tensor:
    return torch.randint(3, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, logits_to_keep=0, use_cache=False).logits  # [B, S, V]


def our_full_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    model, spec = load_hf_folder(folder, torch.float32, "cpu")
    cache = ContiguousKVCache(spec)
    batch = ForwardBatch(seq_ids=tuple(range(BATCH)), cached_lens=(0,) * BATCH, query_lens=(SEQ,) * BATCH)
    with torch.no_grad():
        hidden = model(ids.reshape(-1), cache.context(batch, "cpu"))
        return model.compute_logits(hidden).reshape(BATCH, SEQ, -1)


@pytest.mark.parametrize("kind", ["gemma4_dense_ple", "gemma4_dense_ple_cg"])
def test_dense_gemma4_is_bitwise_equal(hf_fixture, kind: str) -> None:
    hf_model, folder = hf_fixture(kind)
    ids = input_ids()
    assert torch.equal(our_full_logits(folder, ids), hf_logits(hf_model, ids))


@pytest.mark.parametrize("kind", ["gemma4_moe", "qwen3_moe", "qwen3_moe_hubformat", "gemma3"])
def test_moe_and_gemma3_match_within_1e4(hf_fixture, kind: str) -> None:
    hf_model, folder = hf_fixture(kind)
    ids = input_ids()
    ours, theirs = our_full_logits(folder, ids), hf_logits(hf_model, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("kind", ["gemma4_dense_ple", "gemma4_moe", "qwen3_moe", "gemma3"])
def test_incremental_decode_equals_full_forward(hf_fixture, kind: str) -> None:
    """Prefill 5 tokens, then feed one token at a time: the logits equal the full forward's."""
    _, folder = hf_fixture(kind)
    ids = input_ids()
    full = our_full_logits(folder, ids)
    model, spec = load_hf_folder(folder, torch.float32, "cpu")
    cache = ContiguousKVCache(spec)
    seqs = tuple(range(BATCH))
    steps = [(0, 5)] + [(p, 1) for p in range(5, SEQ)]
    pieces = []
    with torch.no_grad():
        for start, length in steps:
            batch = ForwardBatch(seq_ids=seqs, cached_lens=(start,) * BATCH, query_lens=(length,) * BATCH)
            hidden = model(ids[:, start:start + length].reshape(-1), cache.context(batch, "cpu"))
            pieces.append(model.compute_logits(hidden).reshape(BATCH, length, -1))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=5e-5, rtol=0)


def test_mixed_batch_of_prefill_and_decode_matches_separate_runs(hf_fixture) -> None:
    """One step packing a prefill chunk of one sequence with a decode of another equals running them alone."""
    _, folder = hf_fixture("gemma4_dense_ple")
    ids = input_ids()
    model, spec = load_hf_folder(folder, torch.float32, "cpu")
    full = our_full_logits(folder, ids)
    cache = ContiguousKVCache(spec)
    with torch.no_grad():
        first = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(SEQ - 1,))
        model(ids[0, : SEQ - 1], cache.context(first, "cpu"))
        mixed = ForwardBatch(seq_ids=(0, 1), cached_lens=(SEQ - 1, 0), query_lens=(1, SEQ))
        hidden = model(torch.cat((ids[0, SEQ - 1:], ids[1])), cache.context(mixed, "cpu"))
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits[0], full[0, -1], atol=5e-5, rtol=0)
    torch.testing.assert_close(logits[1:], full[1], atol=5e-5, rtol=0)
