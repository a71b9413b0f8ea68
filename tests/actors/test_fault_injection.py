"""Each FAULTS wrapper on a running engine (fake in-loop executor, trio's mock clock): a step error fails
the engine and ends every stream with exactly one terminal error; allocator refusals delay but lose nothing;
slow steps only slow; with no faults configured the engine's parts are untouched."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from tests.fake_engine import FakeEngine

from inference_server.actors.fault_step import faulty_step
from inference_server.core.fault_wrappers import refusing_allocator
from inference_server.core.faults import FaultDecisions, FaultSpec, InjectedFault, parse_faults
from inference_server.core.kv_grants import allocate_step
from inference_server.core.scheduler import SchedulerConfig
from inference_server.fault_injection import with_faults
from inference_server.offline import Completion, run_engine
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine, EngineState

from .conftest import fake_parts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def requests(n: int, length: int = 5) -> list[GenerationRequest]:
    return [GenerationRequest(params=PARAMS, prompt_ids=tuple(range(10 * i, 10 * i + length))) for i in range(1, n + 1)]


def assert_idle(engine: Engine) -> None:
    counts = engine.counts()
    assert (counts.requests, counts.stream_entries, counts.kv_sequences, counts.kv_blocks_in_use) == (0, 0, 0, 0)
    engine.parts.kv.check_integrity()


async def timed_run(parts, reqs) -> tuple[Engine, list[Completion], float]:
    start = trio.current_time()
    engine, results = await run_engine(parts, reqs)
    return engine, results, trio.current_time() - start


def test_no_faults_leaves_the_parts_untouched() -> None:
    parts = fake_parts(FakeEngine(0.01))
    assert with_faults(parts, parse_faults("")) is parts
    assert with_faults(parts, parse_faults("seed=4,step_error=0")) is parts


def test_only_the_configured_wrappers_are_installed() -> None:
    parts = fake_parts(FakeEngine(0.01))
    stepped = with_faults(parts, parse_faults("step_delay=0.5:0.1"))
    assert stepped.step is not parts.step and stepped.allocate is allocate_step
    refused = with_faults(parts, parse_faults("alloc_refuse=0.5"))
    assert refused.step is parts.step and refused.allocate is not allocate_step
    assert with_faults(parts, parse_faults("tokenizer_error=0.5")).tokenizer is None  # no tokenizer to wrap


async def test_a_step_error_fails_the_engine_and_ends_every_stream_with_one_error(
        autojump_clock: trio.testing.MockClock) -> None:
    step = FakeEngine(0.01)
    decisions = FaultDecisions(FaultSpec(step_error=0.2, seed=6))  # the 8th step fails
    engine = Engine(fake_parts(faulty_step(step, decisions)))
    handles = []
    with trio.fail_after(60), pytest.raises(BaseExceptionGroup) as caught:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            handles = [engine.submit(r) for r in requests(6)]
            await trio.sleep(1000)  # the step error ends the engine long before
    assert caught.value.subgroup(InjectedFault) is not None
    assert engine.state is EngineState.FAILED and decisions.counts["step_error"] == 1
    assert len(step.plans) == 7  # the steps before the fault ran
    for handle in handles:
        await handle.admission()
        updates = [update async for update in handle]
        terminal = [u for u in updates if u.finished]
        assert len(terminal) == 1 and terminal[0] is updates[-1]
        assert terminal[0].finish_reason == "error" and "injected step_error" in terminal[0].error
    assert len(engine.streams) == 0


async def test_a_step_error_refuses_the_requests_not_yet_admitted(autojump_clock: trio.testing.MockClock) -> None:
    """Requests still in admission when a step fails (here: a batch of 2 fills the admission -> scheduler
    channel, so most of 12 wait) are refused as ``unavailable`` (HTTP 503, retryable: nothing was computed for
    them); they used to get an error update where their admission was due, which every route answered with a
    500 ``internal`` ("unexpected first stream item")."""
    decisions = FaultDecisions(FaultSpec(step_error=1.0))  # the first step fails
    config = SchedulerConfig(max_batch_size=2, max_num_batched_tokens=64)
    engine = Engine(fake_parts(faulty_step(FakeEngine(0.01), decisions), scheduler_config=config))
    handles = []
    with trio.fail_after(60), pytest.raises(BaseExceptionGroup):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            handles = [engine.submit(r) for r in requests(12)]
            await trio.sleep(1000)  # the step error ends the engine long before
    refused = failed = 0
    for handle in handles:
        try:
            await handle.admission()
        except RequestError as error:
            assert error.code == "unavailable" and "injected step_error" in error.message, error
            refused += 1
            continue
        updates = [update async for update in handle]
        assert [u.finish_reason for u in updates if u.finished] == ["error"]
        failed += 1
    assert refused >= 1 and failed >= 1 and refused + failed == 12
    assert len(engine.streams) == 0


async def test_allocator_refusals_delay_requests_but_lose_none(autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64)
    clean_engine, clean, clean_time = await timed_run(
        fake_parts(FakeEngine(0.01), num_blocks=24, scheduler_config=config), requests(6))
    decisions = FaultDecisions(FaultSpec(alloc_refuse=0.3, seed=2))
    parts = fake_parts(FakeEngine(0.01), num_blocks=24, scheduler_config=config,
                       allocate=refusing_allocator(allocate_step, decisions))
    engine, faulted, faulted_time = await timed_run(parts, requests(6))
    assert decisions.counts["alloc_refuse"] > 0
    assert engine.scheduler.num_preemptions > clean_engine.scheduler.num_preemptions  # it acted like pressure
    assert [r.finish_reason for r in faulted] == ["length"] * 6
    assert [r.token_ids for r in faulted] == [r.token_ids for r in clean]
    assert faulted_time > clean_time
    assert_idle(engine)


async def test_slow_steps_only_slow_things_down(autojump_clock: trio.testing.MockClock) -> None:
    _, clean, clean_time = await timed_run(fake_parts(FakeEngine(0.01)), requests(4))
    decisions = FaultDecisions(FaultSpec(step_delay=0.5, step_delay_seconds=2.0, seed=1))
    engine, slow, slow_time = await timed_run(fake_parts(faulty_step(FakeEngine(0.01), decisions)), requests(4))
    delayed = decisions.counts["step_delay"]
    assert delayed > 0
    assert [r.token_ids for r in slow] == [r.token_ids for r in clean]
    assert all(r.finish_reason == "length" for r in slow)
    assert slow_time == pytest.approx(clean_time + 2.0 * delayed, abs=0.5)
    assert_idle(engine)
