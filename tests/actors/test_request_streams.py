"""``RequestStreams`` with a stream interval: the first token at once, then groups of ``interval_tokens``, a
bounded hold (mock clock), and held tokens never lost (finish, failure) nor leaked (caller gone)."""

from __future__ import annotations

import math
from functools import reduce

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.actors.request_handle import RequestHandle
from inference_server.actors.request_streams import RequestStreams, _Entry, merge, merge_all
from inference_server.records.requests import (
    Admitted,
    PromptTokenLogprob,
    Rejected,
    RequestUpdate,
    StreamItem,
    TokenOutput,
)

MAX_HOLD = 1 / 16  # binary fractions: mock times add up exactly
STEP = 1 / 64  # mock seconds between two tokens of one request: well under MAX_HOLD


def token(i: int) -> TokenOutput:
    return TokenOutput(100 + i, f" t{i}", -0.1 * i, ((7, -0.5),))


def update(i: int, *, last: bool = False) -> RequestUpdate:
    return RequestUpdate(request_id=1, tokens=(token(i),), finish_reason="length" if last else None)


def drain(receive: trio.MemoryReceiveChannel) -> list[RequestUpdate]:
    items = []
    while True:
        try:
            items.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return items


def opened(streams: RequestStreams) -> trio.MemoryReceiveChannel:
    receive = streams.open(1)
    assert streams.admitted(1, (5, 6))
    receive.receive_nowait()  # Admitted
    return receive


async def test_interval_one_sends_every_update_at_once() -> None:
    streams = RequestStreams(interval_tokens=1)
    receive = opened(streams)
    for i in range(3):
        assert streams.deliver(update(i))
        assert [u.tokens for u in drain(receive)] == [(token(i),)]
    assert not streams.has_pending()


async def test_first_token_alone_then_groups_then_final_flush(autojump_clock) -> None:
    streams = RequestStreams(interval_tokens=4, max_hold=MAX_HOLD)
    receive = opened(streams)
    received: list[list[int]] = []
    for i in range(11):
        assert streams.deliver(update(i, last=i == 10))
        got = drain(receive)
        if i == 0:
            assert len(got) == 1, "the first token goes out at once"
        received += [[t.token_id - 100 for t in u.tokens] for u in got]
        streams.check_integrity()
        await trio.sleep(STEP)
    # first alone; 1-4 and 5-8 as groups of 4; 9 was held when 10 finished: both go out at once, together
    assert received == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert not streams.is_live(1) and not streams.has_pending()


async def test_the_first_token_is_not_held_after_an_update_without_tokens(autojump_clock) -> None:
    streams = RequestStreams(interval_tokens=4, max_hold=MAX_HOLD)
    receive = opened(streams)
    streams.deliver(RequestUpdate(request_id=1))  # e.g. a prefill chunk's update: no token yet
    await trio.sleep(STEP)
    streams.deliver(update(0))
    assert [u.tokens for u in drain(receive)] == [(), (token(0),)]


async def test_stalled_stream_flushes_within_the_bound(autojump_clock) -> None:
    streams = RequestStreams(interval_tokens=8, max_hold=MAX_HOLD)
    receive = opened(streams)
    streams.deliver(update(0))
    drain(receive)
    await trio.sleep(STEP)
    held_at = trio.current_time()
    streams.deliver(update(1))
    await trio.sleep(STEP)
    streams.deliver(update(2))
    assert streams.has_pending(), "the scheduler must keep waking while tokens are held"
    assert streams.flush_pending() == [] and drain(receive) == [], "held: the bound has not passed"
    await trio.sleep(held_at + MAX_HOLD - trio.current_time())  # no more tokens arrive meanwhile
    assert streams.flush_pending() == []
    (flushed,) = drain(receive)
    assert [t.token_id for t in flushed.tokens] == [101, 102] and not flushed.finished
    assert not streams.has_pending()


async def test_a_token_past_the_bound_releases_the_held_ones(autojump_clock) -> None:
    streams = RequestStreams(interval_tokens=8, max_hold=MAX_HOLD)
    receive = opened(streams)
    streams.deliver(update(0))
    await trio.sleep(STEP)
    held_at = trio.current_time()
    for i in (1, 2):
        streams.deliver(update(i))
        await trio.sleep(STEP)
    drain(receive)
    await trio.sleep_until(held_at + MAX_HOLD)  # token 1 has been held MAX_HOLD when token 3 arrives
    streams.deliver(update(3))
    assert [[t.token_id for t in u.tokens] for u in drain(receive)] == [[101, 102, 103]]


async def test_tokens_slower_than_the_bound_are_never_held(autojump_clock) -> None:
    """Slow steps (a CPU step of a second): holding could only add latency, never save an event."""
    streams = RequestStreams(interval_tokens=4, max_hold=MAX_HOLD)
    receive = opened(streams)
    for i in range(4):
        streams.deliver(update(i))
        assert len(drain(receive)) == 1, f"token {i} was held"
        await trio.sleep(2 * MAX_HOLD)


async def test_failure_carries_held_tokens_and_a_gone_caller_leaves_nothing_behind(autojump_clock) -> None:
    streams = RequestStreams(interval_tokens=4, max_hold=MAX_HOLD)
    receive = opened(streams)
    for i in range(3):
        streams.deliver(update(i))
        await trio.sleep(STEP)
    drain(receive)
    streams.fail_all("engine failed")
    (final,) = drain(receive)
    assert final.finish_reason == "error" and [t.token_id for t in final.tokens] == [101, 102]
    assert not streams.has_pending() and len(streams) == 0

    receive = streams.open(2)
    streams.admitted(2, (5,))
    for i in range(3):
        streams.deliver(RequestUpdate(request_id=2, tokens=(token(i),)))
        await trio.sleep(STEP)
    assert streams.has_pending()
    assert streams.client_left(2)
    streams.check_integrity()
    assert not streams.has_pending() and not streams.deliver(RequestUpdate(request_id=2, tokens=(token(9),)))


async def test_a_failure_refuses_a_request_not_yet_admitted() -> None:
    """A caller whose request was not admitted yet waits in ``admission()``, which reads an ``Admitted`` or a
    ``Rejected``: ``fail_all`` gave it an error update, which the handle read as a malformed stream (a 500
    ``internal`` from every route, in the fault runs for most requests in flight when a step failed). It is
    refused as ``unavailable`` now; an admitted one still gets its terminal error update."""
    streams = RequestStreams()
    waiting = streams.open(1)
    admitted = streams.open(2)
    assert streams.admitted(2, (5, 6))
    streams.fail_all("engine failure: boom")
    (refusal,) = drain(waiting)
    assert refusal == Rejected("unavailable", "engine failure: boom")
    started, final = drain(admitted)
    assert isinstance(started, Admitted) and final.finish_reason == "error" and final.error == "engine failure: boom"
    assert len(streams) == 0
    streams.check_integrity()


async def test_prompt_logprobs_and_per_token_logprobs_survive_holding(autojump_clock) -> None:
    streams = RequestStreams(interval_tokens=3, max_hold=MAX_HOLD)
    receive = opened(streams)
    prompt = (PromptTokenLogprob(5, None), PromptTokenLogprob(6, -1.5, ((6, -1.5),)))
    streams.deliver(RequestUpdate(request_id=1, tokens=(token(0),), prompt_logprobs=prompt))
    for i in range(1, 5):
        await trio.sleep(STEP)
        streams.deliver(update(i, last=i == 4))
    updates = drain(receive)
    assert updates[0].prompt_logprobs == prompt
    assert [t for u in updates for t in u.tokens] == [token(i) for i in range(5)]


def test_interval_needs_a_positive_bound() -> None:
    with pytest.raises(ValueError):
        RequestStreams(interval_tokens=0)
    with pytest.raises(ValueError):
        RequestStreams(interval_tokens=2, max_hold=0)


@settings(max_examples=60, deadline=None)
@given(interval=st.integers(1, 9), count=st.integers(1, 40), capacity=st.integers(3, 8),
       reads=st.lists(st.booleans(), min_size=40, max_size=40))
def test_every_token_arrives_once_in_order_with_fewer_updates(interval: int, count: int, capacity: int,
                                                              reads: list[bool]) -> None:
    """Whatever the interval and however the reader lags (the stream's own backpressure coalescing on
    top), every token arrives exactly once, in order, in at most 1 + ceil((count - 1) / interval) updates
    while the reader keeps up."""

    async def run() -> tuple[list[RequestUpdate], int]:
        streams = RequestStreams(capacity, interval_tokens=interval, max_hold=10.0)
        receive = opened(streams)
        received: list[RequestUpdate] = []
        lagged = False
        for i in range(count):
            streams.deliver(update(i, last=i == count - 1))
            streams.flush_pending()
            if reads[i]:
                received += drain(receive)
            else:
                lagged = True
            await trio.sleep(0.001)
        while streams.has_pending():
            received += drain(receive)
            streams.flush_pending()
        received += drain(receive)
        return received, lagged

    received, lagged = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [t for u in received for t in u.tokens] == [token(i) for i in range(count)]
    assert [u.finished for u in received] == [False] * (len(received) - 1) + [True]
    if not lagged:
        assert len(received) <= 1 + math.ceil((count - 1) / interval)


UPDATES = st.lists(
    st.builds(
        RequestUpdate,
        request_id=st.just(7),
        tokens=st.lists(st.builds(TokenOutput, st.integers(0, 9), st.text(max_size=2), st.just(-1.0)),
                        max_size=3).map(tuple),
        prompt_logprobs=st.none() | st.just((PromptTokenLogprob(2, None),)),
    ),
    min_size=1, max_size=6,
).map(lambda updates: [*updates[:-1], attrs.evolve(updates[-1], finish_reason="stop", completion_tokens=4)])


@settings(max_examples=100, deadline=None)
@given(updates=UPDATES)
def test_merge_all_equals_merging_pairwise(updates: list[RequestUpdate]) -> None:
    assert merge_all(updates) == reduce(merge, updates)


@settings(max_examples=100, deadline=None)
@given(updates=UPDATES, with_last=st.booleans())
def test_released_held_updates_equal_merge_all(updates: list[RequestUpdate], with_last: bool) -> None:
    """A stream entry folds held updates as they arrive; releasing them gives what merging them all gives."""
    entry = _Entry(trio.open_memory_channel[StreamItem](1)[0])
    held = updates[:-1] if with_last else updates
    for held_update in held:
        entry.hold(held_update)
    assert entry.release(updates[-1] if with_last else None) == merge_all(updates)
    assert entry.held is None and not entry.held_tokens and entry.held_logprobs is None


@given(updates=UPDATES)
@settings(max_examples=30, deadline=None)
def test_handle_result_merges_every_update(updates: list[RequestUpdate]) -> None:
    """``result()`` and the coalescing read of buffered updates merge in one pass, as pairwise merges would."""
    async def main() -> RequestUpdate:
        send, receive = trio.open_memory_channel[StreamItem](len(updates) + 1)
        send.send_nowait(Admitted(7, 1, (2,)))
        for update in updates:
            send.send_nowait(update)
        return await RequestHandle(7, receive, lambda request_id: None).result()

    assert trio.run(main) == reduce(merge, updates)
