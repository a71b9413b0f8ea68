"""``row_logsumexp``: each row's ``logsumexp``, one program a row, bitwise the same whatever the batch around it.

CPU: the Triton interpreter at small shapes (rows over several ``BLOCK`` chunks with a ragged tail, masked ``-inf``
tokens, a fully masked row, a row whose maximum is in its last chunk), against ``torch.logsumexp`` in float64, and the
row-invariance contract (a row alone, inside batches of other sizes, beside other rows). GPU (``gpu``): Gemma's
262,144-token vocabulary at the batch sizes a decode graph meets.
"""

from __future__ import annotations

import pytest
import torch

from inference_server.kernels.row_logsumexp import BLOCK, row_logsumexp

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 8).to(DEV)


def assert_close_to_torch(x: torch.Tensor) -> None:
    expected = torch.logsumexp(x.double(), dim=-1).float()
    got = row_logsumexp(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


def test_matches_torch_logsumexp() -> None:
    for vocab in (1, 37, BLOCK, 2 * BLOCK + 129):  # one chunk, a ragged one, exactly one, several and a tail
        assert_close_to_torch(logits(3, vocab, seed=vocab))


# a masked row's log(0) = -inf, what the test checks, warns in the interpreter's numpy
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_masked_tokens_and_rows() -> None:
    x = logits(4, BLOCK + 300, seed=1)
    x[0, ::3] = float("-inf")  # a grammar's mask
    x[1, :] = float("-inf")  # every token masked
    x[2, : BLOCK + 200] = float("-inf")  # only the last chunk's tail left
    x[3, -1] = 60.0  # the maximum in the last chunk: the running sum rescaled
    got = row_logsumexp(x)
    assert got[1].item() == float("-inf")
    keep = torch.tensor([0, 2, 3])
    torch.testing.assert_close(got[keep], torch.logsumexp(x[keep].double(), dim=-1).float(), rtol=2e-6, atol=2e-6)


def test_a_row_has_the_same_bits_whatever_the_batch() -> None:
    x = logits(9, 2 * BLOCK + 77, seed=2)
    together = row_logsumexp(x)
    for row in range(9):
        assert torch.equal(row_logsumexp(x[row : row + 1].contiguous()), together[row : row + 1])
    # the same row beside other rows, and in a longer batch of copies of others
    mixed = torch.cat([x[4:5], logits(6, x.shape[1], seed=3), x[4:5]])
    got = row_logsumexp(mixed)
    assert torch.equal(got[0], together[4]) and torch.equal(got[-1], together[4])


def test_empty_shapes_and_bad_input() -> None:
    assert row_logsumexp(torch.empty(0, 5, device=DEV)).shape == (0,)
    assert row_logsumexp(torch.empty(2, 0, device=DEV)).eq(float("-inf")).all()
    with pytest.raises(ValueError, match="fp32"):
        row_logsumexp(torch.zeros(2, 4, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        row_logsumexp(torch.zeros(4, 2, device=DEV).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemma_vocabulary_on_the_gpu() -> None:
    x = logits(64, 262_144, seed=4)
    x[5, ::2] = float("-inf")
    assert_close_to_torch(x)
    together = row_logsumexp(x)
    for batch in (1, 7, 33):
        assert torch.equal(row_logsumexp(x[:batch].contiguous()), together[:batch])
