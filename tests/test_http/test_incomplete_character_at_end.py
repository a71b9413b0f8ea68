"""An output that ends inside a UTF-8 character (``max_tokens`` cut it, or EOS or a stop token id followed an
incomplete byte sequence) keeps those bytes as U+FFFD, exactly as ``tokenizer.decode(token_ids)`` writes them
and as ``/detokenize`` answers for the same ids: the incremental detokenizer holds an incomplete character
back while it waits for its next bytes, and when the output ends there is no next byte, so what it holds is
released (``IncrementalDetokenizer.flush``), never dropped. Streamed and whole, in one process and with a
separate engine process (where the front detokenizes)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from http_testkit import EOS_ID, FAKE_VOCAB_SIZE, byte_level_tokenizer_json, post_stream, serving, word_engine
from tokenizers import Tokenizer as BackendTokenizer

from inference_server.models.tokenizer import Tokenizer

PROMPT = [40, 41, 42]


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BackendTokenizer.from_str(byte_level_tokenizer_json(FAKE_VOCAB_SIZE)),
                     special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"}, eos_token_ids=frozenset({EOS_ID}),
                     chat_template=None, name="byte-level")


def byte_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The byte tokens of ``text`` (the byte-level vocabulary has one token per byte)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode()), ids
    return ids


def cases(tokenizer: Tokenizer) -> list[tuple[list[int], int | None, dict[str, Any], str]]:
    """(the tokens the model writes, EOS after them or not, request fields, the finish reason expected)."""
    cut = byte_ids(tokenizer, "ok \N{GRINNING FACE}")[:-2]  # "ok " and the emoji's first two of four bytes
    return [(cut, None, {"max_tokens": len(cut)}, "length"),
            (cut, EOS_ID, {"max_tokens": 20}, "stop"),
            (cut, 0, {"max_tokens": 20, "stop_token_ids": [0]}, "stop")]  # <pad>: a special token


def scripted(tokens: list[int], last: int | None) -> Any:
    script = {len(PROMPT) + i: token for i, token in enumerate([*tokens, *([] if last is None else [last])])}
    return word_engine(token_at_length=script)


@pytest.mark.parametrize("separate", [False, True], ids=["in-process", "separate"])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["length", "eos", "stop-token-id"])
async def test_an_incomplete_last_character_is_released_as_the_decode_writes_it(byte_tokenizer: Tokenizer,
                                                                                  separate: bool, case: int) -> None:
    tokens, last, fields, finish = cases(byte_tokenizer)[case]
    expected = byte_tokenizer.decode(tokens)
    assert expected.startswith("ok ") and expected.endswith("\N{REPLACEMENT CHARACTER}"), expected
    async with serving(scripted(tokens, last), byte_tokenizer, separate=separate) as served:
        with trio.fail_after(60):
            response = await served.client.post("/generate", json={"prompt_token_ids": PROMPT, **fields})
            whole = await response.get_json()
            assert response.status_code == 200, whole
            assert (whole["text"], whole["finish_reason"]) == (expected, finish), whole
            response = await served.client.post("/v1/completions", json={"prompt": PROMPT, **fields})
            body = await response.get_json()
            assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (expected, finish), body
            streamed = await post_stream(served.client, "/v1/completions",
                                         {"prompt": PROMPT, "stream": True, **fields})
        chunks = [event for event in streamed.events if event != "[DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected, chunks
        assert chunks[-1]["choices"][0]["finish_reason"] == finish
