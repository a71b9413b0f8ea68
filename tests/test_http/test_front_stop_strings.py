"""Stop strings matched in the front (``ENGINE_PROCESS=separate``, docs/ipc.md decision 1): the client gets the
same text, finish and usage as from the in-process engine, its stream ends at the match, and the engine stops
computing the request (the front's ``Abort(reason="stop")`` reaches it: its telemetry counts a stop, its KV is
freed, it samples far fewer tokens than ``max_tokens``). Both modes run in every test, whatever
``--engine-process`` says."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from http_testkit import MODEL_NAME, assert_engine_clean, post_stream, serving, word_engine

from inference_server.telemetry.events import RequestFinished, TelemetryEvent

MAX_TOKENS = 100  # the fake model's context is 128 tokens
STEP = 0.01  # mock seconds per fake step

CASES = [
    ("/v1/completions", {"prompt": "hello", "stop": ["w7"]}),
    ("/v1/completions", {"prompt": ["hello", "hello world"], "n": 2, "stop": ["w9 w1", "w12"],
                         "include_stop_str_in_output": True, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "stop": [" w13"],
                              "logprobs": True, "top_logprobs": 1}),
]


def merged(events: list[Any], chat: bool) -> tuple[dict[int, tuple[str, Any, int]], list[Any]]:
    """Per choice: its text, finish reason and number of logprob entries; and the usage chunks."""
    out: dict[int, tuple[str, Any, int]] = {}
    usage = []
    for chunk in events:
        if chunk == "[DONE]":
            continue
        if chunk.get("usage"):
            usage.append(chunk["usage"])
        for choice in chunk["choices"]:
            text, finish, n = out.get(choice["index"], ("", None, 0))
            text += choice["delta"].get("content", "") if chat else choice["text"]
            logprobs = choice["logprobs"]
            if logprobs is not None:
                n += len(logprobs["content"] if chat else logprobs["tokens"])
            out[choice["index"]] = (text, finish or choice["finish_reason"], n)
    return out, usage


async def run(tokenizer: Any, separate: bool, path: str, body: dict[str, Any]) -> tuple[Any, list[str], int]:
    """The stream's choices and usage, the engine's finish reasons, and the tokens the engine sampled."""
    finishes: list[str] = []

    def on_event(event: TelemetryEvent) -> None:
        if isinstance(event, RequestFinished):
            finishes.append(event.finish_reason)

    async with serving(word_engine(step_seconds=STEP), tokenizer, separate=separate) as served:
        served.engine.telemetry.sinks.append(on_event)
        with trio.fail_after(60):
            result = await post_stream(served.client, path, {
                "model": MODEL_NAME, "stream": True, "max_tokens": MAX_TOKENS,
                "stream_options": {"include_usage": True}, **body})
            assert result.status == 200
            await assert_engine_clean(served.engine)  # separate: once the front's stop aborts arrived
        return merged(result.events, "chat" in path), finishes, served.model.tokens_emitted


@pytest.mark.parametrize(("path", "body"), CASES)
async def test_a_stop_string_in_the_front_ends_the_stream_as_in_process(tokenizer, autojump_clock, path: str,
                                                                        body: dict[str, Any]) -> None:
    one_process, one_finishes, _ = await run(tokenizer, False, path, body)
    split, split_finishes, sampled = await run(tokenizer, True, path, body)
    assert split == one_process
    choices, usage = split
    assert usage and all(u["completion_tokens"] < MAX_TOKENS for u in usage)
    for text, finish, _ in choices.values():
        assert finish == "stop"
        if not body.get("include_stop_str_in_output"):
            assert not any(stop in text for stop in body["stop"])  # not even a held part of one
    # the engine ended every request as a stop (the front's abort says so), long before max_tokens
    assert one_finishes == split_finishes == ["stop"] * len(choices)
    assert sampled < len(choices) * MAX_TOKENS // 2
