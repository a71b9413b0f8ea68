"""Constrained requests through the whole engine on the real CPU runner: rows with different constraints and
none share every batch; overlap on and off give the same tokens and finishes, also when a tiny KV pool
preempts (a preempted request's grammar is rebuilt and replayed over its output); every constrained output is
valid and ends ``stop`` when its grammar completes. ``tests/backends/test_constrained_gpu.py`` runs the same
cases on the CUDA runner with graphs.

The model is a tiny random Gemma 4 (vocabulary 512); the grammar compiler reads a byte-level vocabulary of the
same size (ids 3..258 are bytes, EOS is 1), so outputs decode to text to check.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.records.constraints import Constraint
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import EngineParts

from .conftest import tiny_model_parts
from .test_engine_actors import assert_kv_clean
from .test_overlap import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
from http_testkit import byte_level_tokenizer_json

EOS = 1
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["n", "tag"], "additionalProperties": False}
CASES: list[tuple[Constraint | None, dict]] = [
    (Constraint.json_schema(SCHEMA), {"temperature": 0.0}),
    (Constraint.regex("[0-9]{2}-[a-f]{3}"), {"temperature": 0.0}),
    (None, {"temperature": 0.0}),
    (Constraint.choice(["north", "south", "east"]), {"temperature": 1.0, "seed": 5}),
    (Constraint.from_grammar('root ::= "v" [0-9] [0-9]? ";"'), {"temperature": 0.8, "seed": 6, "top_p": 0.9}),
    (None, {"temperature": 1.0, "seed": 7}),
    (Constraint.json_schema(SCHEMA), {"temperature": 1.0, "seed": 8, "top_k": 40, "repetition_penalty": 1.2}),
]


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(params=SamplingParams(max_tokens=40, constraint=c, **fields),
                              prompt_ids=tuple(range(3 + 11 * i, 10 + 11 * i)))
            for i, (c, fields) in enumerate(CASES)]


def grammar_compiler(eos: frozenset[int]) -> GrammarCompiler:
    return GrammarCompiler(byte_level_tokenizer_json(512), 512, eos)


def text(token_ids: tuple[int, ...], eos: frozenset[int]) -> str:
    return Tokenizer.from_str(byte_level_tokenizer_json(512)).decode([t for t in token_ids if t not in eos])


def valid(constraint: Constraint | None, output: str) -> bool:
    if constraint is None:
        return True
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(output), SCHEMA)
        return True
    if constraint.kind == "regex":
        return re.fullmatch("[0-9]{2}-[a-f]{3}", output) is not None
    if constraint.kind == "choice":
        return output in constraint.choices
    return re.fullmatch("v[0-9][0-9]?;", output) is not None


def constrained_parts(num_blocks: int, *, overlap: bool) -> EngineParts:
    grammar = grammar_compiler(frozenset({EOS}))
    parts = tiny_model_parts(num_blocks, overlap=overlap, grammar=grammar, eos_token_ids=frozenset({EOS}))
    parts.step.runner.grammar = grammar  # type: ignore[union-attr]
    return parts


@pytest.mark.parametrize("num_blocks", [128, 14])
async def test_constrained_rows_get_the_same_tokens_with_and_without_overlap(num_blocks: int) -> None:
    on_engine, on = await run(constrained_parts(num_blocks, overlap=True), requests(), {})
    off_engine, off = await run(constrained_parts(num_blocks, overlap=False), requests(), {})
    assert [(c.token_ids, c.finish_reason) for c in on] == [(c.token_ids, c.finish_reason) for c in off]
    if num_blocks == 14:
        assert on_engine.scheduler.num_preemptions > 0
    for (constraint, _), completion in zip(CASES, on, strict=True):
        if constraint is not None:
            output = text(completion.token_ids, frozenset({EOS}))
            assert completion.finish_reason == "stop" and valid(constraint, output), (constraint, output)
    assert_kv_clean(on_engine)
    assert_kv_clean(off_engine)
