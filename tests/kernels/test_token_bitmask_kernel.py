"""``token_bitmask.apply_token_bitmask_``: the listed rows' disallowed logits become ``-inf`` and nothing else
changes, exactly as the torch reference (``token_bitmask_reference``) does.

CPU: the Triton interpreter at small shapes (vocabularies across several ``BLOCK``-token programs with a ragged
tail, words with bit 31 set, masks wider than the vocabulary, a subset of rows in any order, fp32 and bf16).
GPU (``gpu``): Gemma's 262,144-id vocabulary, 64 of 80 rows, against the reference.
"""

from __future__ import annotations

import pytest
import torch

from inference_server.kernels.token_bitmask import (
    BLOCK,
    apply_token_bitmask_,
    token_bitmask_reference,
    warm_up_token_bitmask,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_bits(rows: int, words: int, density: float, seed: int) -> torch.Tensor:
    """``[rows, words]`` int32 with each bit set with probability ``density`` (bit 31 included)."""
    gen = torch.Generator().manual_seed(seed)
    bits = (torch.rand(rows, words, 32, generator=gen) < density).to(torch.int64)
    values = (bits << torch.arange(32)).sum(dim=-1)  # [rows, words] in [0, 2^32)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def check(batch: int, vocab: int, rows: list[int], density: float, dtype: torch.dtype, extra_words: int = 0) -> None:
    gen = torch.Generator().manual_seed(vocab + batch)
    logits = torch.randn(batch, vocab, generator=gen).to(DEV, dtype)
    bits = random_bits(len(rows), -(-vocab // 32) + extra_words, density, seed=vocab).to(DEV)
    index = torch.tensor(rows, dtype=torch.int64, device=DEV)
    expected = logits.clone()
    token_bitmask_reference(expected, bits, index)
    got = logits.clone()
    apply_token_bitmask_(got, bits, index)
    assert torch.equal(got, expected)
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])
    # the reference itself: exactly the clear bits of each listed row are -inf
    host_bits = bits.cpu().to(torch.int64) & 0xFFFFFFFF
    for k, row in enumerate(rows):
        allowed = [(int(host_bits[k, i // 32]) >> (i % 32)) & 1 == 1 for i in range(vocab)]
        assert torch.isneginf(expected[row].cpu()).tolist() == [not a for a in allowed]


@pytest.mark.parametrize(("batch", "vocab", "rows"), [(1, 100, [0]), (4, BLOCK + 37, [2, 0]),
                                                     (6, 2 * BLOCK + 5, [5, 1, 3]), (3, 64, [0, 1, 2])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_reference(batch: int, vocab: int, rows: list[int], dtype: torch.dtype) -> None:
    check(batch, vocab, rows, density=0.3, dtype=dtype)


def test_all_ones_and_all_zeros_rows_and_a_wider_mask() -> None:
    check(3, 300, [0, 2], density=1.0, dtype=torch.float32, extra_words=2)
    check(3, 300, [1], density=0.0, dtype=torch.float32, extra_words=1)


def test_no_rows_changes_nothing() -> None:
    logits = torch.randn(2, 70, device=DEV)
    kept = logits.clone()
    apply_token_bitmask_(logits, torch.zeros(0, 3, dtype=torch.int32, device=DEV),
                         torch.zeros(0, dtype=torch.int64, device=DEV))
    assert torch.equal(logits, kept)


def test_refuses_a_mask_narrower_than_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(torch.zeros(1, 100, device=DEV), torch.zeros(1, 3, dtype=torch.int32, device=DEV),
                             torch.zeros(1, dtype=torch.int64, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemma_vocabulary_on_the_gpu() -> None:
    vocab, batch = 262_144, 80
    warm_up_token_bitmask(vocab, torch.device("cuda"))
    rows = list(range(0, batch, 5)) + list(range(1, batch, 5)) + list(range(2, batch, 5)) + \
        list(range(3, batch, 5))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen).cuda()
    bits = random_bits(len(rows), vocab // 32, 0.5, seed=1).cuda()
    index = torch.tensor(rows, dtype=torch.int64, device="cuda")
    expected = logits.clone()
    token_bitmask_reference(expected, bits, index)
    apply_token_bitmask_(logits, bits, index)
    assert torch.equal(logits, expected)
