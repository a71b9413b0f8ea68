"""The strict request parser: properties (Hypothesis) and a seeded fuzz of every route through the app."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.http.body_parser import load_json, parse_body, structure
from inference_server.http.errors import ApiError
from inference_server.http.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest

RECORDS = [GenerateRequest, CompletionRequest, ChatCompletionRequest]
FIELD_NAMES = ["prompt", "prompt_token_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
               "stop", "seed", "logprobs", "stream_options", "role", "content", "model", "user", "echo"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(FIELD_NAMES), children,
                                                                      max_size=4),
    max_leaves=12)
json_objects = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), json_values, max_size=6)


@settings(max_examples=300, deadline=None)
@given(body=json_objects, record=st.sampled_from(RECORDS))
def test_any_json_object_parses_or_is_a_400(body: dict[str, Any], record: type) -> None:
    try:
        parsed = structure(body, record)
    except ApiError as error:
        assert error.status == 400 and error.code in {"invalid_value", "unknown_field", "missing_field",
                                                      "unsupported_parameter", "invalid_json"}
        assert error.message
    else:
        assert isinstance(parsed, record)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64))
def test_any_bytes_parse_or_are_a_400(raw: bytes) -> None:
    try:
        parse_body(raw, GenerateRequest)
    except ApiError as error:
        assert error.status == 400


lone_surrogates = st.characters(categories=["Cs"])


@settings(max_examples=200, deadline=None)
@given(body=json_objects, path=st.lists(st.integers(0, 5), max_size=4), surrogate=lone_surrogates,
       in_key=st.booleans())
def test_a_lone_surrogate_anywhere_is_a_400_naming_it(body: dict[str, Any], path: list[int], surrogate: str,
                                                      in_key: bool) -> None:
    """Put an unpaired surrogate into a string value or a key somewhere in the body: parsing (of the JSON
    text, with the surrogate as a ``\\uXXXX`` escape) is a 400 ``invalid_unicode``, whatever the record."""
    body = {"prompt": "x", **body}
    node: Any = body
    for step in path:  # walk down to some container
        children = list(node.values()) if isinstance(node, dict) else node
        containers = [c for c in children if isinstance(c, (dict, list))]
        if not containers:
            break
        node = containers[step % len(containers)]
    if isinstance(node, dict) and in_key:
        node["k" + surrogate] = 1
    elif isinstance(node, dict):
        node["k"] = "text " + surrogate
    else:
        node.append(surrogate + " text")
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as an escape, as a client sends it
    with pytest.raises(ApiError) as raised:
        load_json(raw)
    assert raised.value.status == 400 and raised.value.code == "invalid_unicode"
    assert json.loads(raised.value.json_bytes())["error"]["code"] == "invalid_unicode"


def test_paired_surrogate_escapes_are_one_character() -> None:
    assert load_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}


def test_no_coercion() -> None:
    for body, param in [({"prompt": "x", "stream": 1}, "stream"), ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
                        ({"prompt": "x", "temperature": "0.5"}, "temperature"), ({"prompt": 5}, "prompt"),
                        ({"prompt": "x", "max_tokens": True}, "max_tokens"), ({"prompt": "x", "stop": "ab"}, None)]:
        if param is None:
            assert structure(body, GenerateRequest).stop == "ab"
            continue
        with pytest.raises(ApiError) as raised:
            structure(body, GenerateRequest)
        assert raised.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    ({"metadata": "x"}, "metadata"),
    ({"structured_outputs": ["json"]}, "structured_outputs"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": "yes"}]}]},
     "messages[0].content[0].cache_control"),
])
def test_a_non_object_for_an_object_field_says_an_object_was_expected(body: dict[str, Any], param: str) -> None:
    """Not cattrs' ``'str' object has no attribute 'items'``."""
    with pytest.raises(ApiError) as raised:
        structure({"messages": [{"role": "user", "content": "x"}], **body}, ChatCompletionRequest)
    assert raised.value.param == param and raised.value.code == "invalid_value"
    assert raised.value.message.startswith(f"invalid value for {param!r}: expected an object, got ")
    parsed = structure({"messages": [], "metadata": {"a": "b"}, "structured_outputs": {"json": {}}},
                       ChatCompletionRequest)  # objects still parse, their values checked as before
    assert parsed.metadata == {"a": "b"} and parsed.structured_outputs == {"json": {}}


def test_integers_must_fit_in_64_bits() -> None:
    assert structure({"prompt": "x", "seed": 2**64 - 1}, GenerateRequest).seed == 2**64 - 1
    for body, param in [({"prompt": "x", "top_k": 2**64}, "top_k"), ({"prompt_token_ids": [-(2**63) - 1]},
                                                                      "prompt_token_ids[0]"),
                        ({"prompt": "x", "temperature": 10**400}, "temperature")]:
        with pytest.raises(ApiError) as raised:
            structure(body, GenerateRequest)
        assert raised.value.param == param


def test_nulls_and_integers_for_floats() -> None:
    parsed = structure({"prompt": "x", "temperature": 1, "top_p": None, "stream": None}, CompletionRequest)
    assert parsed.temperature == 1.0 and isinstance(parsed.temperature, float) and parsed.top_p is None


def test_empty_unsupported_fields_are_ignored() -> None:
    parsed = structure({"messages": [], "tools": [], "tool_choice": "none", "logit_bias": {}}, ChatCompletionRequest)
    assert parsed.messages == []


@pytest.mark.parametrize("raw", [b"NaN", b"[Infinity]", b'{"a": -Infinity}', b"1e999", b"[" * 50000, b"\xff"])
def test_strict_json(raw: bytes) -> None:
    with pytest.raises(ApiError) as raised:
        load_json(raw)
    assert raised.value.code == "invalid_json"


async def test_seeded_fuzz_never_500_never_html(serve) -> None:
    """Random bodies mixing valid and invalid fields, on every POST route: JSON answers, no 500."""
    rng = random.Random(1234)
    values = [None, True, 0, -1, 1, 3.5, 1e30, "", "x", "hello", [], [1, 2], ["a"], [[2, 3]], {}, {"a": 1},
              [{"role": "user", "content": "hi"}], {"include_usage": True}, 10**30]
    async with serve() as served:
        for _ in range(150):
            path = rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
            body = {rng.choice(FIELD_NAMES): rng.choice(values) for _ in range(rng.randint(0, 5))}
            if rng.random() < 0.5:
                body.setdefault("max_tokens", rng.randint(1, 4))
            response = await served.client.post(path, data=json.dumps(body).encode(),
                                                headers={"Content-Type": "application/json"})
            assert response.status_code != 500 and response.status_code in (200, 400, 404), (body, response.status_code)
            if response.headers["Content-Type"].startswith("application/json"):
                json.loads(await response.get_data())
            else:
                assert response.headers["Content-Type"].startswith("text/event-stream")
        assert served.kv_is_idle()


def test_a_surrogate_after_a_long_run_of_token_ids_is_named_by_its_index() -> None:
    """Lists of numbers are skipped without a Python step per item; a string among them is still found."""
    ids: list[Any] = list(range(512))
    assert load_json(json.dumps({"prompt": ids}).encode()) == {"prompt": ids}
    raw = json.dumps({"prompt": [*ids, 1.5, None, True, ["ok", {"k": "x\ud800"}]]}).encode()
    with pytest.raises(ApiError) as raised:
        load_json(raw)
    assert raised.value.code == "invalid_unicode" and raised.value.param == "prompt[515][1].k"
