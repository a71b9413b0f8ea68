"""Constrained rows in the step runner: rows with different constraints (and none) share every batch, with
overlap (step N+1 launched before step N is collected, its tokens pending) and without; each row's output
matches its own constraint, and the tokens are the same both ways (seeded and greedy rows).

The model is a tiny random Gemma (vocabulary 512); the grammar compiler reads a byte-level vocabulary of the
same size, so each id below 259 is one byte and every output is text to check.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from inference_server.backends.deterministic import cpu_attention_kwargs, cpu_ops
from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.paged_kv import PagedKVStorage, group_of
from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.models.architectures.ops import REFERENCE_OPS
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import parse_model_spec
from inference_server.records.constraints import Constraint
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import PENDING_TOKEN, ScheduledSequence, StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
from http_testkit import byte_level_tokenizer_json

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 1
VOCAB = 512
STEPS = 24
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
ROWS: list[tuple[Constraint | None, dict]] = [
    (Constraint.regex("[0-9]{3}-[a-z]{2}"), {"temperature": 1.0, "seed": 1}),
    (Constraint.choice(["alpha", "beta", "gamma"]), {"temperature": 0.0}),
    (None, {"temperature": 1.0, "seed": 2}),
    (Constraint.json_schema(SCHEMA), {"temperature": 0.9, "seed": 3, "top_k": 20, "top_p": 0.9}),
    (Constraint.from_grammar('start: "x=" /[a-c]{2,4}/ ";"'), {"temperature": 0.0, "logprobs": 3}),
    (None, {"temperature": 0.0}),
    (Constraint.choice(["alpha", "beta", "gamma"]), {"temperature": 1.0, "seed": 4, "repetition_penalty": 1.3}),
]


def valid(constraint: Constraint | None, text: str) -> bool:
    if constraint is None:
        return True
    if constraint.kind == "regex":
        return re.fullmatch("[0-9]{3}-[a-z]{2}", text) is not None
    if constraint.kind == "choice":
        return text in constraint.choices
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return re.fullmatch("x=[a-c]{2,4};", text) is not None


def make_runner(deterministic: bool = False) -> ModelRunner:
    spec = parse_model_spec(preset_config("gemma-4-31b-tiny"))
    assert spec.vocab_size == VOCAB
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=5)
    groups = {group_of(layer) for layer in spec.cache_layers}
    storage = PagedKVStorage(spec.cache_layers, {g: 128 for g in groups}, 4, torch.float32, "cpu")
    if deterministic:  # what the factory builds with DETERMINISTIC=true
        runner = ModelRunner(model, spec, storage, torch.device("cpu"), ops=cpu_ops(REFERENCE_OPS),
                             attention_kwargs=cpu_attention_kwargs(), deterministic=True)
    else:
        runner = ModelRunner(model, spec, storage, torch.device("cpu"))
    runner.grammar = GrammarCompiler(byte_level_tokenizer_json(VOCAB), VOCAB, {EOS})
    return runner


def run(overlap: bool) -> list[list[int]]:
    """Every row's sampled tokens over ``STEPS`` steps (one prefill, then decodes), all rows in each batch."""
    runner = make_runner()
    tables = [tuple(tuple(range(i * 16, i * 16 + 16)) for _ in range(runner.num_groups)) for i in range(len(ROWS))]
    params = [SamplingParams(max_tokens=STEPS, constraint=c, **fields) for c, fields in ROWS]
    prompts = [[2, 40 + i, 41, 42 + i] for i in range(len(ROWS))]
    outputs: list[list[int]] = [[] for _ in ROWS]

    def plan(step: int) -> StepPlan:
        sequences = []
        for i, prompt in enumerate(prompts):
            if step == 0:
                ids, cached = tuple(prompt), 0
            else:
                ids = (PENDING_TOKEN,) if overlap else (outputs[i][-1],)
                cached = len(prompt) + step - 1
            sequences.append(ScheduledSequence(request_id=i, token_ids=ids, cached_len=cached,
                                               block_tables=tables[i], sample=True, sampling=params[i],
                                               reset=step == 0, prompt_len=len(prompt)))
        return StepPlan(step_id=step, sequences=tuple(sequences))

    def record(result) -> None:
        for token in result.tokens:
            outputs[token.request_id].append(token.token_id)

    if overlap:
        launched = runner.launch(plan(0))
        for step in range(1, STEPS):
            following = runner.launch(plan(step))  # launched before the previous step is collected
            record(runner.collect(launched))
            launched = following
        record(runner.collect(launched))
    else:
        for step in range(STEPS):
            record(runner.execute(plan(step)))
    return outputs


def text_of(tokens: list[int]) -> str:
    """The bytes before the first EOS (ids 3..258 are the byte symbols, in sorted symbol order)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(byte_level_tokenizer_json(VOCAB))
    end = tokens.index(EOS) if EOS in tokens else len(tokens)
    return tokenizer.decode(tokens[:end])


def test_rows_keep_their_own_constraint_with_and_without_overlap() -> None:
    serial = run(overlap=False)
    overlapped = run(overlap=True)
    assert overlapped == serial  # the pending-token path advances each grammar by the same tokens
    for (constraint, _), tokens in zip(ROWS, serial, strict=True):
        text = text_of(tokens)
        assert valid(constraint, text), (constraint, text)
        if constraint is not None:
            assert EOS in tokens  # every grammar above completes within STEPS tokens, then only EOS is allowed
            assert set(tokens[tokens.index(EOS):]) == {EOS}
    # an unconstrained row of a random model does not write valid constrained text by chance: the masks
    # above are what made those rows valid
    assert any(t >= 259 for t in serial[2] + serial[5])


def test_a_constrained_step_does_not_take_the_fused_greedy_head() -> None:
    """A greedy constrained row next to greedy unconstrained rows: the runner must take the logits (the
    hook is not consulted), so the mask applies before the argmax."""
    runner = make_runner()
    calls: list[int] = []
    runner._greedy_head = lambda hidden: calls.append(hidden.shape[0]) or None  # type: ignore[method-assign]
    tables = tuple(tuple(range(16)) for _ in range(runner.num_groups))
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    constrained = SamplingParams(temperature=0.0, max_tokens=4, constraint=Constraint.choice(["zz"]))
    seqs = tuple(ScheduledSequence(request_id=i, token_ids=(2, 50, 51), cached_len=0, block_tables=tables,
                                   sample=True, sampling=p, reset=True, prompt_len=3)
                 for i, p in enumerate((greedy, constrained)))
    runner.execute(StepPlan(step_id=0, sequences=seqs[:1]))
    assert calls == [1]  # an unconstrained greedy step consults the fused head
    result = runner.execute(StepPlan(step_id=1, sequences=seqs[1:]))
    assert calls == [1]
    assert text_of([result.tokens[0].token_id]) == "z"


def constrained_plan(runner: ModelRunner, step: int) -> StepPlan:
    tables = tuple(tuple(range(16)) for _ in range(runner.num_groups))
    params = SamplingParams(temperature=0.0, max_tokens=8, constraint=Constraint.regex("[a-c]{6}"))
    seq = ScheduledSequence(request_id=0, token_ids=(2, 50, 51), cached_len=0, block_tables=tables, sample=True,
                            sampling=params, reset=True, prompt_len=3)
    return StepPlan(step_id=step, sequences=(seq,))


def test_launch_returns_before_the_masks_are_filled_and_a_fill_error_reaches_collect() -> None:
    """The grammar's advance, fill and the masked sampling run on the runner's sampling thread: ``launch`` returns
    with the fill still blocked, ``collect`` waits for it; an error there is raised by ``collect``, not lost."""
    runner = make_runner()
    runner.execute(constrained_plan(runner, 0))  # builds the filler
    assert runner._bitmasks is not None
    real_fill = runner._bitmasks.fill
    release, finished = threading.Event(), threading.Event()
    fill_threads: list[threading.Thread] = []

    def blocked_fill(constrained: list) -> tuple[torch.Tensor, torch.Tensor]:
        fill_threads.append(threading.current_thread())
        release.wait(timeout=120)
        try:
            return real_fill(constrained)
        finally:
            finished.set()

    runner._bitmasks.fill = blocked_fill  # type: ignore[method-assign]
    launched = runner.launch(constrained_plan(runner, 1))
    assert not finished.is_set()  # launch did not wait for the fill
    release.set()
    result = runner.collect(launched)
    assert fill_threads and fill_threads[0] is not threading.current_thread()
    assert text_of([result.tokens[0].token_id]) in {"a", "b", "c"}

    def failing_fill(constrained: list) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("fill failed")

    runner._bitmasks.fill = failing_fill  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="fill failed"):
        runner.collect(runner.launch(constrained_plan(runner, 2)))


def run_rows(runner: ModelRunner, rows: list[int]) -> dict[int, list[tuple[int, float]]]:
    """``ROWS[i]`` for ``i`` in ``rows``, batched together over ``STEPS`` overlapped steps: each row's (token, logprob)
    pairs."""
    tables = {i: tuple(tuple(range(i * 16, i * 16 + 16)) for _ in range(runner.num_groups)) for i in rows}
    params = {i: SamplingParams(max_tokens=STEPS, constraint=ROWS[i][0], **ROWS[i][1]) for i in rows}
    prompts = {i: [2, 40 + i, 41, 42 + i] for i in rows}
    outputs: dict[int, list[tuple[int, float]]] = {i: [] for i in rows}

    def plan(step: int) -> StepPlan:
        return StepPlan(step_id=step, sequences=tuple(
            ScheduledSequence(request_id=i, token_ids=tuple(prompts[i]) if step == 0 else (PENDING_TOKEN,),
                              cached_len=0 if step == 0 else len(prompts[i]) + step - 1, block_tables=tables[i],
                              sample=True, sampling=params[i], reset=step == 0, prompt_len=len(prompts[i]))
            for i in rows))

    launched = runner.launch(plan(0))
    for step in range(1, STEPS + 1):
        following = runner.launch(plan(step)) if step < STEPS else None
        for token in runner.collect(launched).tokens:
            outputs[token.request_id].append((token.token_id, token.logprob))
        launched = following
    return outputs


def test_deterministic_rows_are_bitwise_the_same_alone_and_batched() -> None:
    """``DETERMINISTIC``: every row of ``ROWS`` (constrained or not, greedy or seeded) gives the same tokens and the
    same logprob bits alone as beside all the others; the constrained rows' sampling thread runs on one thread."""
    runner = make_runner(deterministic=True)
    batched = run_rows(runner, list(range(len(ROWS))))
    threads: list[int] = []
    assert runner._bitmasks is not None
    real_fill = runner._bitmasks.fill

    def counting_fill(constrained: list) -> tuple[torch.Tensor, torch.Tensor]:
        threads.append(torch.get_num_threads())
        return real_fill(constrained)

    runner._bitmasks.fill = counting_fill  # type: ignore[method-assign]
    for i in range(len(ROWS)):
        runner.forget(tuple(range(len(ROWS))))
        assert run_rows(runner, [i]) == {i: batched[i]}, ROWS[i]
    assert threads and set(threads) == {1}
    for (constraint, _), pairs in zip(ROWS, batched.values(), strict=True):
        assert valid(constraint, text_of([token for token, _ in pairs]))
