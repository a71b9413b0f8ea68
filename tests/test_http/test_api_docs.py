"""Docs that cannot drift: every request/response example of docs/api.md (see ``doc_examples`` for the
convention) is sent to a live server (the fake-step engine with the word tokenizer, on a real socket, under
the embedded model's name) and its response compared with the documented one, structurally."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from doc_examples import Example, curl_count, examples, parse_events, shape
from http_testkit import SocketServer, serving_on_socket, write_tokenizer_folder

from inference_server.config import Settings
from inference_server.models.tokenizer import Tokenizer

API_DOC = Path(__file__).parents[2] / "docs" / "api.md"
DOC_MODEL_NAME = "gemma-3-270m"
EXAMPLES = examples(API_DOC.read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tokenizer = Tokenizer.from_pretrained_dir(write_tokenizer_folder(tmp_path_factory.mktemp("doc-tokenizer")))
    # The server's default stream interval, with a hold bound no hiccup of a busy machine reaches: the
    # documented streams group tokens as a real server does, deterministically.
    with serving_on_socket(tokenizer=tokenizer, model_name=DOC_MODEL_NAME, default_max_tokens=1024,
                           stream_interval=Settings().stream_interval, stream_interval_ms=60_000.0) as served:
        yield served


def test_every_curl_in_the_doc_is_an_executed_example() -> None:
    assert len(EXAMPLES) >= 15
    assert curl_count(API_DOC.read_text()) == len(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.name)
def test_documented_example_matches_the_server(server: SocketServer, example: Example) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.request(example.method, example.path, headers=example.headers, json=example.body)
    assert reply.status_code == example.status, reply.text
    actual = parse_events(reply.text) if example.stream else reply.json()
    assert shape(actual, example.maps) == shape(example.response, example.maps)


def test_the_comparison_sees_drift() -> None:
    """The structure tells a renamed key, a changed type, a changed constant and a missing event apart, and
    ignores values and the number of repeated chunks."""
    documented = {"id": "x", "choices": [{"text": "a", "finish_reason": "length"}], "usage": {"n": 1}}
    assert shape(documented) == shape({"id": "y", "choices": [{"text": "bcd", "finish_reason": "length"}],
                                       "usage": {"n": 7}})
    assert shape(documented) != shape({**documented, "usage": {"count": 1}})
    assert shape(documented) != shape({**documented, "id": 3})
    assert shape(documented) != shape({**documented, "choices": [{"text": "a", "finish_reason": "stop"}]})
    chunk, last = {"delta": "a", "finish_reason": None}, {"delta": "b", "finish_reason": "length"}
    assert shape([chunk, chunk, last, "[DONE]"]) == shape([chunk, last, "[DONE]"])
    assert shape([chunk, last, "[DONE]"]) != shape([chunk, "[DONE]"])
    maps = frozenset({"top_logprobs"})
    assert shape({"top_logprobs": [{" the": -1.5}]}, maps) == shape({"top_logprobs": [{"w7": -0.25}]}, maps)
