"""``greedy_head.greedy_head_of_logits``: the fused greedy head's soft-cap, statistics and combine over logits a
head GEMV already wrote, against the reference (``reference_greedy_head``: ``logits_reference`` + the sampler's
greedy choice) on the same logits, and against the fused head.

CPU: the Triton interpreter at small shapes (vocabularies across several 1,024-entry slices with a ragged tail,
1-20 rows, bf16 and fp32, soft-cap on and off). The logits are the reference GEMM's own, so every token must be the
reference's argmax exactly (no summation-order slack) and ties go to the first index across slices; logprobs agree
within fp32 rounding of the two log-sum-exps. GPU (``gpu``): Gemma-4-E4B's head [262,144 x 2,560] at 1 and 2 rows
through the tuned GEMV, equal to the fused head's tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tests.kernels.reference_greedy_head import greedy_head_reference

from inference_server.kernels.greedy_head import LOGIT_SLICE, greedy_head, greedy_head_of_logits

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize(("rows", "vocab", "hidden_size"), [(1, 300, 64), (2, 2500, 48), (5, 1024, 32),
                                                           (20, 3073, 16)])
def test_equals_the_reference_on_the_same_logits(rows: int, vocab: int, hidden_size: int, softcap: float | None,
                                                 dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    hidden = torch.randn(rows, hidden_size, generator=gen).to(DEV, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 4 / math.sqrt(hidden_size)).to(DEV, dtype)
    ids, logprobs = greedy_head_of_logits(F.linear(hidden, weight), softcap)  # logits_reference's GEMM
    ref_ids, ref_logprobs = greedy_head_reference(hidden, weight, softcap)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32 and ids.shape == (rows,)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_ties_take_the_first_index_across_slices(dtype: torch.dtype, softcap: float | None) -> None:
    """Integer logits with each row's maximum planted at three indices in different slices (the first not always
    in the first slice): the token is the first of them, as ``torch.argmax``."""
    rows, vocab = 4, 3 * LOGIT_SLICE + 100
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(-8, 8, (rows, vocab), generator=gen).float()
    planted = []
    for r in range(rows):
        at = [LOGIT_SLICE * (1 + r % 2) + 17 * r, 2 * LOGIT_SLICE + 400 + r, vocab - 1 - r]
        logits[r, at] = 9.0
        planted.append(at[0])
    ids, logprobs = greedy_head_of_logits(logits.to(DEV, dtype), softcap)
    assert ids.tolist() == planted
    low = logits.to(dtype)  # the soft-cap in the logits' dtype, as logits_reference computes it
    capped = (low if softcap is None else torch.tanh(low / softcap) * softcap).float()
    expected = capped.gather(1, ids.cpu()[:, None]).squeeze(1) - torch.logsumexp(capped, dim=-1)
    assert torch.allclose(logprobs.cpu(), expected, atol=1e-4, rtol=0)


def test_agrees_with_the_fused_head() -> None:
    """The same hidden rows through the fused head and through a GEMV's logits: the same tokens wherever the top
    two logits are apart (the two GEMMs differ in summation order only), logprobs within 1e-3."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 96, generator=gen).to(DEV, torch.bfloat16)
    weight = (torch.randn(1500, 96, generator=gen) * 0.4).to(DEV, torch.bfloat16)
    fused_ids, fused_logprobs = greedy_head(hidden, weight, 30.0)
    ids, logprobs = greedy_head_of_logits(F.linear(hidden, weight), 30.0)
    top2 = torch.tanh(F.linear(hidden, weight).float() / 30.0).mul(30.0).topk(2, dim=-1).values
    apart = (top2[:, 0] - top2[:, 1]) > 0.25
    assert torch.equal(ids[apart], fused_ids[apart])
    assert torch.allclose(logprobs, fused_logprobs, atol=1e-3, rtol=0)


def test_same_logits_same_bits_and_no_rows() -> None:
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)
    first, second = greedy_head_of_logits(logits, 30.0), greedy_head_of_logits(logits, 30.0)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    ids, logprobs = greedy_head_of_logits(logits[:0], None)
    assert ids.shape == logprobs.shape == (0,)


@pytest.mark.parametrize("bad", ["1d", "fp16", "strided", "empty vocab"])
def test_rejects(bad: str) -> None:
    logits = torch.randn(2, 64)
    operand = {"1d": logits[0], "fp16": logits.half(), "strided": logits.t(), "empty vocab": logits[:, :0]}[bad]
    with pytest.raises(ValueError):
        greedy_head_of_logits(operand, None)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2])
def test_gemma_4_e4b_head_through_the_tuned_gemv(rows: int) -> None:
    from inference_server.kernels.dense_linear import dense_linear

    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, 2560, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(262_144, 2560, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    ids, logprobs = greedy_head_of_logits(dense_linear(hidden, weight), 30.0)
    fused_ids, fused_logprobs = greedy_head(hidden, weight, 30.0)
    assert torch.equal(ids, fused_ids)
    assert torch.allclose(logprobs, fused_logprobs, atol=1e-3, rtol=0)
