"""Chat that ends: the served template's turn markers stop a chat reply, and ``DEFAULT_MAX_TOKENS`` caps a
request that sets no ``max_tokens`` (reported in ``/v1/models`` and the index)."""

from __future__ import annotations

from http_testkit import MODEL_NAME, SPECIAL_TOKENS, word_engine

from inference_server.config import load_settings
from inference_server.models.chat_templates import GEMMA_TURNS, ChatStops, turn_markers
from inference_server.records.sampling_params import SamplingParams

START, END = SPECIAL_TOKENS.index("<start_of_turn>"), SPECIAL_TOKENS.index("<end_of_turn>")
HELLO = [{"role": "user", "content": "hello"}]
# <bos> <start_of_turn> user hello <end_of_turn> <start_of_turn> model: the reply starts at length 7.
PROMPT_TOKENS = 7


def test_turn_markers_come_from_the_template_and_the_vocabulary() -> None:
    vocabulary = {"<start_of_turn>": 105, "<end_of_turn>": 106, "<eos>": 1, "<|im_end|>": 7}
    assert turn_markers(GEMMA_TURNS, vocabulary.get) == ("<end_of_turn>", "<start_of_turn>")
    # A marker the vocabulary lacks is not one the model could write as a token: left out.
    assert turn_markers(GEMMA_TURNS, {"<end_of_turn>": 106}.get) == ("<end_of_turn>",)
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert turn_markers(chatml, vocabulary.get) == ("<|im_end|>",)
    # The tokenizer's own end-of-sequence text counts when the template writes it literally.
    assert turn_markers("{{ m }}<eos>", vocabulary.get, ["<eos>"]) == ("<eos>",)
    assert turn_markers(None, vocabulary.get) == ()


def test_chat_stops_add_to_the_request_and_leave_eos_ids_alone(tokenizer) -> None:
    stops = ChatStops.of(tokenizer, frozenset({1, END}))
    assert stops.strings == ("<end_of_turn>", "<start_of_turn>") and stops.token_ids == (START,)
    params = stops.apply(SamplingParams(stop=("x", "<start_of_turn>"), stop_token_ids=(9,)))
    assert params.stop == ("x", "<start_of_turn>", "<end_of_turn>") and params.stop_token_ids == (9, START)
    assert stops.apply(SamplingParams(ignore_eos=True)) == SamplingParams(ignore_eos=True)
    assert ChatStops.of(None, frozenset()) == ChatStops()


async def test_chat_reply_ends_at_a_turn_marker_and_hides_it(serve, tokenizer) -> None:

    model = word_engine(token_at_length={PROMPT_TOKENS + 2: START})
    async with serve(model) as served:
        response = await served.client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 20})
        assert response.status_code == 200, await response.get_data()
        payload = await response.get_json()
        choice = payload["choices"][0]
        assert choice["message"]["content"].split() == ["w7", "w8"]
        assert choice["finish_reason"] == "stop" and payload["usage"]["completion_tokens"] == 3
        # The same output through completions (no chat template) goes on: the markers are chat's only.
        prompt_ids = tokenizer.apply_chat_template(HELLO)
        completion = await (await served.client.post("/v1/completions", json={
            "prompt": prompt_ids, "max_tokens": 4})).get_json()
        assert completion["choices"][0]["finish_reason"] == "length"
        # ignore_eos (a benchmark fixing the output length) keeps going past the marker too.
        fixed = await (await served.client.post("/v1/chat/completions", json={
            "messages": HELLO, "max_tokens": 4, "ignore_eos": True})).get_json()
        assert fixed["choices"][0]["finish_reason"] == "length" and fixed["usage"]["completion_tokens"] == 4
        # The native route reports which stop fired: the marker's token id.
        native = await (await served.client.post("/generate", json={
            "prompt_token_ids": prompt_ids, "max_tokens": 20})).get_json()
        assert native["finish_reason"] == "length"  # /generate is not chat: no turn markers
        assert served.kv_is_idle()


async def test_default_max_tokens_caps_chat_without_max_tokens(serve) -> None:
    async with serve(default_max_tokens=5) as served:
        body = {"messages": HELLO}
        payload = await (await served.client.post("/v1/chat/completions", json=body)).get_json()
        choice = payload["choices"][0]
        assert choice["finish_reason"] == "length" and payload["usage"]["completion_tokens"] == 5
        assert choice["message"]["content"].split() == [f"w{PROMPT_TOKENS + k}" for k in range(5)]
        # An explicit max_tokens is not capped by the default.
        longer = await (await served.client.post("/v1/chat/completions", json={**body, "max_tokens": 9})).get_json()
        assert longer["usage"]["completion_tokens"] == 9
        # The Responses API, served over the chat path, is capped alike when it sets no max_output_tokens.
        response = await (await served.client.post("/v1/responses", json={"input": "hello"})).get_json()
        assert response["usage"]["output_tokens"] == 5, response
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        # Completions keep OpenAI's default of 16.
        completion = await (await served.client.post("/v1/completions", json={"prompt": "hello"})).get_json()
        assert completion["usage"]["completion_tokens"] == 16
        card = await (await served.client.get(f"/v1/models/{MODEL_NAME}")).get_json()
        assert card["default_max_tokens"] == 5
        index = await (await served.client.get("/")).get_json()
        assert index["default_max_tokens"] == 5 and index["max_model_len"] == 128


async def test_default_max_tokens_never_exceeds_the_rest_of_the_context(serve) -> None:
    async with serve(default_max_tokens=1000) as served:
        payload = await (await served.client.post("/v1/chat/completions", json={"messages": HELLO})).get_json()
        assert payload["usage"]["total_tokens"] == 128 and payload["choices"][0]["finish_reason"] == "length"


def test_default_max_tokens_setting() -> None:
    assert load_settings(environ={}, dotenv_path=None).default_max_tokens == 1024
    assert load_settings({"DEFAULT_MAX_TOKENS": "0"}, environ={}, dotenv_path=None).default_max_tokens == 0
