"""Overlap on and off give the same tokens through the real CPU runner (``RunnerPipeline``: pending tokens
resolved on the device tensor), whatever ends a request: length, stop tokens, a caller leaving mid-run,
preemption under a tiny KV pool; and every KV block is free afterwards.

Sampling rows mix greedy, seeded temperature sampling (each row has its own generator, so its draws do not
depend on its batch), penalties (their token history is completed on the host when the previous token is in
flight) and top logprobs.
"""

from __future__ import annotations

import attrs
import pytest
import trio

from inference_server.actors.request_handle import RequestHandle
from inference_server.offline import Completion, collect
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine, EngineParts

from .conftest import tiny_model_parts
from .test_engine_actors import assert_kv_clean

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10),
    SamplingParams(temperature=0.0, max_tokens=11, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(temperature=0.0, max_tokens=9, logprobs=3),
    SamplingParams(temperature=0.8, seed=3, presence_penalty=0.5, max_tokens=12),
]


def requests(stop_ids: tuple[int, ...] = ()) -> list[GenerationRequest]:
    return [GenerationRequest(params=attrs.evolve(p, stop_token_ids=tuple(stop_ids)),
                              prompt_ids=tuple(range(3 + 17 * i, 3 + 17 * i + 5 + 2 * i)))
            for i, p in enumerate(PARAMS)]


async def run(parts: EngineParts, batch: list[GenerationRequest], leave_after: dict[int, int]) -> tuple[
        Engine, list[Completion | list[int]]]:
    """Run ``batch`` concurrently; request i's caller leaves after ``leave_after[i]`` tokens (its tokens so far
    are its result then)."""
    results: list[Completion | list[int] | None] = [None] * len(batch)
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        async with trio.open_nursery() as clients:
            for i, request in enumerate(batch):
                handle = engine.submit(request)

                async def consume(i: int = i, handle: RequestHandle = handle) -> None:
                    if i not in leave_after:
                        results[i] = await collect(handle)
                        return
                    seen: list[int] = []
                    async with handle:
                        async for update in handle:
                            seen += [t.token_id for t in update.tokens]
                            if len(seen) >= leave_after[i]:
                                break
                    results[i] = seen

                clients.start_soon(consume)
        engine.close()
    return engine, [r for r in results if r is not None]


@pytest.mark.parametrize("num_blocks", [128, 12])
async def test_overlap_gives_the_same_tokens(num_blocks: int, backend: str) -> None:
    on_engine, on = await run(tiny_model_parts(num_blocks, overlap=True, backend=backend), requests(), {})
    off_engine, off = await run(tiny_model_parts(num_blocks, overlap=False, backend=backend), requests(), {})
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    for a, b in zip(on, off, strict=True):
        assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)
    assert all(c.finish_reason == "length" for c in on)
    if num_blocks == 12:
        assert on_engine.scheduler.num_preemptions > 0
    assert_kv_clean(on_engine)
    assert_kv_clean(off_engine)


async def test_overlap_with_stops_and_callers_leaving_gives_the_same_tokens(backend: str) -> None:
    _, full = await run(tiny_model_parts(64, overlap=False, backend=backend), requests(), {})
    stops = tuple({c.token_ids[4] for c in full[:3]})  # ends some requests early, on a token in flight
    leave_after = {3: 2, 4: 5}
    on_engine, on = await run(tiny_model_parts(64, overlap=True, backend=backend), requests(stops), leave_after)
    off_engine, off = await run(tiny_model_parts(64, overlap=False, backend=backend), requests(stops), leave_after)
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        if i in leave_after:  # what a caller saw before leaving is a prefix of the full output
            assert isinstance(a, list) and isinstance(b, list)
            assert a[:leave_after[i]] == b[:leave_after[i]] == list(full[i].token_ids[:leave_after[i]])
        else:
            assert isinstance(a, Completion) and isinstance(b, Completion)
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    assert any(isinstance(c, Completion) and c.finish_reason == "stop" for c in on)
    assert_kv_clean(on_engine)
    assert_kv_clean(off_engine)


async def test_a_seeded_request_gets_the_same_tokens_however_it_was_scheduled(backend: str) -> None:
    """Each token's noise is drawn from (seed, output position): preemption (which recomputes a request) and
    the discarded draw of a token computed past a stop do not shift a seeded request's stream."""
    seeded = [GenerationRequest(params=SamplingParams(temperature=1.0, seed=11 + i, max_tokens=14),
                                prompt_ids=tuple(range(5 + 13 * i, 12 + 13 * i))) for i in range(5)]
    _, roomy = await run(tiny_model_parts(128, overlap=False, backend=backend), seeded, {})
    tight_engine, tight = await run(tiny_model_parts(9, overlap=True, backend=backend), seeded, {})
    assert tight_engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]  # type: ignore[union-attr]
