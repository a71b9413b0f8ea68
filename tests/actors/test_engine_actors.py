"""The actor engine under trio's autojump clock: refills, fairness, priority, preemption, deadlines,
overload, client aborts, crashes — and after each test every KV block is free."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing
from tests.fake_engine import FakeEngine

from inference_server.actors.request_handle import RequestHandle
from inference_server.core.kv_manager import KVManager
from inference_server.core.scheduler import SchedulerConfig
from inference_server.offline import Completion, collect, run_engine
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine, EngineParts, EngineState
from inference_server.telemetry.events import StepCompleted

from .conftest import fake_parts, tiny_model_parts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def ids_request(first: int, length: int = 5, params: SamplingParams = GREEDY, **kw) -> GenerationRequest:
    return GenerationRequest(params=params, prompt_ids=tuple(range(first, first + length)), **kw)


async def refusal(handle: RequestHandle) -> RequestError:
    """The typed error a refused request's handle raises."""
    with pytest.raises(RequestError) as caught:
        await handle.admission()
    return caught.value


def assert_kv_clean(engine: Engine) -> None:
    engine.check_integrity()
    kv = engine.parts.kv
    assert kv.num_sequences == 0
    assert kv.full_pool.num_referenced == 0
    assert len(engine.streams) == 0


async def test_requests_complete_and_kv_is_freed(fake_step: FakeEngine) -> None:
    engine, results = await run_engine(fake_parts(fake_step), [ids_request(10 * i) for i in range(1, 6)])
    assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in results)
    assert engine.state is EngineState.STOPPED
    assert_kv_clean(engine)


async def test_a_freed_slot_is_refilled_in_the_next_step(fake_step: FakeEngine) -> None:
    parts = fake_parts(fake_step, scheduler_config=SchedulerConfig(max_batch_size=2, max_num_batched_tokens=64))
    short = ids_request(10, params=SamplingParams(temperature=0.0, max_tokens=2))
    engine, _ = await run_engine(parts, [short, ids_request(20), ids_request(30)])
    plans = [p for p in fake_step.plans if p.sequences]
    finished_step = next(i for i, p in enumerate(plans) if 1 in p.finished_request_ids)
    assert {s.request_id for s in plans[finished_step].sequences} == {2, 3}  # 3 took 1's slot at once
    assert_kv_clean(engine)


async def test_fair_share_bounds_a_light_sessions_latency(autojump_clock: trio.testing.MockClock) -> None:
    """A heavy session floods 20 requests; a light session's single request then finishes within a few
    request lifetimes under fair share, and only after the whole flood under FCFS."""

    async def light_latency(policy: str) -> float:
        step = FakeEngine(step_seconds=0.01)
        parts = fake_parts(step, scheduling_policy=policy,
                           scheduler_config=SchedulerConfig(max_batch_size=2, max_num_batched_tokens=64))
        async with trio.open_nursery() as nursery:
            engine: Engine = await nursery.start(Engine(parts).run)
            heavy = [engine.submit(ids_request(10 + i, session_id="heavy")) for i in range(20)]
            for stream in heavy:
                nursery.start_soon(collect, stream)
            await trio.sleep(0.05)
            started = trio.current_time()
            light = engine.submit(ids_request(300, session_id="light"))
            result = await collect(light)
            latency = trio.current_time() - started
            engine.close()
        assert result.finish_reason == "length"
        assert_kv_clean(engine)
        return latency

    fair, fcfs = await light_latency("fair"), await light_latency("fcfs")
    assert fair <= 0.2  # at most about one heavy request's lifetime (7 steps) plus its own
    assert fcfs >= 0.5  # behind the whole flood (20 requests / 2 slots * 7 steps)


async def test_priority_orders_admission(fake_step: FakeEngine) -> None:
    parts = fake_parts(fake_step, scheduler_config=SchedulerConfig(max_batch_size=1, max_num_batched_tokens=64))
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        fake_step.gate = trio.Event()  # hold the executor while all requests queue
        streams = [engine.submit(ids_request(10, priority=5))]
        while not fake_step.plans:  # request 1 is in the held step
            await trio.sleep(0.01)
        streams += [engine.submit(ids_request(10 * i, priority=p)) for i, p in [(2, 0), (3, 9), (4, 1)]]
        await trio.sleep(0.1)
        fake_step.gate.set()
        for s in streams:
            nursery.start_soon(collect, s)
        await trio.sleep(5)
        engine.close()
    first_seen = []
    for plan in fake_step.plans:
        for seq in plan.sequences:
            if seq.request_id not in first_seen:
                first_seen.append(seq.request_id)
    assert first_seen[0] == 1  # it was alone when the executor was held
    assert first_seen[1:] == [2, 4, 3]  # then priority 0, 1, 9
    assert_kv_clean(engine)


async def test_preemption_under_a_tiny_pool_keeps_greedy_outputs(backend: str) -> None:
    requests = [ids_request(5 + 30 * i, length=6 + i, params=SamplingParams(temperature=0.0, max_tokens=10))
                for i in range(5)]
    roomy_engine, roomy = await run_engine(tiny_model_parts(num_blocks=128, backend=backend), requests)
    tight_engine, tight = await run_engine(tiny_model_parts(num_blocks=10, backend=backend), requests)
    assert tight_engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    assert all(r.finish_reason == "length" for r in tight)
    assert_kv_clean(roomy_engine)
    assert_kv_clean(tight_engine)


async def test_admission_deadline_ends_unstarted_requests_with_timeout(fake_step: FakeEngine) -> None:
    parts = fake_parts(fake_step, admission_timeout=1.0,
                       scheduler_config=SchedulerConfig(max_batch_size=1, max_num_batched_tokens=64))
    fake_step.step_seconds = 0.5  # the first request holds the only slot for 3 s
    engine, results = await run_engine(parts, [ids_request(10), ids_request(20)])
    assert results[0].finish_reason == "length"
    assert results[1].finish_reason == "timeout" and results[1].token_ids == ()
    assert_kv_clean(engine)


async def test_full_inbox_rejects_at_once_as_overloaded(fake_step: FakeEngine) -> None:
    """With the executor stalled, requests back up: the scheduler's inbox (1) fills, admission blocks
    sending on, the admission inbox (1) fills, and the next submission is refused at once."""
    parts = fake_parts(fake_step, max_queue_size=1,
                       scheduler_config=SchedulerConfig(max_batch_size=1, max_num_batched_tokens=64))
    fake_step.gate = trio.Event()
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        accepted = []
        for i in range(4):
            accepted.append(engine.submit(ids_request(10 * (i + 1))))
            await trio.sleep(0.01)
        with pytest.raises(RequestError) as rejected:
            await engine.submit(ids_request(99)).admission()
        assert rejected.value.code == "overloaded" and rejected.value.retry_after is not None
        fake_step.gate.set()
        for stream in accepted:
            assert (await collect(stream)).finish_reason == "length"
        engine.close()
    assert_kv_clean(engine)


async def test_invalid_requests_are_rejected_before_queueing(fake_step: FakeEngine) -> None:
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(fake_parts(fake_step)).run)
        too_long = engine.submit(GenerationRequest(params=GREEDY, prompt_ids=(7,) * 510))
        bad_param = engine.submit(ids_request(10, params=SamplingParams(temperature=-1.0)))
        no_tokenizer = engine.submit(GenerationRequest(params=GREEDY, prompt="hello"))
        assert (await refusal(too_long)).code == "context_length_exceeded"
        error = await refusal(bad_param)
        assert error.code == "invalid_request" and error.param == "temperature"
        assert "token ids" in (await refusal(no_tokenizer)).message
        engine.close()
    assert not fake_step.plans


async def test_closing_the_stream_aborts_within_one_step_and_frees_kv(fake_step: FakeEngine) -> None:
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(fake_parts(fake_step)).run)
        handle = engine.submit(ids_request(10, params=SamplingParams(temperature=0.0, max_tokens=400)))
        await handle.admission()
        await handle.__anext__()  # a first token
        steps_before = len(fake_step.plans)
        handle.close()
        while engine.parts.kv.num_sequences:
            await trio.sleep(0.001)
        assert len(fake_step.plans) - steps_before <= 2  # the step in flight, then the abort
        engine.close()
    assert_kv_clean(engine)


async def test_an_actor_crash_ends_every_request_with_an_error_and_nothing_hangs() -> None:
    step = FakeEngine(0.01, fail_at=3)
    engine = Engine(fake_parts(step))
    results: dict[int, Completion] = {}

    async def consume(i: int, handle: RequestHandle) -> None:
        results[i] = await collect(handle)

    with trio.fail_after(10), pytest.raises(BaseExceptionGroup) as caught:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            for i in range(1, 4):
                handle = engine.submit(ids_request(10 * i, params=SamplingParams(max_tokens=50)))
                nursery.start_soon(consume, i, handle)
    assert caught.value.subgroup(RuntimeError) is not None
    assert engine.state is EngineState.FAILED and not engine.is_ready
    # The consumers were cancelled with the nursery; the streams still hold the terminal events.
    assert (await refusal(engine.submit(ids_request(10)))).code == "unavailable"


async def test_an_actor_crash_delivers_a_terminal_error_to_each_stream() -> None:
    step = FakeEngine(0.01, fail_at=3)
    engine = Engine(fake_parts(step))
    handles = []
    with trio.fail_after(10), pytest.raises(BaseExceptionGroup):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            handles = [engine.submit(ids_request(10 * i, params=SamplingParams(max_tokens=50)))
                       for i in range(1, 4)]
    for handle in handles:  # nobody read during the run: everything is buffered, ending in one error
        await handle.admission()
        updates = [update async for update in handle]
        terminal = [u for u in updates if u.finished]
        assert len(terminal) == 1 and terminal[0] is updates[-1]
        assert terminal[0].finish_reason == "error" and "injected step failure" in terminal[0].error
    assert len(engine.streams) == 0


async def test_drain_gives_in_flight_requests_a_terminal_event(fake_step: FakeEngine) -> None:
    fake_step.step_seconds = 1.0
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(fake_parts(fake_step)).run)
        handle = engine.submit(ids_request(10, params=SamplingParams(temperature=0.0, max_tokens=100)))
        results: list[Completion] = []

        async def consume() -> None:
            results.append(await collect(handle))

        nursery.start_soon(consume)
        await trio.sleep(2.5)
        await engine.drain(timeout=3.0)
        assert (await refusal(engine.submit(ids_request(20)))).code == "unavailable"
    assert results[0].finish_reason == "error" and "shut down" in results[0].error
    assert 3 <= len(results[0].token_ids) < 100
    assert engine.state is EngineState.STOPPED


async def test_a_shared_prefix_is_computed_once_with_identical_outputs() -> None:
    """The second request's 16-token prefix comes from the radix cache: only its suffix is computed, and its
    greedy output equals a run without prefix caching."""
    shared = tuple(range(40, 56))
    first = GenerationRequest(params=SamplingParams(temperature=0.0, max_tokens=3), prompt_ids=(*shared, 7))
    second = GenerationRequest(params=SamplingParams(temperature=0.0, max_tokens=5), prompt_ids=(*shared, 8, 9))

    async def run_sequentially(parts: EngineParts) -> tuple[Engine, list[Completion]]:
        outputs = []
        async with trio.open_nursery() as nursery:
            engine: Engine = await nursery.start(Engine(parts).run)
            for request in (first, second):
                outputs.append(await collect(engine.submit(request)))
            engine.close()
        return engine, outputs

    parts = tiny_model_parts(num_blocks=64)
    engine, outputs = await run_sequentially(parts)
    # first: 17 prompt tokens + 2 fed-back outputs; second: only its 2 new prompt tokens + 4 fed-back outputs
    assert parts.step.runner.tokens_computed == (17 + 2) + (2 + 4)
    uncached = tiny_model_parts(num_blocks=64)
    uncached = attrs.evolve(uncached, kv=KVManager(block_size=4, num_full_blocks=64, num_sliding_blocks=64,
                                                   sliding_window=uncached.kv.sliding_window,
                                                   enable_prefix_cache=False))
    _, reference = await run_sequentially(uncached)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert_kv_clean(engine)


async def test_active_kv_token_cap_holds_requests_back(fake_step: FakeEngine) -> None:
    """With MAX_ACTIVE_KV_TOKENS room for about one request, requests run one at a time."""
    parts = fake_parts(fake_step, scheduler_config=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64,
                                                                   max_active_kv_tokens=12))
    engine, results = await run_engine(parts, [ids_request(10 * i) for i in range(1, 4)])
    assert all(r.finish_reason == "length" for r in results)
    assert max(len(p.sequences) for p in fake_step.plans) == 1
    assert_kv_clean(engine)


async def test_queued_token_cap_rejects_as_overloaded(autojump_clock: trio.testing.MockClock) -> None:
    """One slot, slow steps: while request 1 runs, requests 2 and 3 wait (10 prompt tokens queued), so
    request 4 (5 more) would exceed MAX_QUEUED_TOKENS=12 and is refused as overloaded."""
    step = FakeEngine(step_seconds=1.0)
    parts = fake_parts(step, max_queued_tokens=12,
                       scheduler_config=SchedulerConfig(max_batch_size=1, max_num_batched_tokens=64))
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        handles = []
        for i in range(4):
            handles.append(engine.submit(ids_request(10 * (i + 1))))
            await trio.sleep(0.01)
        for handle in handles[:3]:
            assert await handle.admission() == 5
        assert (await refusal(handles[3])).code == "overloaded"
        for handle in handles[:3]:
            assert (await collect(handle)).finish_reason == "length"
        engine.close()
    assert_kv_clean(engine)


async def test_queued_token_cap_takes_a_longer_prompt_when_nothing_is_queued(
        autojump_clock: trio.testing.MockClock) -> None:
    """A prompt longer than MAX_QUEUED_TOKENS used to be refused as overloaded (429, retry in 1 s) even with
    nothing queued: every retry got the same answer. The cap bounds what waits behind others; a request that
    finds the queue empty is taken (and one behind it is refused while it waits)."""
    step = FakeEngine(step_seconds=1.0)
    parts = fake_parts(step, max_queued_tokens=4,
                       scheduler_config=SchedulerConfig(max_batch_size=1, max_num_batched_tokens=64))
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        first = engine.submit(ids_request(10))
        assert await first.admission() == 5
        assert (await collect(first)).finish_reason == "length"
        running = engine.submit(ids_request(20))  # runs: the queue is empty again
        assert await running.admission() == 5
        await trio.sleep(0.01)
        waiting = engine.submit(ids_request(30))  # waits behind it: the queue was empty
        assert await waiting.admission() == 5
        await trio.sleep(0.01)
        assert (await refusal(engine.submit(ids_request(40)))).code == "overloaded"  # 5 queued ahead + 5 > 4
        for handle in (running, waiting):
            assert (await collect(handle)).finish_reason == "length"
        engine.close()
    assert_kv_clean(engine)




async def test_a_step_report_counts_the_requests_of_its_own_step(fake_step: FakeEngine) -> None:
    """With overlap, step N is reported after step N+1's grant and after step N's tokens ended requests: its
    waiting / running counts (the step's row in the run file and timeline, its ``/telemetry/tail`` line)
    must still be those right after its own grant, so the request that ended with step N is running in it."""
    parts = fake_parts(fake_step, scheduler_config=SchedulerConfig(max_batch_size=3, max_num_batched_tokens=64))
    engine = Engine(parts)
    steps: list[StepCompleted] = []
    engine.telemetry.sinks.append(lambda event: steps.append(event) if isinstance(event, StepCompleted) else None)
    short = ids_request(10, params=SamplingParams(temperature=0.0, max_tokens=2))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        handles = [engine.submit(r) for r in (short, ids_request(20), ids_request(30))]
        async with trio.open_nursery() as clients:
            for handle in handles:
                clients.start_soon(collect, handle)
        engine.close()
    planned = [s for s in steps if s.plan is not None and s.plan.sequences]
    assert sum(1 for s in planned if 1 in {q.request_id for q in s.plan.sequences}) >= 2  # it ran, then ended
    for step in planned:  # room for all three: nothing waits, and each request in the batch is running
        assert step.plan is not None and step.step_running is not None
        assert (step.step_running >= len(step.plan.sequences), step.step_waiting) == (True, 0), step.step_id
    assert_kv_clean(engine)
