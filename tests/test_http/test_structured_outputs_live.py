"""Structured outputs against a live ``inference-server serve`` on the embedded *base* model (Gemma 3 270M):
only a real logits constraint makes a base model answer with valid JSON, a regex match or one of the choices,
so every test asserts validity (``json.loads`` + ``jsonschema``, ``re.fullmatch``, membership), plain and
streamed, on every API field that carries a constraint.

Our own versions of the peers' tests for these features (SGLang's ``test_json_constrained``,
``test_regex_constrained``, ``test_ebnf_constrained``; vLLM's structured-output OpenAI tests): the same
questions, asked of this server.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from inference_server.backends.sampler import MIN_LOGPROB

REQUEST_TIMEOUT = 300.0

# Every value bounded (enums, lengths, ranges): the base model cannot wander forever, and the request ends
# "stop" when the grammar is complete.
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                   "population": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "capital": {"type": "boolean"}},
    "required": ["name", "population", "capital"], "additionalProperties": False,
}
ORDER_SCHEMA: dict[str, Any] = {
    "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                                        "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["sku", "qty"], "additionalProperties": False}},
    "type": "object",
    "properties": {"status": {"enum": ["new", "paid", "shipped"]},
                   "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 2},
                   "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
    "required": ["status", "items", "note"], "additionalProperties": False,
}
IP_REGEX = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"
CAPITALS = ["Paris", "London", "Berlin", "Madrid"]
EBNF = 'root ::= "The capital is " city "."\ncity ::= "Paris" | "London" | "Rome"'
LARK = 'start: "answer: " DIGIT DIGIT\nDIGIT: /[0-9]/'


class Weekday(pydantic.BaseModel):
    day: Literal["Monday", "Tuesday", "Wednesday"]
    hours: int = pydantic.Field(ge=0, le=24)


@pytest.fixture(scope="module")
def url(embedded_server: tuple[int, str]) -> str:
    """The session's embedded-model server (``tests/conftest.py``: 16 sequences a step, overlap on)."""
    return embedded_server[1]


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT, max_retries=0)


def chat(http: httpx.Client, content: str, **fields: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 80, "temperature": 0, **fields}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def streamed_text(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """The text of a streamed OpenAI-route reply and its finish reason."""
    text, finish = "", None
    with http.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


# -- JSON ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema", [CITY_SCHEMA, ORDER_SCHEMA], ids=["city", "order-refs-anyof-enum"])
def test_response_format_json_schema_is_valid(http: httpx.Client, schema: dict[str, Any]) -> None:
    choice = chat(http, "Describe it as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop"


def test_response_format_json_object_is_a_json_object(http: httpx.Client) -> None:
    choice = chat(http, "Reply in JSON.", response_format={"type": "json_object"}, max_tokens=200, temperature=0.8,
                  seed=11)
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # an unbounded object may reach max_tokens: what came is still a JSON object's beginning
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


def test_sdk_parse_with_a_pydantic_model(sdk: openai.OpenAI) -> None:
    completion = sdk.beta.chat.completions.parse(
        model="gemma-3-270m", messages=[{"role": "user", "content": "Which day and how many hours?"}],
        response_format=Weekday, max_tokens=60, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weekday) and 0 <= parsed.hours <= 24


def test_streamed_json_schema_is_valid(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "A city as JSON."}], "max_tokens": 80, "temperature": 0.7,
            "seed": 5, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY_SCHEMA}}}
    text, finish = streamed_text(http, "/v1/chat/completions", body)
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    assert finish == "stop"


def test_sampled_rows_with_top_k_top_p_and_logprobs_stay_valid(http: httpx.Client) -> None:
    """Sampling (not greedy) with truncation, and top logprobs that come from the masked distribution: every
    listed alternative is a token the grammar allowed at that point."""
    choice = chat(http, "Pick.", structured_outputs={"choice": CAPITALS}, temperature=1.0, top_k=50, top_p=0.9,
                  seed=3, logprobs=True, top_logprobs=5)
    assert choice["message"]["content"] in CAPITALS
    first = choice["logprobs"]["content"][0]
    assert any(c.startswith(first["token"]) for c in CAPITALS)
    allowed = [alt for alt in first["top_logprobs"] if alt["logprob"] > MIN_LOGPROB]
    assert allowed and all(any(c.startswith(alt["token"]) for c in CAPITALS) for alt in allowed), first
    assert abs(sum(math.exp(alt["logprob"]) for alt in allowed) - 1.0) < 0.05 or len(allowed) == 5


def test_max_tokens_mid_structure_ends_with_length(http: httpx.Client) -> None:
    choice = chat(http, "A city.", response_format={"type": "json_schema", "json_schema": {
        "name": "c", "schema": CITY_SCHEMA}}, max_tokens=3)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("{")


def test_guided_json_on_completions(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"prompt": "Order:", "max_tokens": 80, "temperature": 0,
                                               "guided_json": ORDER_SCHEMA})
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["choices"][0]["text"]), ORDER_SCHEMA)


def test_structured_outputs_json_on_completions_streamed(http: httpx.Client) -> None:
    text, finish = streamed_text(http, "/v1/completions", {"prompt": "Data:", "max_tokens": 80, "temperature": 0,
                                                           "structured_outputs": {"json": CITY_SCHEMA}})
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    assert finish == "stop"


def test_responses_api_text_format_json_schema(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="gemma-3-270m", input="A city as JSON.", max_output_tokens=80,
                                    temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                                                    "schema": CITY_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), CITY_SCHEMA)


# -- regex, choice, grammar ---------------------------------------------------------------------------------

def test_structured_outputs_regex(http: httpx.Client) -> None:
    choice = chat(http, "Give an IP address.", structured_outputs={"regex": IP_REGEX}, max_tokens=30)
    assert re.fullmatch(IP_REGEX, choice["message"]["content"])
    assert choice["finish_reason"] == "stop"


def test_structured_outputs_choice_sampled_and_streamed(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Best city?"}], "max_tokens": 10, "temperature": 1.2,
            "structured_outputs": {"choice": CAPITALS}}
    for seed in range(3):
        text, finish = streamed_text(http, "/v1/chat/completions", {**body, "seed": seed})
        assert text in CAPITALS and finish == "stop"


def test_guided_choice_and_regex_on_completions(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 5, "guided_choice": ["yes", "no"],
                                               "n": 2, "temperature": 1.0, "seed": 1})
    assert reply.status_code == 200, reply.text
    assert all(c["text"] in ("yes", "no") for c in reply.json()["choices"])
    reply = http.post("/v1/completions", json={"prompt": "Zip code:", "max_tokens": 10, "guided_regex": "[0-9]{5}"})
    assert re.fullmatch("[0-9]{5}", reply.json()["choices"][0]["text"])


@pytest.mark.parametrize("grammar", [EBNF, LARK], ids=["gbnf", "lark"])
def test_structured_outputs_grammar(http: httpx.Client, grammar: str) -> None:
    choice = chat(http, "Answer.", structured_outputs={"grammar": grammar}, max_tokens=20)
    text = choice["message"]["content"]
    assert re.fullmatch(r"The capital is (Paris|London|Rome)\.|answer: [0-9]{2}", text), text
    assert choice["finish_reason"] == "stop"


# -- /generate (SGLang's fields) -----------------------------------------------------------------------------

def test_generate_json_schema_as_text_and_object(http: httpx.Client) -> None:
    for schema in (CITY_SCHEMA, json.dumps(CITY_SCHEMA)):
        reply = http.post("/generate", json={"prompt": "City:", "max_tokens": 80, "temperature": 0,
                                             "json_schema": schema})
        assert reply.status_code == 200, reply.text
        jsonschema.validate(json.loads(reply.json()["text"]), CITY_SCHEMA)


def test_generate_regex_and_ebnf_streamed(http: httpx.Client) -> None:
    for field, value, pattern in (("regex", r"(Paris|London)", r"Paris|London"),
                                  ("ebnf", EBNF, r"The capital is (Paris|London|Rome)\.")):
        text = ""
        with http.stream("POST", "/generate", json={"prompt": "The capital of France:", "max_tokens": 20,
                                                    "temperature": 0.9, "seed": 2, "stream": True,
                                                    field: value}) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line.removeprefix("data: ")).get("text", "")
        assert re.fullmatch(pattern, text), (field, text)


# -- concurrency and errors ----------------------------------------------------------------------------------

def test_mixed_batch_keeps_each_rows_constraint(url: str) -> None:
    """Twelve concurrent requests with four different constraints and none share the batch: each output
    matches its own constraint only (a mask applied to the wrong row would break one of them)."""
    import concurrent.futures

    cases: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"choice": CAPITALS}}, lambda t: t in CAPITALS),
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY_SCHEMA}}},
         lambda t: jsonschema.validate(json.loads(t), CITY_SCHEMA) is None),
        ({"structured_outputs": {"grammar": LARK}}, lambda t: re.fullmatch("answer: [0-9]{2}", t)),
        ({}, lambda t: isinstance(t, str)),
    ] * 3

    def run(index: int) -> None:
        fields, valid = cases[index]
        with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:
            body = {"messages": [{"role": "user", "content": f"Question {index}."}], "max_tokens": 60,
                    "temperature": 0.8, "seed": index, **fields}
            reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["message"]["content"]
        assert valid(text), (fields, text)

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        for future in [pool.submit(run, i) for i in range(len(cases))]:
            future.result()


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
])
def test_invalid_constraints_are_openai_400s(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert http.get("/health").status_code == 200  # the engine is still serving


def test_invalid_constraint_on_generate_names_the_field(http: httpx.Client) -> None:
    reply = http.post("/generate", json={"prompt": "x", "regex": "(("})
    assert reply.status_code == 400
    assert "regex" in reply.text


def test_a_non_strict_schema_ignores_what_cannot_be_enforced(http: httpx.Client) -> None:
    schema = {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2, "uniqueItems": True}
    choice = chat(http, "Numbers.", response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema, "strict": False}})
    value = json.loads(choice["message"]["content"])
    assert isinstance(value, list) and len(value) <= 2 and set(value) <= {1, 2, 3}


STRUCTURAL_TAG: dict[str, Any] = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "end": "</function>",
     "schema": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": False}}]}
TAG_PROMPT = 'Weather in Rome: <function=get_weather>{"city": "ROM"}</function>\nWeather in Paris:'
"""The prompt's own example lacks ``days``: the base model copies it unless the structure is enforced."""


@pytest.mark.parametrize("stream", [False, True])
def test_structural_tag_enforces_each_triggered_structure(http: httpx.Client, stream: bool) -> None:
    body = {"prompt": TAG_PROMPT, "max_tokens": 40, "temperature": 0, "response_format": STRUCTURAL_TAG}
    if stream:
        text, _ = streamed_text(http, "/v1/completions", body)
    else:
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["text"]
    blocks = re.findall(r"<function=get_weather>(.*?)</function>", text, re.DOTALL)
    assert blocks, text  # the model writes the trigger (greedy on this prompt) ...
    for block in blocks:  # ... and every structure it starts holds
        jsonschema.validate(json.loads(block), STRUCTURAL_TAG["structures"][0]["schema"])
    assert text.count("<function=") - len(blocks) <= 1  # at most the last one cut by max_tokens
