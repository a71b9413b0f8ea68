"""The fields the peers' own OpenAI-server tests send (issue 39), against the fake model: chat
``prompt_logprobs``; streamed ``echo`` on completions; chat prefill (``continue_final_message``,
``add_generation_prompt``, ``echo``); ``min_characters``; ``truncation_side``; a ``logit_bias`` error naming
every bad key; ``/tokenize`` with chat messages as vLLM's ``test_tokenize_chat`` sends them; ``session_id`` in
a ``/generate`` body held to the ``X-Session-Id`` rule. Each test names the peer test whose shape it checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from http_testkit import assert_error, fake_prompt_logprob, fake_prompt_top, post_stream

from inference_server.models.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the capital of france ?"},
                {"role": "assistant", "content": "paris"}, {"role": "user", "content": "and the world ?"}]
PREFILL = [{"role": "user", "content": "what said the world ?"}, {"role": "assistant", "content": "hello world ,"}]


async def post(served: Any, path: str, body: dict) -> dict:
    response = await served.client.post(path, json=body)
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


def chunks_of(events: list[Any]) -> list[dict]:
    assert events[-1] == "[DONE]"
    return [event for event in events[:-1] if event.get("choices")]


# -- prompt_logprobs on chat (vLLM test_chat.py: test_prompt_logprobs_chat, test_more_than_one_prompt_logprobs_chat;
#    test_chat_echo.py: test_prompt_logprobs) -------------------------------------------------------------------


@pytest.mark.parametrize("top", [0, 1, 2])
async def test_chat_prompt_logprobs_is_vllms_top_level_list(serve, tokenizer: Tokenizer, top: int) -> None:
    async with serve() as served:
        payload = await post(served, CHAT, {"messages": CONVERSATION, "max_tokens": 2, "prompt_logprobs": top,
                                            "return_token_ids": True})
        prompt_ids = tokenizer.apply_chat_template(CONVERSATION)
        assert payload["prompt_token_ids"] == prompt_ids
        prompt_logprobs = payload["prompt_logprobs"]
        assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
        for position in range(1, len(prompt_ids)):
            expected = {token: logprob for token, logprob in fake_prompt_top(position, top)}
            expected.setdefault(prompt_ids[position], fake_prompt_logprob(position))
            entry = prompt_logprobs[position]
            assert entry == {str(token): {"logprob": logprob, "decoded_token": served.state.token_text(token)}
                             for token, logprob in expected.items()}
            assert top <= len(entry) <= top + 1  # the top-n, and the prompt token when it is not among them
        assert "prompt_logprobs" not in payload["choices"][0]
        assert payload["choices"][0]["logprobs"] is None
        plain = await post(served, CHAT, {"messages": CONVERSATION, "max_tokens": 2})
        assert "prompt_logprobs" not in plain  # vLLM's field is absent (None) unless asked for
        assert served.kv_is_idle()


async def test_chat_prompt_logprobs_with_logprobs_and_n(serve, tokenizer: Tokenizer) -> None:
    async with serve() as served:
        payload = await post(served, CHAT, {"messages": CONVERSATION, "max_tokens": 3, "n": 2, "logprobs": True,
                                            "top_logprobs": 2, "prompt_logprobs": 1})
        assert len(payload["prompt_logprobs"]) == len(tokenizer.apply_chat_template(CONVERSATION))
        for choice in payload["choices"]:
            content = choice["logprobs"]["content"]
            assert len(content) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in content)
        # the ways vLLM refuses it: a negative value, and a stream (prompt logprobs are not streamed)
        await assert_error(await served.client.post(CHAT, json={"messages": CONVERSATION, "prompt_logprobs": -1}),
                           400, "invalid_request", "prompt_logprobs")
        await assert_error(await served.client.post(CHAT, json={"messages": CONVERSATION, "prompt_logprobs": 1,
                                                                "stream": True}),
                           400, "unsupported_parameter", "prompt_logprobs")
        assert served.kv_is_idle()


async def test_echo_logprobs_beside_return_token_ids_name_tokens_as_ids(serve) -> None:
    """vLLM test_return_token_ids.py test_comparison_with_prompt_logprobs_and_logprobs: with echo, the
    logprobs' ``token_id:N`` names cover the prompt then the output, the output's being ``token_ids``."""
    async with serve() as served:
        payload = await post(served, COMPLETIONS, {
            "prompt": "hello world , the capital", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1})
        (choice,) = payload["choices"]
        tokens = choice["logprobs"]["tokens"]
        assert all(token.startswith("token_id:") for token in tokens)
        ids = [int(token.removeprefix("token_id:")) for token in tokens]
        assert ids == choice["prompt_token_ids"] + choice["token_ids"]
        assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"][1:] for key in top)
        assert choice["prompt_logprobs"][0] is None
        assert len(choice["prompt_logprobs"]) == len(choice["prompt_token_ids"])
        assert choice["text"].startswith("hello world , the capital")


# -- echo with stream on completions (SGLang test_openai_server.py: run_completion_stream, run_completion) --------


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("logprobs", [None, 2])
async def test_streamed_echo_is_the_whole_echo_in_chunks(serve, tokenizer: Tokenizer, coalesce: bool,
                                                         logprobs: int | None) -> None:
    prompt = "the capital of france is"
    async with serve(coalesce=coalesce) as served:
        for prompts in (prompt, [tokenizer.encode(prompt)] * 2):  # text, then token-id lists (BOS first)
            body = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "echo": True, "n": 2, "logprobs": logprobs}
            whole = await post(served, COMPLETIONS, body)
            streamed = await post_stream(served.client, COMPLETIONS, {**body, "stream": True,
                                                                      "stream_options": {"include_usage": True}})
            assert streamed.status == 200, streamed.body
            chunks = chunks_of(streamed.events)
            usage = streamed.events[-2]["usage"]  # (cached prompt tokens differ: the prefix cache)
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == \
                (whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"])
            for choice in whole["choices"]:
                mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == choice["index"]]
                assert mine[0]["text"].startswith(prompt)  # SGLang: the first chunk starts with the prompt
                assert "".join(part["text"] for part in mine) == choice["text"]
                assert [part["finish_reason"] for part in mine][-1] == choice["finish_reason"] == "length"
                if logprobs is None:
                    assert all(part["logprobs"] is None for part in mine)
                    continue
                joined: dict[str, list] = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                "text_offset")}
                for part in mine:
                    for key in joined:
                        joined[key] += part["logprobs"][key]
                assert joined == choice["logprobs"]
                assert mine[0]["logprobs"]["top_logprobs"][0] is None  # the first prompt token has no context
        assert served.kv_is_idle()


async def test_streamed_echo_of_max_tokens_zero_sends_the_prompt(serve) -> None:
    async with serve() as served:
        streamed = await post_stream(served.client, COMPLETIONS, {"prompt": "hello world", "max_tokens": 0,
                                                                  "echo": True, "stream": True})
        (chunk,) = chunks_of(streamed.events)
        assert chunk["choices"][0]["text"] == "hello world" and chunk["choices"][0]["finish_reason"] == "length"
        assert served.kv_is_idle()


# -- chat prefill (vLLM test_chat_echo.py: test_chat_session_with_echo_and_continue_final_message;
#    SGLang test_openai_server.py: test_response_prefill) ------------------------------------------------------


@pytest.mark.parametrize("echo", [True, False])
async def test_continue_final_message_continues_the_assistant_message(serve, tokenizer: Tokenizer,
                                                                      echo: bool) -> None:
    async with serve() as served:
        body = {"messages": PREFILL, "max_tokens": 3, "echo": echo, "continue_final_message": True,
                "add_generation_prompt": False, "return_token_ids": True}
        payload = await post(served, CHAT, body)
        rendered = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False, tokenize=False)
        open_text = rendered[:rendered.rindex("hello world ,") + len("hello world ,")]  # no <end_of_turn> after it
        assert payload["prompt_token_ids"] == tokenizer.encode(open_text, add_special_tokens=False)
        message = payload["choices"][0]["message"]
        assert message["role"] == "assistant"
        assert message["content"].startswith("hello world ,") is echo
        streamed = await post_stream(served.client, CHAT, {**body, "stream": True})
        chunks = chunks_of(streamed.events)
        text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
        assert text == message["content"]
        if echo:  # the echoed message comes in its own chunk, right after the role chunk
            assert chunks[1]["choices"][0]["delta"] == {"content": "hello world ,"}
        # SGLang sends continue_final_message alone: add_generation_prompt then defaults to false
        alone = await post(served, CHAT, {"messages": PREFILL, "max_tokens": 3, "continue_final_message": True,
                                          "return_token_ids": True})
        assert alone["prompt_token_ids"] == payload["prompt_token_ids"]
        assert served.kv_is_idle()


async def test_chat_prefill_refusals_and_add_generation_prompt(serve, tokenizer: Tokenizer) -> None:
    async with serve() as served:
        both = await served.client.post(CHAT, json={"messages": PREFILL, "continue_final_message": True,
                                                    "add_generation_prompt": True})
        await assert_error(both, 400, "invalid_value", "continue_final_message")
        user_last = await served.client.post(CHAT, json={"messages": CONVERSATION, "continue_final_message": True})
        await assert_error(user_last, 400, "invalid_value", "continue_final_message")
        no_prompt = await post(served, CHAT, {"messages": CONVERSATION, "add_generation_prompt": False,
                                              "max_tokens": 1, "return_token_ids": True})
        assert no_prompt["prompt_token_ids"] == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
        # echo after a user message: nothing to echo (vLLM echoes only a message of the reply's role)
        echoed = await post(served, CHAT, {"messages": CONVERSATION, "max_tokens": 2, "echo": True})
        plain = await post(served, CHAT, {"messages": CONVERSATION, "max_tokens": 2})
        assert echoed["choices"][0]["message"] == plain["choices"][0]["message"]
        assert served.kv_is_idle()


# -- min_characters (vLLM test_chat.py: test_chat_completion_stream_options) -------------------------------------


@pytest.mark.parametrize("where", ["top", "stream_options"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_min_characters_holds_streamed_text(serve, where: str, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "stream": True, "stream_options": {}}
    body |= {"messages": CONVERSATION} if path == CHAT else {"prompt": "hello world"}
    async with serve(coalesce=False) as served:  # one event per token unless something holds them
        plain = chunks_of((await post_stream(served.client, path, body)).events)
        if where == "top":
            held_body = {**body, "min_characters": 10}
        else:
            held_body = {**body, "stream_options": {"min_characters": 10}}
        held = chunks_of((await post_stream(served.client, path, held_body)).events)

        def texts(chunks: list[dict]) -> list[str]:
            if path == CHAT:  # vLLM's loop: every chunk's delta.content is a string
                return [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:]]
            return [chunk["choices"][0]["text"] for chunk in chunks]

        assert min(map(len, texts(plain)[:-1])) < 10  # without it, single tokens go out
        assert "".join(texts(held)) == "".join(texts(plain)) and len("".join(texts(held))) >= 10
        assert all(len(text) >= 10 for text in texts(held)[:-1])
        assert held[-1]["choices"][0]["finish_reason"] == "length"
        assert served.kv_is_idle()


async def test_min_characters_refusals(serve) -> None:
    async with serve() as served:
        for body, param in [({"min_characters": 5}, "min_characters"),
                            ({"min_characters": -1, "stream": True}, "min_characters"),
                            ({"stream": True, "stream_options": {"min_characters": -2}},
                             "stream_options.min_characters"),
                            ({"min_characters": 5, "stream": True, "stream_options": {"min_characters": 6}},
                             "min_characters")]:
            response = await served.client.post(COMPLETIONS, json={"prompt": "hello", **body})
            await assert_error(response, 400, "invalid_value", param)
        await assert_error(await served.client.post(COMPLETIONS, json={"prompt": "hello", "min_characters": "5"}),
                           400, "invalid_value", "min_characters")


# -- truncation_side (vLLM's ChatCompletionRequest / CompletionRequest field) -------------------------------------


async def test_truncation_side_picks_the_end_that_is_cut(serve, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the capital of france is paris")
    async with serve() as served:
        def body(**fields: Any) -> dict:
            return {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 3, "return_token_ids": True, **fields}

        for fields, kept in [({}, ids[-3:]), ({"truncation_side": "left"}, ids[-3:]),
                             ({"truncation_side": "right"}, ids[:3])]:
            choice = (await post(served, COMPLETIONS, body(**fields)))["choices"][0]
            assert choice["prompt_token_ids"] == kept, fields
        chat = await post(served, CHAT, {"messages": CONVERSATION, "max_tokens": 1, "truncate_prompt_tokens": 4,
                                         "truncation_side": "right", "return_token_ids": True})
        assert chat["prompt_token_ids"] == tokenizer.apply_chat_template(CONVERSATION)[:4]
        native = await post(served, "/generate", {"prompt_token_ids": ids, "max_tokens": 1,
                                                  "truncate_prompt_tokens": 2, "truncation_side": "right"})
        assert native["usage"]["prompt_tokens"] == 2
        await assert_error(await served.client.post(COMPLETIONS, json=body(truncation_side="middle")),
                           400, "invalid_value", "truncation_side")
        assert served.kv_is_idle()


# -- logit_bias errors name every bad key (vLLM test_chat_logit_bias_validation.py) -------------------------------


async def test_logit_bias_errors_name_every_bad_key(serve) -> None:
    async with serve() as served:
        for bias, named, code in [({"bad1": 50.0, "bad2": 20.0, "3": 1.0}, ["bad1", "bad2"], "invalid_value"),
                                  ({"1": "x", "2": "y"}, ["'1'", "'2'"], "invalid_value"),
                                  ({"600": 1.0, "700": 1.0}, ["600", "700", "512"], "invalid_request"),
                                  ({"not_a_token_id": 50}, ["not_a_token_id"], "invalid_value")]:
            response = await served.client.post(CHAT, json={"messages": CONVERSATION, "logit_bias": bias})
            error = await assert_error(response, 400, code, "logit_bias")
            assert all(name in error["message"] for name in named), error["message"]
            assert "logit_bias" in error["message"] or error["param"] == "logit_bias"


# -- /tokenize with chat messages (vLLM test_tokenization.py: test_tokenize_chat) --------------------------------


async def test_tokenize_chat_as_vllm_sends_it(serve, tokenizer_folder: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    async with serve() as served:
        for add_generation in (False, True):
            for add_special in (False, True):
                conversation = [{"role": "user", "content": "hello world"},
                                {"role": "assistant", "content": "the capital of france"},
                                {"role": "user", "content": "what said the world ?"}]
                for continue_final in (False, True):
                    if add_generation and continue_final:
                        continue
                    if continue_final:
                        conversation.append({"role": "assistant", "content": "paris ,"})
                    prompt = hf.apply_chat_template(conversation, add_generation_prompt=add_generation,
                                                    continue_final_message=continue_final, tokenize=False)
                    tokens = hf.encode(prompt, add_special_tokens=add_special)
                    result = await post(served, "/tokenize", {
                        "add_generation_prompt": add_generation, "continue_final_message": continue_final,
                        "add_special_tokens": add_special, "messages": conversation, "model": "tiny-test"})
                    assert result == {"count": len(tokens), "max_model_len": 128, "tokens": tokens,
                                      "token_strs": None}, (add_generation, add_special, continue_final)
        both = await served.client.post("/tokenize", json={"messages": PREFILL, "add_generation_prompt": True,
                                                           "continue_final_message": True})
        await assert_error(both, 400, "invalid_value", "continue_final_message")
        prompt_only = await served.client.post("/tokenize", json={"prompt": "hello", "continue_final_message": True})
        await assert_error(prompt_only, 400, "invalid_value", "continue_final_message")


# -- session_id in a body: the X-Session-Id rule --------------------------------------------------------------------


@pytest.mark.parametrize("session_id", ["a\nb\u0000", "x" * 129, "x" * 10_000, "", "a b", "é"])
async def test_generate_session_id_follows_the_header_rule(serve, session_id: str) -> None:
    async with serve() as served:
        response = await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 1,
                                                               "session_id": session_id})
        error = await assert_error(response, 400, "invalid_value", "session_id")
        assert "1 to 128 visible ASCII characters" in error["message"]
        ok = await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 1, "session_id": "x" * 128})
        assert ok.status_code == 200
        assert served.kv_is_idle()
