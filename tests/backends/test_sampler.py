"""Batched sampler: greedy exactness, truncation, penalties, seeding, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.backends.sampler import (
    PenaltyHistory,
    SamplingBatch,
    _apply_penalties,
    greedy_sample,
    make_generator,
    sample,
)
from inference_server.records.sampling_params import SamplingParams

torch.set_num_threads(1)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    history: PenaltyHistory | None = None,
) -> torch.Tensor:
    """Token ids [B] sampled for ``logits`` [B, V] with one params per row."""
    return sample(logits, SamplingBatch.from_params(params, CPU, generators), history).token_ids


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 20_000) -> torch.Tensor:
    """[V] frequencies of n samples from one row, drawn as a batch of n identical rows."""
    tokens = run(logits_row.expand(n, -1).contiguous(), [params] * n)  # [n]
    return torch.bincount(tokens, minlength=logits_row.numel()).double() / n


# -- greedy and truncation ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_exact_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 1000).to(dtype)  # [B, V]
    tokens = run(logits, [SamplingParams(temperature=0.0)] * 6)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_invariant", [False, True])
def test_greedy_sample_is_the_samplers_all_greedy_result(dtype: torch.dtype, row_invariant: bool) -> None:
    """The runner's greedy head without a fused kernel: the sampler's token ids and logprobs, bit for bit, on a
    vocabulary its two-pass argmax splits into blocks (with a tie across blocks: the first maximum wins)."""
    logits = (torch.randn(5, 4096) * 4).to(dtype)
    logits[2, 3000] = logits[2, 100] = logits[2].max() + 1
    want = sample(logits, SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 5, CPU),
                  row_invariant=row_invariant)
    ids, logprobs = greedy_sample(logits, row_invariant=row_invariant)
    assert torch.equal(ids, want.token_ids) and torch.equal(logprobs, want.logprobs) and int(ids[2]) == 100


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = torch.randn(8, 500)  # [B, V]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.9) for i in range(8)]
    tokens = run(logits, params)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(16, 300)
    assert torch.equal(run(logits, [SamplingParams(top_k=1, temperature=1.7)] * 16), logits.argmax(-1))


def test_tiny_top_p_equals_greedy() -> None:
    logits = torch.randn(16, 300)
    assert torch.equal(run(logits, [SamplingParams(top_p=1e-6)] * 16), logits.argmax(-1))


def test_min_p_keeps_tokens_above_threshold_in_proportion() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # probs [V]
    freq = draw_many(logits, SamplingParams(min_p=0.35))  # threshold 0.175: keeps tokens 0 and 1
    assert freq[2:].sum() == 0
    assert freq[0].item() == pytest.approx(0.5 / 0.8, abs=0.02)


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    freq = draw_many(logits, SamplingParams(top_p=0.7))  # 0.5 < 0.7, then 0.8 >= 0.7: keeps {0, 1}
    assert freq[2:].sum() == 0
    assert freq[0].item() == pytest.approx(0.5 / 0.8, abs=0.02)


def test_top_k_renormalises_over_the_k_best() -> None:
    logits = torch.tensor([0.1, 0.4, 0.2, 0.3]).log()
    freq = draw_many(logits, SamplingParams(top_k=2))
    assert freq[0] == 0 and freq[2] == 0
    assert freq[1].item() == pytest.approx(0.4 / 0.7, abs=0.02)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_analytic_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = (logits / temperature).softmax(-1).double()
    freq = draw_many(logits, SamplingParams(temperature=temperature), n=40_000)
    # std of each frequency <= 0.0025 at n=40k; 0.015 is 6 sigma.
    assert (freq - expected).abs().max().item() < 0.015


def test_tokens_of_probability_zero_are_never_drawn() -> None:
    """Masked tokens before, between and after the allowed ones (the CPU's inverse-CDF draw must never land on a
    flat stretch of the cumulative sum, nor past its end)."""
    inf = math.inf
    logits = torch.tensor([-inf, 1.0, -inf, -inf, 0.0, 3.0, -inf, -inf])
    freq = draw_many(logits, SamplingParams(temperature=1.0), n=40_000)
    assert freq[[0, 2, 3, 6, 7]].sum().item() == 0.0
    expected = logits.softmax(-1).double()
    assert (freq - expected).abs().max().item() < 0.015


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    cold = draw_many(logits, SamplingParams(temperature=0.3))
    hot = draw_many(logits, SamplingParams(temperature=3.0))
    assert cold[0] > 0.95 and hot[0] < 0.5


# -- penalties ------------------------------------------------------------------------------------------


def reference_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    p: SamplingParams,
) -> list[float]:
    """Straight per-token reference of HF repetition penalty + OpenAI presence/frequency penalties."""
    counts = Counter(output)
    result = []
    for token, x in enumerate(logits):
        if token in counts or token in prompt:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[token] + p.presence_penalty * (counts[token] > 0)
        result.append(x)
    return result


def test_penalties_match_reference() -> None:
    vocab = 40
    logits = torch.randn(4, vocab) * 3  # [B, V]
    prompts = [[1, 2, 3, 3], [], [5, 6], [7]]
    outputs = [[3, 4, 4, 4], [9, 9, 1], [], [7, 8]]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=-1.5),
        SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=2.0),
        SamplingParams(temperature=0),
    ]
    history = PenaltyHistory.from_lists(prompts, outputs, CPU)
    assert history.prompt_ids.shape == (4, 4) and history.output_ids.shape == (4, 4)
    batch = SamplingBatch.from_params(params, CPU)
    work = logits.clone()
    _apply_penalties(work, history, batch)
    for row in range(4):
        expected = reference_penalties(logits[row].tolist(), prompts[row], outputs[row], params[row])
        torch.testing.assert_close(work[row], torch.tensor(expected))
    tokens = sample(logits, batch, history).token_ids  # greedy rows: argmax of the penalised logits
    assert torch.equal(tokens, work.argmax(-1))


def test_penalty_pushes_greedy_off_a_repeated_token() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=0.2)]
    history = PenaltyHistory.from_lists([[]], [[0]], CPU)
    assert sample(logits, SamplingBatch.from_params(params, CPU), history).token_ids.item() == 1


def test_penalties_without_history_crash_loudly() -> None:
    batch = SamplingBatch.from_params([SamplingParams(presence_penalty=1.0)], CPU)
    with pytest.raises(ValueError, match="PenaltyHistory"):
        sample(torch.randn(1, 5), batch)


# -- seeding --------------------------------------------------------------------------------------------


def seeded_sequence(seed: int, row: int, batch_size: int, steps: list[torch.Tensor]) -> list[int]:
    """Tokens a seeded request gets at position ``row`` of a batch of unseeded random-logit neighbours."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    generator = make_generator(seed, CPU)
    tokens = []
    for step_logits in steps:  # [V] per step
        logits = torch.randn(batch_size, step_logits.numel())  # neighbours differ per call
        logits[row] = step_logits
        rows = [SamplingParams(temperature=0.8, top_k=5)] * batch_size
        rows[row] = params
        gens: list[torch.Generator | None] = [None] * batch_size
        gens[row] = generator
        tokens.append(run(logits, rows, generators=gens)[row].item())
    return tokens


def test_seeded_row_is_reproducible_and_independent_of_batch() -> None:
    steps = [torch.randn(200) for _ in range(12)]
    alone = seeded_sequence(1234, 0, 1, steps)
    assert seeded_sequence(1234, 3, 7, steps) == alone
    torch.manual_seed(99)  # a different global RNG state must not matter either
    assert seeded_sequence(1234, 5, 6, steps) == alone
    assert seeded_sequence(4321, 0, 1, steps) != alone


def test_two_seeded_rows_in_one_batch_do_not_interfere() -> None:
    logits = torch.randn(1, 1000).expand(2, -1).contiguous()  # [2, V] identical rows
    params = [SamplingParams(seed=7), SamplingParams(seed=7)]
    gens = [make_generator(7, CPU), make_generator(7, CPU)]
    tokens = [run(logits, params, generators=gens).tolist() for _ in range(5)]
    assert all(a == b for a, b in tokens)


def test_seed_without_generator_is_a_bug() -> None:
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.from_params([SamplingParams(seed=1)], CPU)


# -- logprobs -------------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.randn(5, 100).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.3, top_k=3, presence_penalty=1.0)] * 5
    history = PenaltyHistory.from_lists([[1, 2]] * 5, [[3]] * 5, CPU)
    out = sample(logits, SamplingBatch.from_params(params, CPU), history)
    raw = logits.float().log_softmax(-1)  # [B, V]
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs is None


def test_top_logprobs_sorted_and_correct() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(logprobs=4), SamplingParams(logprobs=None), SamplingParams(logprobs=0)]
    out = sample(logits, SamplingBatch.from_params(params, CPU))
    top = out.top_logprobs
    assert top is not None and top.token_ids.shape == (3, 4) and top.logprobs.shape == (3, 4)
    raw = logits.log_softmax(-1)
    assert (top.logprobs[:, :-1] >= top.logprobs[:, 1:]).all()
    torch.testing.assert_close(top.logprobs, raw.gather(1, top.token_ids))
    torch.testing.assert_close(top.logprobs, raw.topk(4, dim=-1).values)


def test_logits_are_not_modified() -> None:
    logits = torch.randn(4, 64)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=3, min_p=0.1, repetition_penalty=1.2)] * 4
    run(logits, params, history=PenaltyHistory.from_lists([[1]] * 4, [[2]] * 4, CPU))
    assert torch.equal(logits, before)


# -- properties -----------------------------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Random logits [B, V] (distinct values) and random truncation params per row, all seeded."""
    size, vocab = draw(st.integers(1, 4)), draw(st.integers(2, 64))
    noise = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(size, vocab, generator=noise) * draw(st.floats(0.1, 8.0))
    params = [
        SamplingParams(
            temperature=draw(st.floats(0.05, 2.0)),
            top_k=draw(st.integers(-1, vocab + 3)),
            top_p=draw(st.floats(0.01, 1.0)),
            min_p=draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
            seed=draw(st.integers(0, 2**31)),
        )
        for _ in range(size)
    ]
    return logits, params


def truncation_reference(logits: torch.Tensor, p: SamplingParams, token: int) -> None:
    """Assert ``token`` survives temperature -> min-p -> top-k -> top-p, computed the slow way."""
    scaled = logits / p.temperature  # [V]
    probs = scaled.softmax(-1)
    better = scaled > scaled[token]  # [V] tokens ranked above the sampled one
    assert probs[token] >= p.min_p * probs.max() - 1e-6
    if p.top_k > 0:
        assert int(better.sum()) < p.top_k
    ranks = (-scaled).argsort().argsort()  # [V] 0 = best
    alive = (probs >= p.min_p * probs.max()) & ((ranks < p.top_k) if p.top_k > 0 else True)
    renormalised = probs * alive / (probs * alive).sum()
    if p.top_p < 1.0:
        assert renormalised[better].sum().item() < p.top_p + 1e-5


@settings(max_examples=80, deadline=None)
@given(batches())
def test_sampled_token_is_inside_every_truncation(batch: tuple[torch.Tensor, list[SamplingParams]]) -> None:
    logits, params = batch
    gens: list[torch.Generator | None] = [make_generator(p.seed or 0, CPU) for p in params]
    tokens = run(logits, params, generators=gens)
    for row, p in enumerate(params):
        truncation_reference(logits[row], p, int(tokens[row]))


# -- logit edits: logit_bias, allowed_token_ids, min_tokens -----------------------------------------------


def reference_edit(logits: torch.Tensor, params: SamplingParams, output_len: int) -> torch.Tensor:
    """The edits one row gets, written plainly (PyTorch reference semantics)."""
    edited = logits.clone().float()
    for token_id, bias in params.logit_bias:
        edited[token_id] += bias
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(edited, dtype=torch.bool)
        keep[list(params.allowed_token_ids)] = True
        edited[~keep] = -torch.inf
    if output_len < params.min_tokens:
        edited[list(params.min_tokens_stop_ids())] = -torch.inf
    return edited


edit_params = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    logit_bias=st.lists(st.tuples(st.integers(0, 15), st.floats(-100, 100)), max_size=4,
                        unique_by=lambda pair: pair[0]).map(tuple),
    allowed_token_ids=st.none() | st.lists(st.integers(0, 15), min_size=1, max_size=5, unique=True).map(tuple),
    min_tokens=st.integers(0, 3),
    stop_token_ids=st.lists(st.integers(0, 15), max_size=2).map(tuple),
    eos_token_ids=st.just((1,)),
    ignore_eos=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(edit_params, st.integers(0, 4)), min_size=1, max_size=4), data=st.data())
def test_logit_edits_match_the_reference_per_row(rows: list[tuple[SamplingParams, int]], data: st.DataObject) -> None:
    """Greedy rows pick the argmax of exactly the reference's edited logits, whatever else shares the batch
    (rows without edits included), and the returned logprobs stay those of the raw logits."""
    plain = [(SamplingParams(temperature=0.0), 0)] * data.draw(st.integers(0, 2))
    rows = rows + plain
    logits = torch.randn(len(rows), 16)
    expected = torch.stack([reference_edit(logits[i], p, n) for i, (p, n) in enumerate(rows)])
    if torch.isinf(expected).all(dim=-1).any():
        return  # every token masked: nothing defined to compare
    batch = SamplingBatch.from_params([p for p, _ in rows], CPU, output_lens=[n for _, n in rows])
    out = sample(logits, batch)
    assert out.token_ids.tolist() == expected.argmax(dim=-1).tolist()
    raw = logits.log_softmax(dim=-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, raw)


def test_no_edits_no_edit_stage() -> None:
    """Rows that edit nothing pay nothing: no edit tensors are built."""
    assert SamplingBatch.from_params([SamplingParams(), SamplingParams(top_k=3)], CPU).logit_edits is None


def test_allowed_token_ids_hold_when_sampling() -> None:
    allowed = (3, 7, 11)
    params = SamplingParams(temperature=1.5, allowed_token_ids=allowed)
    frequencies = draw_many(torch.randn(16), params, n=4000)
    assert set(torch.nonzero(frequencies).flatten().tolist()) <= set(allowed)


def test_min_tokens_masks_stop_ids_only_while_short() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 1] = 9.0  # EOS
    logits[0, 5] = 5.0  # a stop token id
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(5,), eos_token_ids=(1,))
    short = sample(logits, SamplingBatch.from_params([params], CPU, output_lens=[1]))
    assert short.token_ids.tolist() == [0]
    done = sample(logits, SamplingBatch.from_params([params], CPU, output_lens=[2]))
    assert done.token_ids.tolist() == [1]
    with pytest.raises(ValueError, match="output_lens"):
        SamplingBatch.from_params([params], CPU)


def test_logit_bias_shifts_the_sampled_distribution() -> None:
    """+ln(3) on one of two equal tokens makes it 3 times as likely (bias is added before softmax)."""
    params = SamplingParams(temperature=1.0, logit_bias=((1, math.log(3.0)),))
    frequencies = draw_many(torch.zeros(2), params, n=20_000)
    assert abs(frequencies[1].item() - 0.75) < 0.02


def test_argmax_rows_is_the_first_maximum_of_each_row() -> None:
    """The two-pass CPU argmax gives ``torch.argmax``'s index: ties (the first wins, across and inside blocks), NaN
    (it counts as the maximum), all ``-inf`` rows, and widths its blocks do not divide."""
    from inference_server.backends.sampler import ARGMAX_BLOCK, argmax_rows

    vocab = 64 * ARGMAX_BLOCK
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    x[1, [7 * ARGMAX_BLOCK + 3, 2 * ARGMAX_BLOCK + 9, 2 * ARGMAX_BLOCK + 5]] = 50.0  # tie across and inside blocks
    x[2, [9 * ARGMAX_BLOCK, 40 * ARGMAX_BLOCK + 1]] = float("nan")
    x[3] = float("-inf")
    x[4, -1] = 60.0
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist() == [x[0].argmax().item(), 2 * ARGMAX_BLOCK + 5,
                                                                  9 * ARGMAX_BLOCK, 0, vocab - 1]
    odd = torch.randn(2, 3 * ARGMAX_BLOCK + 5)
    assert torch.equal(argmax_rows(odd), odd.argmax(-1))


def test_bad_words_ban_a_token_only_after_the_rest_of_their_word() -> None:
    """``bad_words_token_ids`` (vLLM's bad words): a one-token word is masked always, a longer one's last token
    only where the row's output ends with the others; such a row needs its outputs, and is never fused-greedy."""
    from inference_server.backends.sampler import argmax_suffices

    logits = torch.zeros(2, 8)
    logits[:, 3] = 9.0
    logits[:, 4] = 5.0
    params = SamplingParams(temperature=0.0, bad_words_token_ids=((2, 3), (6,)))
    batch = SamplingBatch.from_params([params, params], CPU, output_ids=[[1, 2], [2, 1]])
    assert sample(logits, batch).token_ids.tolist() == [4, 3]
    assert not argmax_suffices([params], [0])
    assert not argmax_suffices([SamplingParams(temperature=0.0, bad_words_token_ids=((6,),))], [0])
    with pytest.raises(ValueError, match="output_ids"):
        SamplingBatch.from_params([params], CPU)
    single = SamplingParams(temperature=0.0, bad_words_token_ids=((3,),))
    assert sample(logits[:1], SamplingBatch.from_params([single], CPU)).token_ids.tolist() == [4]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_row_its_bans_leave_no_token_is_sampled_without_them(temperature: float) -> None:
    """``bad_words`` can ban every id ``allowed_token_ids`` allow (or a grammar's mask: one that allows only EOS,
    EOS banned), and ``min_tokens`` hold back the only allowed id: sampling from nothing drew an id past the
    vocabulary on the CPU, failing the step of every request in the batch. Such a row samples as if it had no
    edits (the grammar's mask still applies); the other rows keep theirs."""
    from inference_server.records.constraints import Constraint

    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    logits[:, 9] = 30.0  # what every row would take without its edits, save the grammar's
    banned = SamplingParams(temperature=temperature, allowed_token_ids=(5,), bad_words_token_ids=((5,),))
    held = SamplingParams(temperature=temperature, allowed_token_ids=(7,), min_tokens=3, eos_token_ids=(7,))
    grammar = SamplingParams(temperature=temperature, bad_words_token_ids=((3,),),
                             constraint=Constraint.regex("a", field="regex"))
    other = SamplingParams(temperature=temperature, bad_words_token_ids=((9,),))
    batch = SamplingBatch.from_params([banned, held, grammar, other], CPU, output_lens=[0, 0, 0, 0],
                                      output_ids=[[], [], [], []])
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 0] = 1 << 3  # the grammar allows token 3 alone
    out = sample(logits, batch, token_bitmask=bits, bitmask_rows=torch.tensor([2]))
    tokens = out.token_ids.tolist()
    assert tokens[:3] == [9, 9, 3] and tokens[3] != 9
