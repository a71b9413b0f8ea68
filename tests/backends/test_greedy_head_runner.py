"""The CUDA runner's fused greedy head (``CudaModelRunner._greedy_head``) on CPU, Triton interpreter, fp32.

* Selection: ``_sample`` takes the fused head exactly when every sampled row is greedy and needs nothing else
  (``sampler.argmax_suffices``), and the tokens and logprobs it hands to the host copy equal the unfused
  path's (``compute_logits`` + ``sample``), for single rows and mixed batches, decode rows and prefill rows
  (a gather of the last hidden row of each chunk), a tied soft-capped head and an untied plain one, float and
  int8 (the embeddings and lm_head quantized: ``INT8_EMBEDDINGS``; the unfused path is then the Triton
  ``int8_linear``).
* Whole steps: teacher-forced greedy decoding through the static decode path gives the unfused runner's tokens
  and logprobs, the fused head serving every step and ``compute_logits`` none.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from tests.backends.test_cuda_backend import BLOCK, Script, build, num_groups, storage_for

from inference_server.backends.cuda.options import CudaRunnerOptions
from inference_server.backends.cuda.runner import CudaModelRunner
from inference_server.backends.sampler import argmax_suffices
from inference_server.kernels.streamed_linear import GEMV_MAX_TOKENS
from inference_server.models.architectures.quantized import quantize_model_int8_
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import SampledToken, ScheduledSequence, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
PROMPT_LEN = 4


@attrs.define
class Spy:
    """Counts, on one runner, the steps its fused head served and the ``compute_logits`` calls."""

    fused: int = 0
    logits: int = 0

    @classmethod
    def on(cls, runner: CudaModelRunner) -> Spy:
        spy = cls()
        head, compute_logits = runner._greedy_head, runner._compute_logits

        def counted_head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
            result = head(hidden)
            spy.fused += result is not None
            return result

        def counted_logits(hidden: torch.Tensor) -> torch.Tensor:
            spy.logits += 1
            return compute_logits(hidden)

        runner._greedy_head = counted_head  # type: ignore[method-assign]
        runner._compute_logits = counted_logits  # type: ignore[method-assign]
        return spy


def make_runner(name: str, fused: bool, quantize: bool = False, graphs: bool = False,
                seqs: int = 4, blocks: int = 4) -> CudaModelRunner:
    spec, model = build(name, torch.float32, "cpu")
    if quantize:
        quantize_model_int8_(model, embeddings=True)  # the head too (the CPU backend's choice)
    options = CudaRunnerOptions(max_model_len=blocks * BLOCK, max_batch_size=seqs, cuda_graphs=graphs)
    runner = CudaModelRunner(model, spec, storage_for(spec, seqs, blocks, torch.float32, "cpu"), torch.device("cpu"),
                             options)
    return runner if fused else without_fused_head(runner)


def without_fused_head(runner: CudaModelRunner) -> CudaModelRunner:
    """``runner`` with the unfused head (the full logits and the sampler) for every step: the fused head's before."""
    runner._greedy_head = lambda hidden: None  # type: ignore[method-assign]
    return runner


def sequence(request_id: int, params: SamplingParams, output_len: int, chunk: int) -> ScheduledSequence:
    """A request that has output ``output_len`` tokens; this step computes its last ``chunk`` tokens."""
    total = PROMPT_LEN + output_len
    tokens = tuple(3 + (request_id * 7 + i) % 50 for i in range(total))
    return ScheduledSequence(request_id=request_id, token_ids=tokens[total - chunk:], cached_len=total - chunk,
                             block_tables=((0,),), sample=True, sampling=params, reset=True, prompt_len=PROMPT_LEN,
                             history=tokens[:total - chunk])


def sample_once(runner: CudaModelRunner, seqs: list[ScheduledSequence], hidden: torch.Tensor) -> list[SampledToken]:
    plan = StepPlan(step_id=0, sequences=tuple(seqs))
    states = [runner._state_for(seq) for seq in seqs]
    launched = runner._sample(plan, states, hidden)
    runner.forget(tuple(seq.request_id for seq in seqs))
    assert launched is not None
    return list(launched.tokens())


CASES = [  # (label, [(params, tokens output so far)], the fused head may serve the step)
    ("greedy", [(GREEDY, 0)], True),
    ("greedy, sampled token's logprob", [(attrs.evolve(GREEDY, logprobs=0), 2)], True),
    ("greedy, top_k/top_p/seed unused", [(attrs.evolve(GREEDY, top_k=5, top_p=0.5, seed=3), 1)], True),
    ("greedy, min_tokens already met", [(attrs.evolve(GREEDY, min_tokens=2, eos_token_ids=(1,)), 3)], True),
    ("greedy batch", [(GREEDY, 0), (GREEDY, 4), (attrs.evolve(GREEDY, logprobs=0), 1)], True),
    ("top logprobs", [(attrs.evolve(GREEDY, logprobs=3), 0)], False),
    ("sampled", [(SamplingParams(temperature=0.7, seed=1, max_tokens=8), 0)], False),
    ("repetition penalty", [(attrs.evolve(GREEDY, repetition_penalty=1.3), 2)], False),
    ("presence penalty", [(attrs.evolve(GREEDY, presence_penalty=0.5), 2)], False),
    ("frequency penalty", [(attrs.evolve(GREEDY, frequency_penalty=0.5), 2)], False),
    ("logit bias", [(attrs.evolve(GREEDY, logit_bias=((5, 3.0),)), 0)], False),
    ("allowed ids", [(attrs.evolve(GREEDY, allowed_token_ids=(4, 9, 11)), 0)], False),
    ("min_tokens holding stop ids", [(attrs.evolve(GREEDY, min_tokens=5, eos_token_ids=(1,)), 2)], False),
    ("greedy beside a sampled row", [(GREEDY, 0), (SamplingParams(temperature=0.9, seed=2, max_tokens=8), 0)],
     False),
]


def _head_cases() -> list[object]:
    """(chunk, name, quantize): decode rows (no gather) / prefill chunks (last row gathered), an untied head / a tied
    soft-capped one, float / int8. The float cases take about a second each in the interpreter, an int8 one 50 times
    that: CI runs every float case and the int8 case with the most in it (a tied soft-capped head, gathered rows);
    the other int8 cases are the same check on more shapes and run with the slow tests."""
    cases: list[object] = []
    for chunk in (1, 3):
        for name in ("qwen3-30b-a3b-tiny", "gemma-4-31b-tiny"):
            for quantize in (False, True):
                representative = not quantize or (chunk, name) == (3, "gemma-4-31b-tiny")
                cases.append(pytest.param(chunk, name, quantize, id=f"{chunk}-{name}-{'int8' if quantize else 'float'}",
                                          marks=() if representative else pytest.mark.slow))
    return cases


@pytest.mark.parametrize(("chunk", "name", "quantize"), _head_cases())
def test_fused_exactly_when_allowed_and_equal_to_unfused(name: str, chunk: int, quantize: bool) -> None:
    torch.set_num_threads(1)
    fused_runner = make_runner(name, fused=True, quantize=quantize)
    plain_runner = make_runner(name, fused=False, quantize=quantize)
    assert (fused_runner.model.int8_head() is not None) == quantize
    spy, plain_spy = Spy.on(fused_runner), Spy.on(plain_runner)
    gen = torch.Generator().manual_seed(chunk)
    for label, rows, allowed in CASES:
        seqs = [sequence(i, params, out, chunk) for i, (params, out) in enumerate(rows)]
        assert argmax_suffices([s.sampling for s in seqs], [out for _, out in rows]) == allowed, label
        hidden = torch.randn(len(seqs) * chunk, fused_runner.spec.hidden_size, generator=gen) * 3
        before = (spy.fused, spy.logits)
        ours = sample_once(fused_runner, seqs, hidden)
        theirs = sample_once(plain_runner, seqs, hidden)
        # an int8 head's 1-2 rows take its CUDA-core GEMV and greedy_head_of_logits: still the runner's greedy head
        assert (spy.fused - before[0], spy.logits - before[1]) == ((1, 0) if allowed else (0, 1)), label
        assert [t.token_id for t in ours] == [t.token_id for t in theirs], label
        assert [t.top_logprobs for t in ours] == [t.top_logprobs for t in theirs] or not allowed, label
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-5), label
    assert plain_spy.fused == 0 and plain_spy.logits == len(CASES)


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int8"])
def test_one_or_two_rows_take_the_head_gemv(quantize: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """1-2 greedy rows: the head's CUDA-core GEMV writes the logits (an int8 head always; a float head where the
    sweep tuned its GEMV, here forced, as no tuned file matches the CPU) and ``greedy_head_of_logits`` reduces them.
    Three rows take the fused slices. Tokens equal the unfused runner's throughout."""
    torch.set_num_threads(1)
    from inference_server.backends.cuda import runner as runner_module

    reduced = []
    of_logits = runner_module.greedy_head_of_logits
    monkeypatch.setattr(runner_module, "greedy_head_of_logits", lambda logits, cap: reduced.append(logits.shape) or
                        of_logits(logits, cap))
    monkeypatch.setattr(runner_module, "dense_linear_takes", lambda *args, **kwargs: True)
    runner = make_runner("gemma-4-31b-tiny", fused=True, quantize=quantize)
    plain = make_runner("gemma-4-31b-tiny", fused=False, quantize=quantize)
    spy = Spy.on(runner)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1):
        seqs = [sequence(i, GREEDY, 0, 1) for i in range(rows)]
        hidden = torch.randn(rows, runner.spec.hidden_size, generator=gen) * 3
        before, logits_before = len(reduced), spy.logits
        ours, theirs = sample_once(runner, seqs, hidden), sample_once(plain, seqs, hidden)
        assert [t.token_id for t in ours] == [t.token_id for t in theirs], rows
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-5), rows
        assert len(reduced) - before == int(rows <= GEMV_MAX_TOKENS), rows
        assert spy.logits == logits_before, rows
    assert all(shape[1] == runner.spec.vocab_size for shape in reduced)


def test_int8_head_without_the_fused_head_takes_the_unfused_path() -> None:
    torch.set_num_threads(1)
    runner = make_runner("gemma-4-31b-tiny", fused=False, quantize=True)
    spy = Spy.on(runner)
    hidden = torch.randn(1, runner.spec.hidden_size)
    assert runner.model.head_weight() is None and runner.model.int8_head() is not None
    sample_once(runner, [sequence(0, GREEDY, 0, 1)], hidden)
    assert (spy.fused, spy.logits) == (0, 1)


# int8 in CI (an int8 embedding, tied head and every layer, and the fused head serving every step); the float head's
# fused path through the static decode buffers is also test_cuda_backend's test_static_decode_path_matches_reference_cpu
@pytest.mark.parametrize("quantize", [pytest.param(False, id="float", marks=pytest.mark.slow),
                                      pytest.param(True, id="int8")])
def test_greedy_decoding_through_the_static_path(quantize: bool) -> None:
    """Teacher-forced greedy decoding (three prompts, a fourth joining, then decode steps through the static
    buffers, capture off): the fused runner's tokens and logprobs are the unfused runner's, with a float head and
    with an int8 one (every layer, the embedding and the tied lm_head int8)."""
    torch.set_num_threads(1)
    name, steps = "gemma-4-31b-tiny", 4
    spec, model = build(name, torch.float32, "cpu")
    if quantize:
        quantize_model_int8_(model, embeddings=True)
    script = Script(spec, num_groups(spec), steps, seed=1, join=2, prompt_lens=(5, 12))
    n, m = len(script.seqs), script.blocks_per_seq
    runners = [CudaModelRunner(model, spec, storage_for(spec, n, m, torch.float32, "cpu"), torch.device("cpu"),
                               CudaRunnerOptions(max_model_len=m * BLOCK, max_batch_size=4))
               for _ in range(2)]
    without_fused_head(runners[1])
    spies = [Spy.on(r) for r in runners]
    for _ in range(steps + 1):
        plan = script.plan()
        fused, plain = (runner.execute(plan).tokens for runner in runners)
        assert [t.token_id for t in fused] == [t.token_id for t in plain]
        assert [t.logprob for t in fused] == pytest.approx([t.logprob for t in plain], abs=1e-5)
        script.advance(plan, {t.request_id: t.token_id for t in plain})
    assert runners[0].graph_steps >= 2
    assert (spies[0].fused, spies[0].logits) == (steps + 1, 0)
    assert (spies[1].fused, spies[1].logits) == (0, steps + 1)


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int8"])
def test_warm_up_compiles_every_head_path_a_decode_batch_meets(quantize: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm_up_greedy_head`` runs the serving path at 1 and 2 rows (an int8 head's GEMV path; a float head without
    a tuned GEMV takes the fused head there) and at the fewest rows of each fused block: 3, 17 and 33."""
    from inference_server.backends.cuda import runner as runner_module

    fused: list[int] = []
    reduced: list[int] = []
    monkeypatch.setattr(runner_module, "greedy_head",
                        lambda hidden, *a, **k: fused.append(hidden.shape[0]) or (None, None))
    monkeypatch.setattr(runner_module, "greedy_head_of_logits", lambda logits, cap: reduced.append(logits.shape[0]) or
                        (None, None))
    runner = make_runner("gemma-4-31b-tiny", fused=True, quantize=quantize, seqs=40)
    runner.warm_up_greedy_head()
    if quantize:
        assert (reduced, fused) == ([1, 2], [3, 17, 33])
    else:
        assert (reduced, fused) == ([], [1, 2, 3, 17, 33])
