"""Overlap on the GPU: the ``custom-cuda`` engine (Triton kernels, decode graphs, the threaded runner pipeline)
gives the same greedy tokens with ``OVERLAP`` on and off, while requests finish by length and on stop tokens,
callers leave mid-run and a small KV pool preempts (fp32, tiny Gemma 4 and Qwen3-MoE presets with dummy weights).
The scenarios are those of ``tests/actors/test_overlap.py``; here pending tokens are resolved on the GPU from
the previous launched step's samples, and the step's tokens come back through pinned memory behind an event.
"""

from __future__ import annotations

import pytest
import torch
from tests.actors.test_engine_actors import assert_kv_clean
from tests.actors.test_overlap import requests, run

from inference_server.config import Settings
from inference_server.engine_factory import build_engine_parts
from inference_server.offline import Completion
from inference_server.supervisor import EngineParts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_parts(model: str, *, overlap: bool, kv_tokens: int) -> EngineParts:
    settings = Settings(model=model, dummy_weights=True, backend="custom-cuda", device="cuda", dtype="float32",
                        kv_cache_tokens=kv_tokens, kv_block_size=16, max_batch_size=8, overlap=overlap,
                        max_model_len=512, max_num_batched_tokens=64, kv_expected_sequence_tokens=32)
    return build_engine_parts(settings).parts


@pytest.mark.parametrize("model", ["gemma-4-26b-a4b-tiny", "qwen3-30b-a3b-tiny"])
@pytest.mark.parametrize("kv_tokens", [4096, 48])
async def test_overlap_gives_the_same_tokens_on_the_gpu(model: str, kv_tokens: int) -> None:
    plain_on_engine, plain_on = await run(cuda_parts(model, overlap=True, kv_tokens=kv_tokens), requests(), {})
    plain_off_engine, plain_off = await run(cuda_parts(model, overlap=False, kv_tokens=kv_tokens), requests(), {})
    assert all(isinstance(c, Completion) for c in plain_on + plain_off)
    assert [c.token_ids for c in plain_on] == [c.token_ids for c in plain_off]  # type: ignore[union-attr]
    if kv_tokens == 48:
        assert plain_on_engine.scheduler.num_preemptions > 0
    stops = tuple({c.token_ids[4] for c in plain_off[:3] if isinstance(c, Completion)})
    leave_after = {3: 2, 4: 5}
    on_engine, on = await run(cuda_parts(model, overlap=True, kv_tokens=kv_tokens), requests(stops), leave_after)
    off_engine, off = await run(cuda_parts(model, overlap=False, kv_tokens=kv_tokens), requests(stops), leave_after)
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        if i in leave_after:
            assert isinstance(a, list) and isinstance(b, list)
            assert a[:leave_after[i]] == b[:leave_after[i]]
        else:
            assert isinstance(a, Completion) and isinstance(b, Completion)
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), i
    runner = on_engine.parts.step.runner  # type: ignore[union-attr]
    assert getattr(runner, "graph_steps", 1) > 0
    for engine in (plain_on_engine, plain_off_engine, on_engine, off_engine):
        assert_kv_clean(engine)
