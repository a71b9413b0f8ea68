"""The engine split's messages (ipc/messages.py) cross a SocketChannel intact: every message type, and every
field of the records they carry.

The records' samples set every field to a value that is not its default, and a test checks that from the
classes' own field lists: a field added to ``GenerationRequest``, ``SamplingParams`` or ``RequestUpdate`` fails
here until the sample sets it (and, for ``RequestUpdate``, until ``Tokens`` carries it), and then the round trip
proves it crosses.
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

import attrs
import pytest
import trio

from inference_server.ipc.channel import open_socket_channel
from inference_server.ipc.messages import (
    ENGINE_TO_FRONT,
    FRONT_TO_ENGINE,
    Abort,
    Admission,
    CacheSnapshot,
    Call,
    Drain,
    Hello,
    Reply,
    StepOutput,
    Stopped,
    Submit,
    ToEngine,
    Tokens,
)
from inference_server.records.constraints import Constraint
from inference_server.records.requests import (
    ChatMessage,
    GenerationRequest,
    PromptTokenLogprob,
    Rejected,
    RequestUpdate,
    TokenOutput,
)
from inference_server.records.sampling_params import SamplingParams
from inference_server.telemetry.events import RequestRejected

BOUND_S = 30

PARAMS = SamplingParams(
    temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2,
    frequency_penalty=0.3, seed=7, n=2, max_tokens=33, stop=("END", "\n\n"), stop_token_ids=(9, 10), ignore_eos=True,
    stop_regex=("[0-9]+",), bad_words=("paris",), bad_words_token_ids=((8,), (3, 9)),
    logprobs=2, prompt_logprobs=1, include_stop_str_in_output=True, logit_bias=((4, -1.5), (6, 2.0)),
    allowed_token_ids=(4, 5, 6), min_tokens=2, eos_token_ids=(1, 2), skip_special_tokens=False,
    constraint=Constraint("regex", pattern="[a-z]+", field="response_format"),
)
REQUEST = GenerationRequest(
    PARAMS, prompt="hello", prompt_ids=(5, 6, 7),
    messages=(ChatMessage("assistant", "hi", ({"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": {"x": 1}}},),
                          "c0", "tool", "thinking"),),
    add_special_tokens=False, session_id="s", priority=3, trace_id="t", cache_salt="salt",
    truncate_prompt_tokens=100, truncation_side="right", add_generation_prompt=False, continue_final_message=True,
    tools=({"type": "function", "function": {"name": "f"}},), chat_template_kwargs={"enable_thinking": False},
    tokenized_from="messages",
)
UPDATE = RequestUpdate(
    3, (TokenOutput(11, "ab", -0.25, ((12, -1.0),)), TokenOutput(13, "", -0.5)), "stop", "END", "boom",
    prompt_tokens=4, completion_tokens=2, cached_prompt_tokens=1,
    prompt_logprobs=(PromptTokenLogprob(5, None), PromptTokenLogprob(6, -0.75, ((7, -2.0),))),
)

UPDATE_WITHOUT_TEXT = attrs.evolve(UPDATE, tokens=tuple(attrs.evolve(t, text="") for t in UPDATE.tokens))
"""What the front rebuilds of ``UPDATE`` from its ``Tokens`` (the engine's text is empty; the front makes it)."""


def record_values(record: Any) -> Any:
    """Every field of an attrs record, recursively (including fields left out of equality, like
    ``Constraint.field``), with collection types kept."""
    return attrs.asdict(record, recurse=True)  # keeps tuples as tuples


@pytest.mark.parametrize("record", [PARAMS, REQUEST, UPDATE], ids=lambda r: type(r).__name__)
def test_samples_set_every_field(record: Any) -> None:
    unset = [f.name for f in attrs.fields(type(record))
             if f.default is not attrs.NOTHING and getattr(record, f.name) == (
                 f.default.factory() if isinstance(f.default, attrs.Factory) else f.default)]  # type: ignore[arg-type]
    assert unset == [], f"set these fields in the sample so the round trip covers them: {unset}"


async def round_trip(messages: list[Any], receive_type: Any) -> list[Any]:
    """``messages`` sent one way over a socketpair channel, as the other end decodes them."""
    sock_a, sock_b = socket.socketpair()
    with trio.fail_after(BOUND_S):
        async with (
            open_socket_channel(sock_a, 8) as a,
            open_socket_channel(sock_b, 8, receive_type=receive_type) as b,
        ):
            received = []
            async with trio.open_nursery() as nursery:

                async def pump() -> None:
                    for message in messages:
                        await a.send(message)

                nursery.start_soon(pump)
                for _ in messages:
                    received.append(await b.receive())
    return received


async def test_front_to_engine_messages_survive_field_for_field() -> None:
    sent: list[Any] = [
        ToEngine([Submit(1, REQUEST, 12.5), Submit(2, GenerationRequest(SamplingParams(), prompt="x"), 13.0)],
                 [Abort(4), Abort(5, "stop", "END", 17)]),
        ToEngine(),
        Drain(2.5),
        Drain(0.0),
        Call(7, "counts"),
        Call(8, "compile_constraints", [REQUEST]),
    ]
    received = await round_trip(sent, FRONT_TO_ENGINE)
    assert [type(m) for m in received] == [type(m) for m in sent]
    assert received == sent
    submit = received[0].submits[0]
    assert record_values(submit.request) == record_values(REQUEST)
    assert record_values(submit.request.params) == record_values(PARAMS)
    assert submit.request.params.constraint.field == "response_format"  # not part of equality, still carried


async def test_engine_to_front_messages_survive_field_for_field() -> None:
    sent: list[Any] = [
        Hello("m", 4096, 512, [1, 2], 256, "/models/m", "/models/m/tok", 1234, 0.5),
        StepOutput([Admission(3, (5, 6, 7)), Admission(4, rejected=Rejected("overloaded", "full", None, 1.5))],
                   [Tokens.of(UPDATE, 3), Tokens.of(RequestUpdate(5), 5)], "draining"),
        StepOutput(),
        StepOutput(events=pickle.dumps([RequestRejected(1.5, "overloaded", "full", "t-1")]), events_dropped=3),
        Reply(7, counts={"requests": 2, "kv_blocks_cached": 9}),
        Reply(8, snapshot=CacheSnapshot(4, 16, [11, 12])),
        Reply(9, error=Rejected("invalid_request", "bad grammar", "response_format")),
        Stopped(True, "engine failure: boom"),
    ]
    received = await round_trip(sent, ENGINE_TO_FRONT)
    assert [type(m) for m in received] == [type(m) for m in sent]
    assert received == sent
    assert record_values(received[1].updates[0].update()) == record_values(UPDATE_WITHOUT_TEXT)
    assert received[1].updates[1].update() == RequestUpdate(5)
    assert pickle.loads(received[3].events) == [RequestRejected(1.5, "overloaded", "full", "t-1")]
    assert record_values(received[1].admissions[1].rejected) == record_values(Rejected("overloaded", "full",
                                                                                        None, 1.5))


def test_tokens_carry_every_field_of_an_update_but_the_text() -> None:
    tokens = Tokens.of(UPDATE, 9, cached_prompt_tokens=0)
    assert tokens.token_ids == [11, 13] and tokens.logprobs == [-0.25, -0.5]
    assert tokens.top_logprobs == [((12, -1.0),), ()]
    assert tokens.update() == attrs.evolve(UPDATE_WITHOUT_TEXT, request_id=9, cached_prompt_tokens=0)
    assert Tokens.of(UPDATE, 3).update() == UPDATE_WITHOUT_TEXT
    assert Tokens.of(RequestUpdate(4, (TokenOutput(1, "", -1.0),)), 4).top_logprobs is None  # none: not sent
    # a field added to RequestUpdate fails here until Tokens carries it (``tokens`` travels as the columns)
    carried = set(Tokens.__struct_fields__) - {"token_ids", "logprobs", "top_logprobs"}
    assert carried == {f.name for f in attrs.fields(RequestUpdate)} - {"tokens"}


def test_a_steps_tokens_cross_as_ids_not_records() -> None:
    import msgspec

    updates = [RequestUpdate(i, (TokenOutput(100, "", -0.5),)) for i in range(64)]
    step = StepOutput(updates=[Tokens.of(update, update.request_id) for update in updates])
    # ids, logprobs and the other fields by position: no record per token, no field names
    assert len(msgspec.msgpack.encode(step)) * 5 < len(msgspec.msgpack.encode(updates))
