"""The engine-client boundary (issue 9's findings), under trio's mock clock: one request can never hurt the
others, every stream entry has one owner and one end, aborts act at once, KV pressure answers at once.

Each test ends with ``Engine.check_integrity()``: an idle engine holds no requests, no stream entries and
no KV blocks beyond the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing
from tests.fake_engine import FakeEngine
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from inference_server.actors.request_handle import RequestHandle
from inference_server.core.kv_grants import StepDemand, StepGrant
from inference_server.core.kv_manager import KVManager
from inference_server.core.scheduler import SchedulerConfig
from inference_server.models.tokenizer import Tokenizer
from inference_server.offline import collect
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import StepPlan, StepResult
from inference_server.supervisor import Engine

from .conftest import fake_parts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def ids_request(first: int, length: int = 5, params: SamplingParams = GREEDY) -> GenerationRequest:
    return GenerationRequest(params=params, prompt_ids=tuple(range(first, first + length)))


async def refusal(handle: RequestHandle) -> RequestError:
    with pytest.raises(RequestError) as caught:
        await handle.admission()
    return caught.value


async def wait_idle(engine: Engine) -> None:
    """Until the scheduler holds nothing and its last releases reached the KV allocator (mock time)."""
    while engine.scheduler.has_work or engine.scheduler.has_pending_releases or engine.parts.kv.num_sequences:
        await trio.sleep(0.01)


def word_tokenizer() -> Tokenizer:
    """A real ``tokenizers`` tokenizer over a few words: its Rust side rejects text with lone surrogates."""
    words = ["<pad>", "<eos>", "<bos>", "<unk>", "hello", "world", "x"] + [f"w{i}" for i in range(505)]
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return Tokenizer(backend, special_tokens={"eos_token": "<eos>"}, eos_token_ids=frozenset({1}), chat_template=None,
                     name="words")


# -- finding 1: one request's input never crashes the engine ---------------------------------------------


async def test_a_prompt_the_tokenizer_cannot_encode_fails_only_that_request(fake_step: FakeEngine) -> None:
    parts = fake_parts(fake_step, tokenizer=word_tokenizer())
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        bad = engine.submit(GenerationRequest(params=GREEDY, prompt="\ud800 x"))
        good = engine.submit(GenerationRequest(params=GREEDY, prompt="hello world"))
        error = await refusal(bad)
        assert error.code == "invalid_request" and error.param == "prompt"
        assert (await collect(good)).finish_reason == "length"
        assert engine.is_ready and not engine.failed
        engine.close()
    engine.check_integrity()


class ExplodingDecodeTokenizer:
    """Encodes fine; raises from ``decode`` (which the request's detokenizer calls when it is built)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [5, 6, 7]

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False) -> list[int]:
        return [5, 6, 7]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        raise RuntimeError("decoder bug")


async def test_any_exception_while_preparing_a_request_is_that_requests_error(fake_step: FakeEngine) -> None:
    parts = fake_parts(fake_step, tokenizer=ExplodingDecodeTokenizer())
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        for _ in range(3):  # each request fails alone; the engine keeps serving
            error = await refusal(engine.submit(GenerationRequest(params=GREEDY, prompt="anything")))
            assert error.code == "internal" and "decoder bug" in error.message
            assert engine.is_ready
        engine.close()
    assert not engine.failed
    engine.check_integrity()


# -- finding 2: a request that could never fit is refused at once, and blocks nobody ---------------------


async def test_a_request_too_big_for_the_sliding_pool_is_refused_and_the_queue_moves(
        autojump_clock: trio.testing.MockClock) -> None:
    """Window 8, block 4, 4 sliding blocks: a 40-token prompt needs 12 sliding blocks in its prefill step."""
    kv = KVManager(block_size=4, num_full_blocks=256, num_sliding_blocks=4, sliding_window=8)
    parts = fake_parts(FakeEngine(step_seconds=0.01), kv=kv, admission_timeout=5.0)
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        too_big = engine.submit(ids_request(10, length=40))
        behind = engine.submit(ids_request(100, length=3, params=SamplingParams(temperature=0.0, max_tokens=4)))
        error = await refusal(too_big)
        assert error.code == "kv_capacity_exceeded" and error.param == "prompt"
        assert "sliding" in error.message and "4" in error.message
        started = trio.current_time()
        assert (await collect(behind)).finish_reason == "length"
        assert trio.current_time() - started < 1.0  # not held until the 5 s admission timeout
        engine.close()
    engine.check_integrity()


# -- finding 4: every stream entry has one owner and one end ---------------------------------------------


async def test_callers_who_leave_at_any_stage_leave_no_stream_entry(fake_step: FakeEngine) -> None:
    """Callers leave while their request is in the admission inbox, queued in the scheduler, and running;
    afterwards the engine holds nothing for any of them."""
    parts = fake_parts(fake_step, scheduler_config=SchedulerConfig(max_batch_size=1, max_num_batched_tokens=64))
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        running = engine.submit(ids_request(10, params=SamplingParams(temperature=0.0, max_tokens=500)))
        queued = engine.submit(ids_request(20))  # waits: one sequence at a time
        await running.admission()
        await queued.admission()
        fake_step.gate = trio.Event()  # hold the executor: nothing moves on until the callers left
        in_inbox = [engine.submit(ids_request(30 + 10 * i)) for i in range(5)]
        for handle in in_inbox:  # closed before admission even looked at them
            handle.close()
        queued.close()
        running.close()
        assert len(engine.streams) == 0  # each entry went with its caller, at once
        fake_step.gate.set()
        await wait_idle(engine)
        engine.check_integrity()
        assert (await collect(engine.submit(ids_request(90)))).finish_reason == "length"
        engine.close()
    engine.check_integrity()


# -- findings 5 and 6: an abort acts at once, before the next step -----------------------------------------


async def test_a_request_whose_caller_left_is_in_no_step_that_starts_afterwards(
        autojump_clock: trio.testing.MockClock) -> None:
    started: list[tuple[float, StepPlan]] = []
    inner = FakeEngine(step_seconds=0.1)

    async def step(plan: StepPlan) -> StepResult:
        started.append((trio.current_time(), plan))
        return await inner(plan)

    parts = fake_parts(step)
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        handle = engine.submit(ids_request(10, params=SamplingParams(temperature=0.0, max_tokens=100)))
        other = engine.submit(ids_request(50, params=SamplingParams(temperature=0.0, max_tokens=20)))
        await handle.admission()
        await handle.__anext__()
        await trio.sleep(0.05)  # mid-step
        left_at = trio.current_time()
        handle.close()
        assert (await collect(other)).finish_reason == "length"
        engine.close()
    later = [plan for time, plan in started if time > left_at]
    assert later, "the other request kept stepping"
    assert all(handle.request_id not in {s.request_id for s in plan.sequences} for plan in later)
    engine.check_integrity()


def refuse_everything(kv: KVManager, demand: StepDemand) -> StepGrant:
    """An allocator that applies releases and grants nothing (the cache is full for everyone)."""
    for request_id, computed in demand.releases:
        kv.release_sequence(request_id, computed)
    return StepGrant(grants=(), preempted=(), free_fraction=0.0)


@pytest.fixture
def frozen_clock() -> trio.testing.MockClock:
    """A clock that never moves unless a test moves it (pytest-trio runs the test on it)."""
    return trio.testing.MockClock()


async def test_an_abort_wakes_an_idle_scheduler_without_any_time_passing(
        frozen_clock: trio.testing.MockClock, fake_step: FakeEngine) -> None:
    """A waiting request whose caller leaves is gone as soon as the tasks run: the clock never moves here,
    so no poll, however frequent, could have found it."""
    parts = fake_parts(fake_step, allocate=refuse_everything, admission_timeout=0.0)
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        handle = engine.submit(ids_request(10))
        await handle.admission()
        await trio.testing.wait_all_tasks_blocked()
        assert handle.request_id in engine.scheduler.requests
        handle.close()
        await trio.testing.wait_all_tasks_blocked()
        assert handle.request_id not in engine.scheduler.requests
        assert trio.current_time() == 0.0
        engine.check_integrity()
        nursery.cancel_scope.cancel()


# -- deadlines and KV backpressure -------------------------------------------------------------------------


async def test_an_admission_deadline_fires_within_one_step_of_its_value(
        autojump_clock: trio.testing.MockClock) -> None:
    step = FakeEngine(step_seconds=1.0)
    parts = fake_parts(step, admission_timeout=4.0,
                       scheduler_config=SchedulerConfig(max_batch_size=1, max_num_batched_tokens=64))
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        blocker = engine.submit(ids_request(10, params=SamplingParams(temperature=0.0, max_tokens=30)))
        await blocker.admission()
        submitted = trio.current_time()
        late = engine.submit(ids_request(20))
        result = await collect(late)
        waited = trio.current_time() - submitted
        assert result.finish_reason == "timeout"
        assert 4.0 <= waited <= 4.0 + step.step_seconds + 0.01
        blocker.close()
        engine.close()
    engine.check_integrity()


async def test_a_kv_backlog_longer_than_the_deadline_is_answered_429_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    """32 KV tokens; a request holds up to 24 (prompt 12 + 12 out) for 13 one-second steps, so the cache turns
    over about 2 tokens a second. Ten arrive at once: the first few fit in the cache or the 20 s admission
    timeout; the rest would wait longer and are refused at once as overloaded, with a Retry-After. Every
    admitted one still ends (served, or timed out), nothing is lost."""
    step = FakeEngine(step_seconds=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    parts = fake_parts(step, num_blocks=8, admission_timeout=20.0, max_queue_size=64)
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        first = engine.submit(ids_request(10, length=12, params=params))
        assert (await collect(first)).finish_reason == "length"  # one finish: the turnover rate is known
        arrived = trio.current_time()
        burst = [engine.submit(ids_request(100 + 20 * i, length=12, params=params)) for i in range(10)]
        outcomes: list[RequestError | None] = []
        for handle in burst:
            try:
                await handle.admission()
                outcomes.append(None)
            except RequestError as error:
                outcomes.append(error)
        assert trio.current_time() - arrived <= step.step_seconds  # answered within a step, not at a deadline
        admitted = [h for h, o in zip(burst, outcomes, strict=True) if o is None]
        refused = [o for o in outcomes if o is not None]
        assert len(admitted) >= 2 and refused
        assert outcomes.index(refused[0]) == len(admitted)  # admitted first, refused after: a queue that grew
        assert all(e.code == "overloaded" and "KV cache" in e.message for e in refused)
        assert all(e.retry_after is not None and e.retry_after >= 1 for e in refused)
        finishes = [(await collect(h)).finish_reason for h in admitted]
        assert set(finishes) <= {"length", "timeout"} and "length" in finishes
        await wait_idle(engine)
        engine.close()
    engine.check_integrity()
