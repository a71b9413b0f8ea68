"""Constrained decoding on the GPU: the ``custom-cuda`` engine gives the same tokens for constrained rows (and
the unconstrained rows beside them) with overlap and CUDA graphs both on as with both off, and every constrained
output is valid. Two engines, not the four combinations: each costs a start-up (graph capture, warm-up) in the GPU
suite's one device call, and the mixed two run no path these two do not (the masked sampling thread with and without
a step launched ahead of it; decode by graph replay and eagerly). Tiny Gemma 4 / Qwen3-MoE presets with dummy
weights (vocabulary 512) and a grammar compiler over a byte-level vocabulary of the same size (ids 3..258 are
bytes)."""

from __future__ import annotations

import attrs
import pytest
import torch
from tests.actors.test_constrained_overlap import CASES, grammar_compiler, requests, text, valid
from tests.actors.test_overlap import run

from inference_server.config import Settings
from inference_server.engine_factory import build_engine_parts
from inference_server.offline import Completion
from inference_server.supervisor import EngineParts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def parts(model: str, *, overlap: bool, graphs: bool) -> EngineParts:
    settings = Settings(model=model, dummy_weights=True, backend="custom-cuda", device="cuda", dtype="float32",
                        kv_cache_tokens=4096, kv_block_size=16, max_batch_size=8, overlap=overlap,
                        cuda_graphs=graphs, max_model_len=512, max_num_batched_tokens=64,
                        kv_expected_sequence_tokens=32)
    built = build_engine_parts(settings)
    grammar = grammar_compiler(built.parts.eos_token_ids)
    built.runner.grammar = grammar
    return attrs.evolve(built.parts, grammar=grammar)


@pytest.mark.parametrize("model", ["gemma-4-26b-a4b-tiny"])  # the constraint path does not depend on the model
async def test_constrained_tokens_are_the_same_with_overlap_and_graphs_on_and_off(model: str) -> None:
    results = {}
    eos: frozenset[int] = frozenset()
    for on in (True, False):  # overlap and graphs together: the serving default against the plainest path
        engine, completions = await run(parts(model, overlap=on, graphs=on), requests(), {})
        eos = engine.parts.eos_token_ids
        assert all(isinstance(c, Completion) for c in completions)
        results[on] = [(c.token_ids, c.finish_reason) for c in completions]  # type: ignore[union-attr]
        runner = engine.parts.step.runner  # type: ignore[union-attr]
        assert (runner.graph_steps > 0) == on  # graphs on: decode replays them; off: none
    reference = results[False]
    assert results[True] == reference
    for (constraint, _), (token_ids, finish) in zip(CASES, reference, strict=True):
        if constraint is not None:
            assert finish == "stop" and valid(constraint, text(token_ids, eos)), (constraint, token_ids)
