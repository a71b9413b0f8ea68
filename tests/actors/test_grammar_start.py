"""llguidance's tokenizer is built before the engine reports ready, never by a request: llguidance holds the GIL
for the whole build (seconds for a 262k vocabulary), so a build at the first constrained request froze every
stream of the process (core/grammar_compiler.py). The engine here has a fake step; the grammar compiler reads a
byte-level vocabulary of 512 ids."""

from __future__ import annotations

import sys
from pathlib import Path

import llguidance
import pytest
import trio
from tests.fake_engine import FakeEngine

from inference_server.core.grammar_compiler import CompiledGrammar, GrammarCompiler
from inference_server.records.constraints import Constraint
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine

from .conftest import fake_parts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
from http_testkit import byte_level_tokenizer_json

EOS = 1


class CountedTokenizers:
    """Counts llguidance tokenizer builds (``llguidance.LLTokenizer`` calls) while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.builds = 0
        real = llguidance.LLTokenizer

        def counted(*args: object, **kwargs: object) -> llguidance.LLTokenizer:
            self.builds += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(llguidance, "LLTokenizer", counted)


async def test_the_engine_is_ready_only_with_the_grammar_tokenizer_built(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = CountedTokenizers(monkeypatch)
    grammar = GrammarCompiler(byte_level_tokenizer_json(512), 512, {EOS})
    engine = Engine(fake_parts(FakeEngine(), grammar=grammar, eos_token_ids=frozenset({EOS})))
    assert not grammar.tokenizer_built
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        assert engine.is_ready and grammar.tokenizer_built and grammar.ready and counted.builds == 1
        engine.close()
    engine.check_integrity()


async def test_a_constrained_request_builds_nothing_and_compiles_in_a_worker_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counted = CountedTokenizers(monkeypatch)
    grammar = GrammarCompiler(byte_level_tokenizer_json(512), 512, {EOS})
    compiled_in: list[bool] = []
    compile = grammar.compile

    def spied(constraint: Constraint) -> CompiledGrammar:
        compiled_in.append(trio.lowlevel.in_trio_run())  # False in a worker thread
        return compile(constraint)

    monkeypatch.setattr(grammar, "compile", spied)
    engine = Engine(fake_parts(FakeEngine(), grammar=grammar, eos_token_ids=frozenset({EOS})))
    request = GenerationRequest(params=SamplingParams(max_tokens=4, constraint=Constraint.regex("a+", field="regex")),
                                prompt_ids=(3, 4, 5))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        builds_at_ready = counted.builds
        await engine.compile_constraints([request])
        await engine.submit(request).result()
        assert counted.builds == builds_at_ready == 1
        assert compiled_in[0] is False  # compile_constraints: off the event loop
        engine.close()
    engine.check_integrity()


async def test_an_offline_batch_compiles_each_constraint_in_a_worker_thread_and_an_invalid_one_is_its_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``offline.run_engine`` (the ``LLM`` API's batch) compiles before it submits, as the HTTP routes do: no
    compilation runs on the event loop that plans the steps, and a constraint that does not compile ends its
    request with the grammar's error while the others complete."""
    from inference_server.offline import run_engine

    grammar = GrammarCompiler(byte_level_tokenizer_json(512), 512, {EOS})
    on_loop: list[bool] = []
    matcher = grammar._matcher

    def spied(constraint: Constraint) -> llguidance.LLMatcher:
        on_loop.append(trio.lowlevel.in_trio_run())  # False in a worker thread
        return matcher(constraint)

    monkeypatch.setattr(grammar, "_matcher", spied)
    requests = [GenerationRequest(params=SamplingParams(max_tokens=4, constraint=constraint), prompt_ids=(3, 4, 5))
                for constraint in (None, Constraint.regex("a+", field="regex"), Constraint.regex("(", field="regex"),
                                   Constraint.regex("a+", field="regex"), Constraint.regex("b+", field="regex"))]
    ended: list[int] = []
    engine, completions = await run_engine(fake_parts(FakeEngine(), grammar=grammar, eos_token_ids=frozenset({EOS})),
                                           requests, ended.append)
    engine.check_integrity()
    assert on_loop == [False, False, False]  # "a+" (once: cached), "(", "b+"
    assert [c.finish_reason == "error" for c in completions] == [False, False, True, False, False]
    assert completions[2].error is not None and completions[2].error.startswith("invalid_request: regex")
    assert completions[2].token_ids == () and sorted(ended) == [0, 1, 2, 3, 4]
