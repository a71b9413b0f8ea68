"""The engine split in one process: a ``RemoteEngine`` (the front) and ``serve_engine`` around a real ``Engine``
on the fake step, joined by a SocketChannel over a socketpair, both in one trio nursery.

Waits are events: ``wait_all_tasks_blocked`` (the fake step takes no time, and a socketpair's bytes are
readable as soon as written) and the fake step's ``gate``, under generous ``fail_after`` bounds.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing
from tests.fake_engine import FakeEngine
from tests.ipc.split_kit import CharTokenizer, expected_tokens, ids_request, read_all, run_front, split_parts

from inference_server.actors.fault_step import faulty_step
from inference_server.core.faults import FaultDecisions, FaultSpec
from inference_server.core.scheduler import SchedulerConfig
from inference_server.ipc.channel import open_socket_channel
from inference_server.ipc.engine_server import UNSENT_STEPS, serve_engine
from inference_server.ipc.messages import ENGINE_TO_FRONT, FRONT_TO_ENGINE, Hello, StepOutput, Submit, ToEngine
from inference_server.ipc.remote_engine import STOP_GRACE_SECONDS, EngineStopTimeout, RemoteEngine
from inference_server.records.constraints import Constraint
from inference_server.records.errors import RequestError
from inference_server.records.requests import ChatMessage, GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine, EngineParts, EngineState
from inference_server.telemetry.events import RequestRejected

BOUND_S = 60


@attrs.define
class Split:
    remote: RemoteEngine
    engine: Engine
    fake: FakeEngine
    engine_socket: socket.socket
    front_error: list[BaseException]
    engine_failed: list[bool]


@asynccontextmanager
async def split_engine(fake: FakeEngine, *, drain_at_exit: bool = True, tokenizer: CharTokenizer | None = None,
                       parts: EngineParts | None = None) -> AsyncIterator[Split]:
    """The front and the engine side running (on ``parts``, default ``split_parts(fake)``); on exit the front
    drains the engine and both sides stop."""
    front_socket, engine_socket = socket.socketpair()
    engine = Engine(parts if parts is not None else split_parts(fake))
    async with (
        open_socket_channel(front_socket, 8, receive_type=ENGINE_TO_FRONT) as front_channel,
        trio.open_nursery() as nursery,
    ):
        remote = RemoteEngine(front_channel, max_queue_size=256, tokenizer=tokenizer)
        split = Split(remote, engine, fake, engine_socket, [], [])

        async def engine_side() -> None:
            async with open_socket_channel(engine_socket, 16, receive_type=FRONT_TO_ENGINE) as channel:
                split.engine_failed.append(await serve_engine(engine, channel))

        nursery.start_soon(engine_side)
        await nursery.start(run_front, remote, split.front_error)
        yield split
        if drain_at_exit:
            remote.request_drain(BOUND_S)


async def test_a_request_streams_its_tokens_in_order_and_ends_once() -> None:
    request = ids_request(10, max_tokens=40)
    with trio.fail_after(BOUND_S):
        async with split_engine(FakeEngine()) as split:
            assert split.remote.hello is not None and split.remote.hello.max_model_len == 1024
            tokens, finishes = await read_all(split.remote.submit(request))
            await trio.testing.wait_all_tasks_blocked()
            assert split.engine.counts().requests == 0 and len(split.remote.streams) == 0
            split.engine.check_integrity()
    assert tokens == expected_tokens(request)
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert split.remote.state is EngineState.STOPPED and split.engine_failed == [False]
    assert split.remote.stopped is not None and not split.remote.stopped.failed


async def test_many_concurrent_requests_each_get_their_own_tokens() -> None:
    requests = [ids_request(3 + i, max_tokens=1 + (i * 7) % 50, length=1 + i % 9) for i in range(60)]
    results: dict[int, tuple[list[int], list[str | None]]] = {}
    with trio.fail_after(BOUND_S):
        async with split_engine(FakeEngine()) as split, trio.open_nursery() as nursery:

            async def one(i: int, request: GenerationRequest) -> None:
                results[i] = await read_all(split.remote.submit(request))

            for i, request in enumerate(requests):
                nursery.start_soon(one, i, request)
    for i, request in enumerate(requests):
        tokens, finishes = results[i]
        assert tokens == expected_tokens(request), i
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1]), i
    assert split.fake.tokens_emitted == sum(r.params.max_tokens or 0 for r in requests)
    assert split.engine.counts().requests == 0 and len(split.remote.streams) == 0


async def test_text_and_chat_prompts_are_tokenised_in_the_front() -> None:
    """The engine side has no tokenizer (``split_parts``): a text or chat prompt reaching it would be refused
    there; the front's tokenizer turns them into ids, and a template error or a bad sampling value never reaches
    the engine. Errors the engine's admission raises about the prompt still name the field the client sent."""
    tokenizer = CharTokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=6)
    text = GenerationRequest(params, prompt="hello there")
    chat = GenerationRequest(params, messages=(ChatMessage(role="user", content="hi"),))
    with trio.fail_after(BOUND_S):
        async with split_engine(FakeEngine(), tokenizer=tokenizer) as split:
            for request, source in ((text, "hello there"), (chat, "user: hi")):
                handle = split.remote.submit(request)
                tokens, finishes = await read_all(handle)
                ids = tuple(tokenizer.encode(source))
                assert handle.prompt_token_ids == ids
                assert tokens == expected_tokens(GenerationRequest(params, prompt_ids=ids))
                assert finishes[-1] == "length"
            bad_template = GenerationRequest(params, messages=(ChatMessage(role="user", content="{% bad"),))
            bad_value = GenerationRequest(SamplingParams(temperature=-1.0), messages=bad_template.messages)
            too_long = GenerationRequest(SamplingParams(max_tokens=1020), messages=chat.messages)
            refusals = []
            for request in (bad_template, bad_value, too_long):
                with pytest.raises(RequestError) as refused:
                    await split.remote.submit(request).admission()
                refusals.append((refused.value.code, refused.value.param))
            await trio.testing.wait_all_tasks_blocked()
            assert split.engine.counts().requests == 0 and len(split.remote.streams) == 0
    assert refusals[0] == ("invalid_request", "messages")  # the template, refused in the front
    assert refusals[1][0] == "invalid_request" and refusals[1][1] != "messages"  # the value first, as admission
    assert refusals[2] == ("context_length_exceeded", "messages")  # by the engine, naming the chat's field


async def test_a_reader_that_lags_gets_every_token_coalesced() -> None:
    request = ids_request(10, max_tokens=300)  # far more updates than a stream holds (STREAM_CAPACITY)
    with trio.fail_after(BOUND_S):
        async with split_engine(FakeEngine()) as split:
            handle = split.remote.submit(request)
            await trio.testing.wait_all_tasks_blocked()  # the engine finished it; the front coalesced what its stream
            # could not hold into the terminal update
            assert split.engine.counts().requests == 0 and split.fake.tokens_emitted == 300
            tokens, finishes = await read_all(handle)
    assert tokens == expected_tokens(request)
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


async def test_the_engine_steps_at_the_pace_of_a_front_that_stops_reading() -> None:
    """A front that takes no message (its receive buffer of 2 full): the engine plans at most ``UNSENT_STEPS``
    steps past its last send, then waits instead of computing the rest of the request into its outbox; once the
    front reads, the request goes on and ends with every token, in order."""
    fake = FakeEngine()
    request = ids_request(10, max_tokens=300)
    front_socket, engine_socket = socket.socketpair()
    engine = Engine(split_parts(fake))
    tokens: list[int] = []
    finish: str | None = None
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:

            async def engine_side() -> None:
                async with open_socket_channel(engine_socket, 16, receive_type=FRONT_TO_ENGINE) as channel:
                    await serve_engine(engine, channel)

            nursery.start_soon(engine_side)
            async with open_socket_channel(front_socket, 2, receive_type=ENGINE_TO_FRONT) as front:
                await front.send(ToEngine([Submit(1, request, time.monotonic())], []))
                await trio.testing.wait_all_tasks_blocked()
                stalled_at = fake.tokens_emitted
                assert 0 < stalled_at <= 2 * UNSENT_STEPS + 4, stalled_at  # not the 300 an unbounded outbox takes
                async for message in front:
                    if isinstance(message, StepOutput):
                        for update in message.updates:
                            tokens.extend(update.token_ids)
                            finish = update.finish_reason or finish
                        if finish is not None:
                            break
    assert tokens == expected_tokens(request) and finish == "length"


async def test_a_client_leaving_aborts_the_request_in_the_engine() -> None:
    fake = FakeEngine(gate=trio.Event())
    with trio.fail_after(BOUND_S):
        async with split_engine(fake) as split:
            handle = split.remote.submit(ids_request(10, max_tokens=500))
            await handle.admission()
            await trio.testing.wait_all_tasks_blocked()  # the first step waits at the gate
            assert split.engine.counts().requests == 1
            handle.abort()
            await trio.testing.wait_all_tasks_blocked()  # the abort crossed
            assert fake.gate is not None
            fake.gate.set()
            await trio.testing.wait_all_tasks_blocked()
            assert split.engine.counts().requests == 0 and split.engine.counts().kv_sequences == 0
            assert len(split.remote.streams) == 0
            split.engine.check_integrity()
    assert fake.tokens_emitted <= 2  # the step in flight when the abort came, at most one more


async def test_an_abort_in_the_same_message_as_its_submit_ends_the_request() -> None:
    with trio.fail_after(BOUND_S):
        async with split_engine(FakeEngine()) as split:
            handles = [split.remote.submit(ids_request(10 + i, max_tokens=500)) for i in range(4)]
            for handle in handles:
                handle.abort()  # no checkpoint since the submits: one ToEngine carries both
            await trio.testing.wait_all_tasks_blocked()
            assert split.engine.counts().requests == 0 and split.engine.counts().stream_entries == 0
            assert len(split.remote.streams) == 0
            split.engine.check_integrity()
    assert split.fake.tokens_emitted <= 2 * len(handles)  # far from their 500 tokens each


async def test_the_engine_side_dying_ends_every_open_handle_with_an_error() -> None:
    fake = FakeEngine(gate=trio.Event())  # the requests are admitted and never get a token
    with trio.fail_after(BOUND_S):
        async with split_engine(fake, drain_at_exit=False) as split:
            handles = [split.remote.submit(ids_request(10 + i, max_tokens=100)) for i in range(5)]
            await trio.testing.wait_all_tasks_blocked()  # some admitted (the first step waits at the gate)
            split.engine_socket.shutdown(socket.SHUT_RDWR)  # no close frame: the front sees a death
            ends = []
            for handle in handles:
                async with handle:
                    try:
                        await handle.admission()
                    except RequestError as error:  # not admitted yet: refused
                        ends.append((error.code, error.message))
                        continue
                    updates = [update async for update in handle]
                assert len(updates) == 1 and updates[0].error is not None
                ends.append((updates[0].finish_reason, updates[0].error))
            assert ends[0][0] == "error"  # the first request was admitted before the gate stopped the step
            assert all(end in ("error", "unavailable") and "engine process is gone" in message
                       for end, message in ends), ends
            assert split.remote.failed
            with pytest.raises(RequestError) as refused:
                await split.remote.submit(ids_request(1, max_tokens=3)).admission()
            assert refused.value.code == "unavailable"
    assert len(split.front_error) == 1
    assert split.engine.counts().requests == 0  # the engine side drained itself once its front was gone


async def test_a_step_error_refuses_the_requests_the_engine_had_not_admitted() -> None:
    """A step fails in the engine process while most requests still wait in its admission (a batch of 2): those
    reach the front as refusals (``unavailable``, HTTP 503), the admitted ones as one error update each. The
    engine used to send an error update where their admission was due, which the front's handles read as a
    malformed stream (HTTP 500 ``internal``)."""
    fake = FakeEngine()
    step = faulty_step(fake, FaultDecisions(FaultSpec(step_error=1.0)))  # the first step fails
    parts = attrs.evolve(split_parts(fake), step=step,
                         scheduler_config=SchedulerConfig(max_batch_size=2, max_num_batched_tokens=512))
    with trio.fail_after(BOUND_S):
        async with split_engine(fake, drain_at_exit=False, parts=parts) as split:
            handles = [split.remote.submit(ids_request(10 + i, max_tokens=20)) for i in range(12)]
            ends = []
            for handle in handles:
                async with handle:
                    try:
                        await handle.admission()
                    except RequestError as error:
                        ends.append((error.code, error.message))
                        continue
                    updates = [update async for update in handle]
                assert [u.finish_reason for u in updates if u.finished] == ["error"]
                ends.append(("error", updates[-1].error or ""))
    assert all("injected step_error" in message for _, message in ends), ends
    codes = [code for code, _ in ends]
    assert set(codes) == {"error", "unavailable"}, codes
    assert split.remote.failed and split.engine_failed == [True]


async def test_calls_answer_from_the_engine_and_its_telemetry_reaches_the_front() -> None:
    """``read_counts``, ``read_kv_cache_snapshot`` and ``compile_constraints`` are calls answered by the engine
    side; every event of a request (queued, first token, finished) reaches the front's telemetry, in order."""
    request = ids_request(10, max_tokens=6)
    with trio.fail_after(BOUND_S):
        async with split_engine(FakeEngine()) as split:
            subscription = split.remote.telemetry.subscribe()
            tokens, _ = await read_all(split.remote.submit(request))
            assert tokens == expected_tokens(request)
            counts = await split.remote.read_counts()
            assert (counts.requests, counts.stream_entries, counts.kv_sequences, counts.kv_blocks_in_use) == (
                0, 0, 0, 0)
            assert counts.kv_blocks_cached == split.engine.counts().kv_blocks_cached > 0  # the prompt's blocks
            snapshot = await split.remote.read_kv_cache_snapshot()
            assert snapshot == split.engine.kv_cache_snapshot() and snapshot.hashes
            constrained = GenerationRequest(attrs.evolve(request.params, constraint=Constraint.json_object()),
                                            prompt_ids=request.prompt_ids)
            with pytest.raises(RequestError) as refused:  # this engine has no grammar compiler
                await split.remote.compile_constraints([constrained])
            assert refused.value.code == "invalid_request" and refused.value.param == "response_format"
            await split.remote.compile_constraints([request])  # nothing to compile: no call at all
            kinds: list[str] = []
            while "RequestFinished" not in kinds:
                event = await subscription.receive()
                assert event.time <= trio.current_time()  # mapped onto this side's clock
                kinds.append(type(event).__name__)
            assert kinds.index("RequestQueued") < kinds.index("FirstToken") < kinds.index("RequestFinished")


async def test_progress_is_measured_in_the_front() -> None:
    """``seconds_since_progress``: None while nothing is open; counting while a request waits on a stalled
    engine; None again once it ended."""
    fake = FakeEngine(gate=trio.Event())
    request = ids_request(10, max_tokens=3)
    with trio.fail_after(BOUND_S):
        async with split_engine(fake) as split:
            assert split.remote.seconds_since_progress() is None
            handle = split.remote.submit(request)
            await trio.testing.wait_all_tasks_blocked()  # admitted; the first step waits at the gate
            waited = split.remote.seconds_since_progress()
            assert waited is not None and waited >= 0.0
            assert fake.gate is not None
            fake.gate.set()
            tokens, _ = await read_all(handle)
            assert tokens == expected_tokens(request)
            assert split.remote.seconds_since_progress() is None


@asynccontextmanager
async def front_of_a_silent_engine(max_queue_size: int) -> AsyncIterator[tuple[RemoteEngine, trio.Nursery]]:
    """A ``RemoteEngine`` (not yet running: the test starts it in the nursery) whose engine side said ``Hello``
    and then reads and answers nothing."""
    front_socket, engine_socket = socket.socketpair()
    async with (
        open_socket_channel(front_socket, 8, receive_type=ENGINE_TO_FRONT) as front_channel,
        open_socket_channel(engine_socket, 16, receive_type=FRONT_TO_ENGINE) as silent_engine,
        trio.open_nursery() as nursery,
    ):
        await silent_engine.send(Hello("silent", 1024, 100, [0], None, "", "", 0, 0.0))
        yield RemoteEngine(front_channel, max_queue_size=max_queue_size), nursery


async def test_a_hung_engine_process_does_not_hold_the_drain() -> None:
    """An engine process that said Hello and then stopped answering (SIGSTOP, a device hang in its step):
    the drain used to wait for its ``Stopped`` forever, so SIGTERM ended only at the hard-exit watchdog, with
    status 0 and open streams cut without their terminal event. It now waits ``STOP_GRACE_SECONDS`` past the
    drain's timeout, then ends every open request with one error, turns FAILED, and ``run`` raises."""
    errors: list[BaseException] = []
    async with front_of_a_silent_engine(max_queue_size=8) as (remote, nursery):
        await nursery.start(run_front, remote, errors)
        handle = remote.submit(ids_request(10, max_tokens=5))  # sent; never admitted nor answered
        began = time.monotonic()
        with trio.fail_after(BOUND_S):
            await remote.drain(0.2)
        assert time.monotonic() - began >= 0.2 + STOP_GRACE_SECONDS * 0.9
        with pytest.raises(RequestError) as refused:
            await handle.admission()
        assert refused.value.code == "unavailable" and "did not stop" in refused.value.message
        assert remote.failed
    assert len(errors) == 1 and isinstance(errors[0], EngineStopTimeout)


async def test_a_full_front_queue_is_a_counted_rejection() -> None:
    """A submit refused because the front's queue of unsent submits is full is a rejection like any other:
    its ``RequestRejected`` reaches the telemetry (``/metrics``' rejections, ``/scheduler/stats``), as the
    in-process engine's full admission queue does. It used to be answered 429 and counted nowhere (48 of 50
    refusals of a burst were missing from ``inference_server:rejections_total``)."""
    async with front_of_a_silent_engine(max_queue_size=1) as (remote, nursery):
        await nursery.start(remote.run)
        subscription = remote.telemetry.subscribe()
        remote.submit(ids_request(10, max_tokens=3))  # queued, not sent yet
        refused = remote.submit(ids_request(20, max_tokens=3))  # no checkpoint between: the first is unsent
        with pytest.raises(RequestError) as error:
            await refused.admission()
        assert error.value.code == "overloaded"
        with trio.fail_after(BOUND_S):
            event = await subscription.receive()
        assert isinstance(event, RequestRejected) and event.code == "overloaded"
        nursery.cancel_scope.cancel()
