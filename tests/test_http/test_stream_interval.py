"""``STREAM_INTERVAL`` end to end: every route streams the same tokens, text, logprobs, finishes and usage
with an interval as without, in fewer events; the first token comes alone; a stream whose tokens stop
coming still gets what was held within ``STREAM_INTERVAL_MS`` (mock clock). Also: the pre-encoded events
are byte for byte what the generic encoders write."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
from http_testkit import MODEL_NAME, fake_token, post_stream, word_engine
from tests.fake_engine import FakeEngine

from inference_server.http.native import NativeEncoder
from inference_server.http.openai_format import ChatEncoder, CompletionEncoder
from inference_server.http.sse import event
from inference_server.records.requests import RequestUpdate, TokenOutput

STEP = 0.01  # mock seconds per fake step
INTERVAL = 4
HELLO = [{"role": "user", "content": "hello"}]


async def stream(serve: Any, interval: int, path: str, body: dict[str, Any], *,
                 model: FakeEngine | None = None, hold_ms: float = 10_000.0) -> list[Any]:
    async with serve(model or word_engine(step_seconds=STEP), stream_interval=interval,
                     stream_interval_ms=hold_ms) as served:
        with trio.fail_after(60):
            result = await post_stream(served.client, path, body)
        assert result.status == 200 and await served.kv_settles_idle()
        return result.events


def openai_choices(events: list[Any], delta: bool) -> dict[int, dict[str, Any]]:
    """Per choice: its text, logprobs entries, token ids and finish, whatever the chunking."""
    merged: dict[int, dict[str, Any]] = {}
    for chunk in events:
        if chunk == "[DONE]" or not chunk["choices"]:
            continue
        (choice,) = chunk["choices"]
        out = merged.setdefault(choice["index"], {"text": "", "logprobs": [], "token_ids": [], "finish": None})
        out["text"] += choice["delta"].get("content", "") if delta else choice["text"]
        if choice["logprobs"] is not None:
            logprobs = choice["logprobs"]
            out["logprobs"] += logprobs["content"] if delta else list(zip(
                logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], logprobs["text_offset"],
                strict=True))
        out["token_ids"] += choice.get("token_ids", [])
        out["finish"] = out["finish"] or choice["finish_reason"]
    return merged


def usage_of(events: list[Any]) -> Any:
    return [c["usage"] for c in events if c != "[DONE]" and not c["choices"]]


def token_chunks(events: list[Any], delta: bool) -> list[dict[str, Any]]:
    return [c for c in events if c != "[DONE]" and c["choices"] and (
        not delta or ("content" in c["choices"][0]["delta"] and "role" not in c["choices"][0]["delta"]))]


OPENAI_CASES = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 11, "logprobs": 2, "echo": False,
                         "stream_options": {"include_usage": True}}, False),
    ("/v1/completions", {"prompt": ["hello", "hello world"], "n": 2, "max_tokens": 9, "stop": ["w7"],
                         "return_token_ids": True}, False),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 10, "logprobs": True, "top_logprobs": 2,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, True),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 12, "n": 3, "stop": [" w13"]}, True),
]


@pytest.mark.parametrize(("path", "body", "delta"), OPENAI_CASES)
async def test_openai_streams_carry_the_same_output_in_fewer_chunks(serve, autojump_clock, path: str,
                                                                    body: dict[str, Any], delta: bool) -> None:
    body = {"model": MODEL_NAME, "stream": True, **body}
    one = await stream(serve, 1, path, body)
    grouped = await stream(serve, INTERVAL, path, body)
    assert openai_choices(grouped, delta) == openai_choices(one, delta)
    assert usage_of(grouped) == usage_of(one)
    assert len(token_chunks(grouped, delta)) < len(token_chunks(one, delta))
    for choice in openai_choices(grouped, delta).values():
        stops = body.get("stop", [])
        assert choice["finish"] == ("stop" if stops else "length")
        assert not any(stop in choice["text"] for stop in stops)  # not even a held part of one


async def test_native_stream_groups_after_a_lone_first_token(serve, autojump_clock) -> None:
    body = {"prompt": "hello", "max_tokens": 11, "stream": True, "logprobs": 1}
    one = (await stream(serve, 1, "/generate", body))[:-1]
    grouped = (await stream(serve, INTERVAL, "/generate", body))[:-1]
    # first token alone and at once; then groups of INTERVAL; the finishing token flushes what is held
    assert [len(e["token_ids"]) for e in grouped] == [1, 4, 4, 2]
    assert [t for e in grouped for t in e["token_ids"]] == [fake_token(n) for n in range(2, 13)]
    for field in ("token_ids", "logprobs", "top_logprobs"):
        assert [x for e in grouped for x in e[field]] == [x for e in one for x in e[field]]
    assert all(len(e["logprobs"]) == len(e["top_logprobs"]) == len(e["token_ids"]) for e in grouped)
    assert "".join(e["text"] for e in grouped) == "".join(e["text"] for e in one)
    final_one, final_grouped = one[-1], grouped[-1]
    assert {k: v for k, v in final_grouped.items() if k not in ("id", "token_ids", "text", "logprobs",
                                                                 "top_logprobs")} == \
        {k: v for k, v in final_one.items() if k not in ("id", "token_ids", "text", "logprobs", "top_logprobs")}


async def test_responses_api_stream_has_the_same_text(serve, autojump_clock) -> None:
    body = {"model": MODEL_NAME, "input": "hello", "max_output_tokens": 9, "stream": True}
    one = await stream(serve, 1, "/v1/responses", body)
    grouped = await stream(serve, INTERVAL, "/v1/responses", body)

    def deltas(events: list[Any]) -> list[str]:
        return [e["delta"] for e in events if e.get("type") == "response.output_text.delta"]

    assert "".join(deltas(grouped)) == "".join(deltas(one)) and len(deltas(grouped)) < len(deltas(one))
    done = [[e["text"] for e in events if e.get("type") == "response.output_text.done"] for events in (one, grouped)]
    assert done[0] == done[1] == ["".join(deltas(one))]


async def test_slow_steps_are_streamed_token_by_token(serve, autojump_clock) -> None:
    """Steps slower than STREAM_INTERVAL_MS: holding would only add latency, so nothing is held."""
    body = {"prompt": "hello", "max_tokens": 6, "stream": True}
    events = (await stream(serve, INTERVAL, "/generate", body, model=word_engine(step_seconds=0.2), hold_ms=100.0))[:-1]
    assert [len(e["token_ids"]) for e in events] == [1] * 6


async def test_the_hold_bound_caps_tokens_per_event(serve, autojump_clock) -> None:
    """With a bound of 2.5 steps, waiting for a 4th held token would hold the 1st 3 steps: groups of 3 go
    out, though the interval allows 8."""
    body = {"prompt": "hello", "max_tokens": 10, "stream": True}
    events = (await stream(serve, 8, "/generate", body, hold_ms=2.5 * STEP * 1000))[:-1]
    assert [len(e["token_ids"]) for e in events] == [1, 3, 3, 3]


# -- pre-encoded events are what the generic path writes -------------------------------------------------


def tokens(*pieces: str) -> tuple[TokenOutput, ...]:
    return tuple(TokenOutput(10 + i, piece, -0.5) for i, piece in enumerate(pieces))


PIECES = [(" plain",), (" a", "\"quoted\\", "\n\tnew"), ("é", "💡", "\u2028"), ("",), ("\ud800",)]


@pytest.mark.parametrize("pieces", PIECES)
def test_pre_encoded_events_match_the_generic_encoding(pieces: tuple[str, ...]) -> None:
    state: Any = SimpleNamespace(model_name="m")
    update = RequestUpdate(request_id=1, tokens=tokens(*pieces))
    native = NativeEncoder("gen-1", 3, False, state)
    assert native.update(0, update) == event(NativeEncoder("gen-1", 3, False, state).payload(update, final=False))
    for cls in (CompletionEncoder, ChatEncoder):
        for include_usage in (False, True):
            fast = cls(state, "id-1", [3], 1, with_logprobs=False, include_usage=include_usage,
                       continuous_usage=False)
            generic = cls(state, "id-1", [3], 1, with_logprobs=False, include_usage=include_usage,
                          continuous_usage=False)
            generic._head = fast._head  # same ``created`` second
            generic._plain = False
            assert fast._plain
            assert fast.update(0, update) == generic.update(0, update)
