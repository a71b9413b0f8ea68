"""Request fields the peers' OpenAI-server tests and clients send that the OpenAI routes had refused as unknown
(issue 39's second pass), against the fake model: SGLang's structured-output fields (``regex``, ``ebnf``,
``json_schema``) on chat and completions; vLLM's ``cache_salt`` and ``skip_special_tokens``; and the wording of
an out-of-vocabulary prompt id, which vLLM's ``test_prompt_validation`` matches; and, on the response side, what
stopped each choice (vLLM's ``stop_reason``, SGLang's ``matched_stop``). Each test names the peer test
or field whose shape it checks."""

from __future__ import annotations

from typing import Any

import pytest
from http_testkit import EOS_ID, assert_error, fake_token, post_stream, word_engine

from inference_server.models.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "the capital of france ?"}]


async def post(served: Any, path: str, body: dict) -> dict:
    response = await served.client.post(path, json=body)
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    return ({"messages": MESSAGES} if path == CHAT else {"prompt": "hello world"}) | {"max_tokens": 3, **fields}


# -- SGLang's regex / ebnf / json_schema (test_openai_server.py: test_regex; test_openai_server_ebnf.py) ----------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field, good, bad", [("regex", "(paris|france)", "(("),
                                              ("ebnf", 'root ::= "paris" | "france"', "root ::= ("),
                                              ("json_schema", '{"type": "integer"}', '{"type": 5}')])
async def test_sglang_structured_fields_reach_the_grammar_on_openai_routes(serve, path: str, field: str, good: str,
                                                                           bad: str) -> None:
    async with serve() as served:
        await post(served, path, body_for(path, **{field: good}))
        # a bad value is refused by the compiler, naming the field: the field was read, not ignored
        response = await served.client.post(path, json=body_for(path, **{field: bad}))
        await assert_error(response, 400, "invalid_request", field)
        two = await served.client.post(path, json=body_for(path, **{field: good},
                                                           structured_outputs={"regex": "a+"}))
        error = await assert_error(two, 400, "invalid_value", field)
        assert "only one structured-output field" in error["message"]
        assert served.kv_is_idle()


# -- vLLM's cache_salt (CompletionRequest / ChatCompletionRequest; test_non_object_body_validation.py) -------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_cache_salt_keeps_prefix_cache_entries_apart(serve, path: str) -> None:
    long_prompt = " ".join(["the capital of france is paris ."] * 8)
    def body(**fields: Any) -> dict[str, Any]:
        prompt = {"messages": [{"role": "user", "content": long_prompt}]} if path == CHAT else {"prompt": long_prompt}
        return prompt | {"max_tokens": 1, **fields}

    def cached(payload: dict) -> int:
        return int(payload["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with serve() as served:
        assert cached(await post(served, path, body(cache_salt="one"))) == 0
        assert cached(await post(served, path, body(cache_salt="one"))) > 0  # same salt: the prefix is reused
        assert cached(await post(served, path, body(cache_salt="two"))) == 0  # another salt: not shared
        assert cached(await post(served, path, body())) == 0  # no salt: not shared with salted entries either
        await assert_error(await served.client.post(path, json=body(cache_salt="")), 400, "invalid_value",
                           "cache_salt")
        await assert_error(await served.client.post("/generate", json={"prompt": "hello", "cache_salt": ""}),
                           400, "invalid_value", "cache_salt")
        assert served.kv_is_idle()


# -- vLLM's / SGLang's skip_special_tokens ------------------------------------------------------------------------


async def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(serve, tokenizer: Tokenizer) -> None:
    special = tokenizer.encode("<start_of_turn>", add_special_tokens=False)[0]  # a special token, not a stop
    async with serve(word_engine(token=lambda length, _last: special if length % 2 else 9)) as served:
        plain = await post(served, COMPLETIONS, body_for(COMPLETIONS, max_tokens=4, return_token_ids=True))
        kept = await post(served, COMPLETIONS, body_for(COMPLETIONS, max_tokens=4, skip_special_tokens=False,
                                                       return_token_ids=True))
        assert plain["choices"][0]["token_ids"] == kept["choices"][0]["token_ids"]
        assert special in kept["choices"][0]["token_ids"]
        assert "<start_of_turn>" not in plain["choices"][0]["text"]
        assert "<start_of_turn>" in kept["choices"][0]["text"]
        streamed = await served.client.post(COMPLETIONS, json=body_for(COMPLETIONS, max_tokens=4, stream=True,
                                                                      skip_special_tokens=False))
        assert "<start_of_turn>" in (await streamed.get_data()).decode()
        assert served.kv_is_idle()


# -- vLLM test_prompt_validation.py: test_out_of_vocab_token_ids matches "out of vocabulary" ----------------------


async def test_an_out_of_vocabulary_prompt_id_says_so(serve) -> None:
    async with serve() as served:
        for prompt in ([999999], [[3, 4], [5, 999999]], [-1]):
            response = await served.client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 5})
            error = await assert_error(response, 400, "invalid_request", "prompt")
            assert "out of vocabulary" in error["message"], error["message"]


# -- what stopped a choice: vLLM's stop_reason, SGLang's matched_stop (SGLang test_matched_stop.py) ------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_every_choice_says_what_stopped_it(serve, tokenizer: Tokenizer, path: str) -> None:
    prompt_length = 3 if path == COMPLETIONS else len(tokenizer.apply_chat_template(MESSAGES))
    third = fake_token(prompt_length + 2)  # the third output token
    word = tokenizer.decode([third])
    cases: list[tuple[dict[str, Any], str, str | int | None, str | int | None]] = [
        ({"stop": [word]}, "stop", word, word),
        ({"stop_token_ids": [third]}, "stop", third, third),
        ({"max_tokens": 2}, "length", None, None),
    ]
    async with serve(word_engine(eos_at_length=prompt_length + 4)) as served:
        cases.append(({"max_tokens": 8}, "stop", None, EOS_ID))  # EOS: vLLM says null, SGLang the EOS id
        for fields, finish, stop_reason, matched_stop in cases:
            body = body_for(path, **{"max_tokens": 6, **fields, "n": 2})
            whole = await post(served, path, body)
            for choice in whole["choices"]:
                assert (choice["finish_reason"], choice["stop_reason"], choice["matched_stop"]) == \
                    (finish, stop_reason, matched_stop), (fields, choice)
            streamed = await post_stream(served.client, path, {**body, "stream": True})
            chunks = [event for event in streamed.events[:-1] if event.get("choices")]
            for index in range(2):
                mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
                last = mine[-1]
                assert (last["finish_reason"], last["stop_reason"], last["matched_stop"]) == \
                    (finish, stop_reason, matched_stop), (fields, last)
                assert not any("stop_reason" in part or "matched_stop" in part for part in mine[:-1])
        assert served.kv_is_idle()


# -- /v1/responses as SGLang's test_openai_server.py (TestOpenAIServerv1Responses) sends it ----------------------


async def test_responses_takes_auto_without_tools_and_the_sampling_extensions(serve) -> None:
    base = {"input": "the capital of france ?", "max_output_tokens": 3}
    async with serve() as served:
        # SGLang's run_response: tool_choice auto (this API's default) with no tools, and the bookkeeping fields
        reply = await post(served, "/v1/responses", base | {"tool_choice": "auto", "store": True, "top_p": 1.0,
                                                              "parallel_tool_calls": True, "truncation": "disabled",
                                                              "temperature": 0})
        assert reply["object"] == "response" and reply["tool_choice"] == "auto" and reply["tools"] == []
        assert reply["output"][0]["type"] == "message"
        # on chat OpenAI refuses tool_choice without tools, and so does this server
        await assert_error(await served.client.post(CHAT, json=body_for(CHAT, tool_choice="auto")), 400,
                           "invalid_value", "tool_choice")
        # test_penalty: chat's sampling extensions, checked by admission as on chat
        for field, good, bad in [("frequency_penalty", 1.0, 3.0), ("presence_penalty", 1.0, -3.0),
                                 ("repetition_penalty", 1.1, 0.0), ("top_k", 5, -2), ("min_p", 0.1, 2.0),
                                 ("seed", 7, None)]:
            assert (await post(served, "/v1/responses", base | {field: good}))["status"] == "incomplete"
            if bad is not None:
                await assert_error(await served.client.post("/v1/responses", json=base | {field: bad}), 400,
                                   "invalid_request", field)
        # run_response_stream's fallback sends chat's stream_options.include_usage: usage comes at the end anyway
        streamed = await served.client.post("/v1/responses", json=base | {
            "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200
        text = (await streamed.get_data()).decode()
        assert "event: response.incomplete" in text and '"output_tokens":3' in text
        assert served.kv_is_idle()
