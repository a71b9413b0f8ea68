"""The vLLM / OpenAI request fields beyond the basics: each accepted one changes the output as docs/api.md
says, and its bad values are 400s naming the value (and, for token ids, the vocabulary size).

The fake model runs the real sampler here (``word_engine(use_sampler=True)``): its logits favour the fake
token ``w<length>`` (5.0) and EOS at ``eos_at_length`` (10.0), everything else 0, so greedy requests are
deterministic and logit edits show.
"""

from __future__ import annotations

import pytest
from http_testkit import EOS_ID, FAKE_VOCAB_SIZE, assert_error, fake_token, post_stream, word_engine
from tests.fake_engine import FakeEngine

from inference_server.records.constraints import Constraint, TaggedJson, json_schema_text

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
PROMPT_IDS = [2, 9, 10]  # <bos> hello world: the fake model answers w3 w4 ...


def sampled(**fields: object) -> FakeEngine:
    return word_engine(use_sampler=True, **fields)  # type: ignore[arg-type]


async def complete(served, **fields: object) -> dict:
    response = await served.client.post(COMPLETIONS, json={"prompt": PROMPT_IDS, "temperature": 0, **fields})
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


async def test_logit_bias_changes_the_greedy_token(serve) -> None:
    async with serve(sampled()) as served:
        plain = await complete(served, max_tokens=3, return_token_ids=True)
        assert plain["choices"][0]["token_ids"] == [fake_token(n) for n in (3, 4, 5)]
        favoured = 100
        biased = await complete(served, max_tokens=3, return_token_ids=True, logit_bias={str(favoured): 6})
        assert biased["choices"][0]["token_ids"] == [favoured] * 3
        # -100 bans the model's own choice: the next best (all 0, argmax -> the lowest id) wins instead.
        banned = await complete(served, max_tokens=1, return_token_ids=True,
                                logit_bias={str(fake_token(3)): -100})
        assert banned["choices"][0]["token_ids"] == [0]
        assert served.kv_is_idle()


async def test_logit_bias_bad_keys_name_the_value_and_the_vocabulary(serve) -> None:
    async with serve(sampled()) as served:
        for key, code in (("abc", "invalid_value"), ("1.5", "invalid_value"), (str(FAKE_VOCAB_SIZE), "invalid_request"),
                          ("-1", "invalid_request")):
            response = await served.client.post(COMPLETIONS, json={"prompt": "x", "logit_bias": {key: 1}})
            error = await assert_error(response, 400, code, "logit_bias")
            assert key in error["message"] and str(FAKE_VOCAB_SIZE) in error["message"], error


async def test_out_of_vocabulary_ids_name_the_value_and_the_vocabulary(serve) -> None:
    async with serve(sampled()) as served:
        for field in ("stop_token_ids", "allowed_token_ids"):
            response = await served.client.post(CHAT, json={"messages": HELLO, field: [3, 70000]})
            error = await assert_error(response, 400, "invalid_request", field)
            assert "70000" in error["message"] and str(FAKE_VOCAB_SIZE) in error["message"], error


async def test_allowed_token_ids_restrict_sampling(serve) -> None:
    async with serve(sampled()) as served:
        allowed = [fake_token(50), fake_token(60)]
        for temperature in (0, 1.0):
            payload = await complete(served, max_tokens=6, return_token_ids=True, allowed_token_ids=allowed,
                                     temperature=temperature)
            assert set(payload["choices"][0]["token_ids"]) <= set(allowed)
        # An allowed id the model favours is still chosen.
        payload = await complete(served, max_tokens=1, return_token_ids=True,
                                 allowed_token_ids=[7, fake_token(3)])
        assert payload["choices"][0]["token_ids"] == [fake_token(3)]


async def test_min_tokens_holds_back_eos_and_stop_ids(serve) -> None:
    async with serve(sampled(eos_at_length=4)) as served:  # EOS would be the 2nd output token
        early = await complete(served, max_tokens=8, return_token_ids=True)
        assert early["choices"][0]["token_ids"] == [fake_token(3), EOS_ID]
        assert early["choices"][0]["finish_reason"] == "stop"
        held = await complete(served, max_tokens=8, min_tokens=5, return_token_ids=True)
        ids = held["choices"][0]["token_ids"]
        assert len(ids) == 8 and EOS_ID not in ids and held["choices"][0]["finish_reason"] == "length"
        # A stop token id cannot end the output before min_tokens either; at min_tokens it can.
        stop_id = fake_token(5)  # the 3rd output token
        stopped = await complete(served, max_tokens=8, stop_token_ids=[stop_id], return_token_ids=True,
                                 logit_bias={str(EOS_ID): -100})
        assert stopped["choices"][0]["token_ids"] == [fake_token(3), fake_token(4), stop_id]
        late = await complete(served, max_tokens=8, min_tokens=4, stop_token_ids=[stop_id, fake_token(7)],
                              return_token_ids=True)
        assert late["choices"][0]["token_ids"][-1] == fake_token(7)
        assert len(late["choices"][0]["token_ids"]) == 5


async def test_truncate_prompt_tokens_keeps_the_last_tokens(serve) -> None:
    async with serve(sampled()) as served:
        payload = await complete(served, max_tokens=1, truncate_prompt_tokens=2, return_token_ids=True)
        choice = payload["choices"][0]
        assert choice["prompt_token_ids"] == PROMPT_IDS[-2:]
        assert choice["token_ids"] == [fake_token(2)]  # the model saw 2 tokens
        assert payload["usage"]["prompt_tokens"] == 2
        longer = await complete(served, max_tokens=1, truncate_prompt_tokens=50, return_token_ids=True)
        assert longer["choices"][0]["prompt_token_ids"] == PROMPT_IDS


async def test_return_token_ids_completions_and_chat(serve) -> None:
    async with serve() as served:
        response = await served.client.post(COMPLETIONS, json={"prompt": ["hello", "hello world"], "max_tokens": 2,
                                                               "return_token_ids": True})
        choices = (await response.get_json())["choices"]
        assert [c["prompt_token_ids"] for c in choices] == [[2, 15], [2, 15, 16]]
        assert [c["token_ids"] for c in choices] == [[fake_token(2), fake_token(3)], [fake_token(3), fake_token(4)]]
        plain = await (await served.client.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 1})).get_json()
        assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

        chat = await (await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 2,
                                                           "return_token_ids": True})).get_json()
        prompt_ids = chat["prompt_token_ids"]
        assert prompt_ids[0] == 2 and len(prompt_ids) == chat["usage"]["prompt_tokens"]
        assert chat["choices"][0]["token_ids"] == [fake_token(len(prompt_ids)), fake_token(len(prompt_ids) + 1)]

        stream = await post_stream(served.client, COMPLETIONS, {"prompt": "hello", "max_tokens": 3, "stream": True,
                                                                "return_token_ids": True})
        chunks = [e for e in stream.events if e != "[DONE]"]
        assert chunks[0]["choices"][0]["prompt_token_ids"] == [2, 15]
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [fake_token(n) for n in (2, 3, 4)]

        stream = await post_stream(served.client, CHAT, {"messages": HELLO, "max_tokens": 2, "stream": True,
                                                         "return_token_ids": True})
        chunks = [e for e in stream.events if e != "[DONE]"]
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]


async def test_return_tokens_as_token_ids(serve) -> None:
    async with serve() as served:
        payload = await (await served.client.post(COMPLETIONS, json={
            "prompt": "hello", "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True})).get_json()
        logprobs = payload["choices"][0]["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{fake_token(2)}", f"token_id:{fake_token(3)}"]
        assert all(key.startswith("token_id:") for top in logprobs["top_logprobs"] for key in top)
        chat = await (await served.client.post(CHAT, json={
            "messages": HELLO, "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True})).get_json()
        entry = chat["choices"][0]["logprobs"]["content"][0]
        assert entry["token"].startswith("token_id:") and entry["bytes"] == list(entry["token"].encode())
        assert all(top["token"].startswith("token_id:") for top in entry["top_logprobs"])


async def test_stream_options_need_stream_and_continuous_usage_needs_include_usage(serve) -> None:
    async with serve() as served:
        response = await served.client.post(COMPLETIONS, json={"prompt": "hello", "stream_options": {
            "include_usage": True}})
        await assert_error(response, 400, "invalid_value", "stream_options")
        response = await served.client.post(CHAT, json={"messages": HELLO, "stream": False, "stream_options": {}})
        await assert_error(response, 400, "invalid_value", "stream_options")
        alone = await post_stream(served.client, COMPLETIONS, {
            "prompt": "hello", "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}})
        assert all("usage" not in e for e in alone.events if e != "[DONE]")
        both = await post_stream(served.client, COMPLETIONS, {
            "prompt": "hello", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        chunks = [e for e in both.events if e != "[DONE]"]
        assert all(c["usage"] is not None for c in chunks)


async def test_response_format_text_is_the_default(serve) -> None:
    async with serve() as served:
        plain = await (await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3})).get_json()
        text = await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3,
                                                    "response_format": {"type": "text"}})
        assert text.status_code == 200
        assert (await text.get_json())["choices"] == plain["choices"]
        refused = await served.client.post(CHAT, json={"messages": HELLO, "response_format": {"type": "yaml"}})
        error = await assert_error(refused, 400, "invalid_value", "response_format.type")
        assert "yaml" in error["message"]


async def test_modalities_text_asks_for_what_is_served(serve) -> None:
    """OpenAI's ``modalities: ["text"]`` asks for text output, the default and all this server writes: it is
    served as if absent; asking for audio is the 400 ``unsupported_parameter`` naming the field."""
    async with serve() as served:
        plain = await (await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3})).get_json()
        text = await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3, "modalities": ["text"]})
        assert text.status_code == 200, await text.get_data()
        assert (await text.get_json())["choices"] == plain["choices"]
        for modalities in (["text", "audio"], ["audio"]):
            refused = await served.client.post(CHAT, json={"messages": HELLO, "modalities": modalities})
            await assert_error(refused, 400, "unsupported_parameter", "modalities")


async def test_openai_bookkeeping_fields_are_served_on_chat_and_responses(serve) -> None:
    """What OpenAI's SDKs send for its own bookkeeping (``store``, ``metadata``, ``service_tier`` auto/default,
    ``prompt_cache_key``, ``safety_identifier``) changes nothing here and is served as if absent; a service tier
    this server does not have (``priority``, ``flex``) is the 400 ``unsupported_parameter`` naming the field."""
    fields = {"store": True, "metadata": {"app": "eval"}, "service_tier": "auto", "prompt_cache_key": "k1",
              "safety_identifier": "user-7"}
    async with serve() as served:
        plain = await (await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3})).get_json()
        for extra in (fields, {"store": False, "service_tier": "default"}):
            sent = await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3, **extra})
            assert sent.status_code == 200, await sent.get_data()
            assert (await sent.get_json())["choices"] == plain["choices"]
        answered = await served.client.post("/v1/responses", json={
            "input": "hello", "max_output_tokens": 3, **{k: v for k, v in fields.items() if k != "store"}})
        assert answered.status_code == 200, await answered.get_data()
        for path, body in ((CHAT, {"messages": HELLO}), ("/v1/responses", {"input": "hello"})):
            for tier in ("priority", "flex"):
                refused = await served.client.post(path, json={**body, "service_tier": tier})
                await assert_error(refused, 400, "unsupported_parameter", "service_tier")
        await assert_error(await served.client.post(CHAT, json={"messages": HELLO, "metadata": {"n": 1}}),
                           400, "invalid_value", "metadata['n']")


@pytest.mark.parametrize(("path", "body"), [
    (CHAT, {"messages": HELLO}), (COMPLETIONS, {"prompt": PROMPT_IDS}), ("/v1/responses", {"input": "hello"})])
async def test_stream_options_include_obfuscation_false_is_served(serve, path: str, body: dict) -> None:
    """OpenAI's ``stream_options.include_obfuscation``: ``false`` (what OpenAI's SDK documents for saving
    bandwidth) asks for what this server streams anyway, no ``obfuscation`` padding; ``true`` asks for padding it
    does not write, a 400 ``unsupported_parameter`` naming the field."""
    limit = {"max_output_tokens": 3} if path == "/v1/responses" else {"max_tokens": 3}
    async with serve() as served:
        streamed = await post_stream(served.client, path, {**body, **limit, "stream": True,
                                                           "stream_options": {"include_obfuscation": False}})
        assert streamed.status == 200, streamed.body
        assert b"obfuscation" not in streamed.body
        refused = await served.client.post(path, json={**body, **limit, "stream": True,
                                                       "stream_options": {"include_obfuscation": True}})
        await assert_error(refused, 400, "unsupported_parameter", "stream_options.include_obfuscation")


STRUCTURAL_TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "end": "</function>",
     "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]}


@pytest.mark.parametrize(("response_format", "code", "param"), [
    ({**STRUCTURAL_TAG, "structures": []}, "invalid_value", "response_format.structures"),
    ({**STRUCTURAL_TAG, "triggers": ["<tool="]}, "invalid_value", "response_format.structures[0].begin"),
    ({**STRUCTURAL_TAG, "triggers": "<function="}, "invalid_value", "response_format.triggers"),
    ({**STRUCTURAL_TAG, "structures": [{"begin": "<function=f>", "end": "</function>", "schema": [1]}]},
     "invalid_value", "response_format.structures[0].schema"),
    ({**STRUCTURAL_TAG, "structures": [{"begin": "<function=f>", "stop": "x"}]}, "invalid_value",
     "response_format.structures[0]"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "unsupported_parameter",
     "response_format.format"),
    ({"type": "json_object", "triggers": ["<"]}, "invalid_value", "response_format.triggers"),
])
async def test_structural_tag_refusals_name_the_field(serve, response_format: dict, code: str, param: str) -> None:
    async with serve() as served:
        refused = await served.client.post(CHAT, json={"messages": HELLO, "response_format": response_format})
        await assert_error(refused, 400, code, param)


async def test_structural_tag_is_admitted_as_one_constraint(serve) -> None:
    async with serve() as served:
        reply = await served.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3,
                                                     "response_format": STRUCTURAL_TAG})
        assert reply.status_code == 200, await reply.get_json()
        tag = STRUCTURAL_TAG["structures"][0]
        expected = Constraint.structural_tag([TaggedJson(tag["begin"], json_schema_text(tag["schema"]), tag["end"])],
                                             STRUCTURAL_TAG["triggers"])
        assert served.engine.parts.grammar.cached(expected)
