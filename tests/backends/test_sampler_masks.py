"""The sampler's token bitmask (structured output): on every path (greedy, temperature, top-k/top-p, min-p,
seeded, penalties, logit edits) a masked row only ever takes allowed tokens, its logprobs and top logprobs
are those of the masked distribution, and an all-ones row is exactly an unmasked row."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from inference_server.backends.sampler import (
    MIN_LOGPROB,
    PenaltyHistory,
    SamplingBatch,
    apply_token_bitmask,
    argmax_suffices,
    make_generator,
    sample,
)
from inference_server.records.constraints import Constraint
from inference_server.records.sampling_params import SamplingParams

VOCAB = 100  # not a multiple of 32: the last word's spare bits are ignored


def bitmask(allowed: list[set[int]]) -> torch.Tensor:
    words = (VOCAB + 31) // 32
    mask = np.zeros((len(allowed), words), dtype=np.uint32)
    for row, ids in enumerate(allowed):
        for i in ids:
            mask[row, i // 32] |= np.uint32(1 << (i % 32))
    return torch.from_numpy(mask.view(np.int32))


def test_apply_token_bitmask_keeps_exactly_the_allowed_ids() -> None:
    allowed = [{0, 31, 32, 63, 99}, set(range(VOCAB)), {50}]
    work = torch.randn(3, VOCAB)
    kept = work.clone()
    apply_token_bitmask(work, bitmask(allowed))
    for row, ids in enumerate(allowed):
        finite = set(torch.isfinite(work[row]).nonzero().flatten().tolist())
        assert finite == ids
        assert torch.equal(work[row][sorted(ids)], kept[row][sorted(ids)])


PATHS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=1.5),
    "top-k-top-p": SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
    "min-p": SamplingParams(temperature=1.0, min_p=0.2),
    "seeded": SamplingParams(temperature=1.0, seed=7),
    "penalties": SamplingParams(temperature=0.7, repetition_penalty=1.5, presence_penalty=1.0),
    "logit-bias": SamplingParams(temperature=1.0, logit_bias=((3, 100.0),)),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_sampling_path_takes_only_allowed_tokens(path: str) -> None:
    params = PATHS[path]
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=rng) * 3
    # rows 0 and 2 are constrained to small sets that exclude the raw argmax; rows 1 and 3 are free
    top = logits.argmax(dim=-1).tolist()
    free = set(range(VOCAB))
    allowed = [{(top[0] + k) % VOCAB for k in (1, 17, 40)}, free, {(top[2] + 9) % VOCAB}, free]
    rows = [params] * 4
    gens = [make_generator(7, "cpu") if p.seed is not None else None for p in rows]
    batch = SamplingBatch.from_params(rows, "cpu", gens, [0] * 4)
    history = PenaltyHistory.from_lists([[1, 2, 3]] * 4, [[top[0], 4]] * 4, "cpu") if batch.use_penalties else None
    for _ in range(20):
        out = sample(logits, batch, history, bitmask(allowed))
        for row, token in enumerate(out.token_ids.tolist()):
            assert token in allowed[row], (path, row, token)
    if params.is_greedy:
        masked = logits.clone()
        apply_token_bitmask(masked, bitmask(allowed))
        assert out.token_ids.tolist() == masked.argmax(dim=-1).tolist()


def test_logprobs_and_top_logprobs_are_those_of_the_masked_distribution() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = [{5, 6, 7}, set(range(VOCAB))]
    params = [SamplingParams(temperature=0.0, logprobs=5)] * 2
    out = sample(logits, SamplingBatch.from_params(params, "cpu"), None, bitmask(allowed))
    assert out.top_logprobs is not None
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask(allowed))
    expected = torch.log_softmax(masked, dim=-1)
    ids, values = out.top_logprobs.token_ids[0].tolist(), out.top_logprobs.logprobs[0].tolist()
    assert set(ids[:3]) == {5, 6, 7}
    assert values[:3] == pytest.approx(expected[0, ids[:3]].tolist(), abs=1e-5)
    assert values[3:] == [MIN_LOGPROB, MIN_LOGPROB]  # masked tokens: floored, never -inf
    assert out.logprobs[0].item() == pytest.approx(expected[0, out.token_ids[0]].item(), abs=1e-5)
    raw = torch.log_softmax(logits, dim=-1)  # the free row's figures are the raw model's
    assert out.logprobs[1].item() == pytest.approx(raw[1, out.token_ids[1]].item(), abs=1e-5)


def test_an_all_ones_row_samples_exactly_as_without_a_mask() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, seed=s, top_p=0.9) for s in (1, 2, 3)]

    def draw(mask: torch.Tensor | None) -> list[int]:
        gens = [make_generator(p.seed or 0, "cpu") for p in params]
        return sample(logits, SamplingBatch.from_params(params, "cpu", gens), None, mask).token_ids.tolist()

    assert draw(bitmask([set(range(VOCAB))] * 3)) == draw(None)


def test_a_constrained_row_never_takes_the_fused_greedy_head() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert argmax_suffices([greedy, greedy], [0, 0])
    assert not argmax_suffices([greedy, SamplingParams(temperature=0.0, constraint=Constraint.json_object())], [0, 0])


def test_the_cpu_mask_path_imports_no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU server never loads Triton: importing it in the first constrained request's step stalled every stream
    for 0.2 s (``kernels/token_bitmask_reference.py``). Here ``import triton`` fails, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "inference_server.kernels.token_bitmask", raising=False)
    work = torch.zeros(2, VOCAB)
    apply_token_bitmask(work, bitmask([{7}]), torch.tensor([1]))
    assert torch.isinf(work[1]).sum() == VOCAB - 1 and work[1, 7] == 0 and not torch.isinf(work[0]).any()
