"""Chat logprobs ``bytes`` are each token's own bytes (OpenAI's contract: "useful when characters are represented
by multiple tokens and their byte representations must be combined"): a character the model wrote as byte
tokens is those entries' ``bytes`` joined, while each entry's ``token`` alone reads U+FFFD (whose UTF-8,
``[239, 191, 189]``, the entries used to carry instead). ``return_tokens_as_token_ids`` keeps the bytes of the
``token_id:N`` name."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from http_testkit import CHAT_TEMPLATE, EOS_ID, FAKE_VOCAB_SIZE, byte_level_tokenizer_json, post_stream, word_engine
from tokenizers import Tokenizer as BackendTokenizer

from inference_server.models.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
REPLY = "ok \N{GRINNING FACE}"


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BackendTokenizer.from_str(byte_level_tokenizer_json(FAKE_VOCAB_SIZE)),
                     special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"}, eos_token_ids=frozenset({EOS_ID}),
                     chat_template=CHAT_TEMPLATE, name="byte-level")


def scripted(tokenizer: Tokenizer) -> Any:
    """The model answers ``REPLY`` byte by byte, then EOS."""
    start = len(tokenizer.apply_chat_template(MESSAGES))
    reply = tokenizer.encode(REPLY, add_special_tokens=False)
    assert len(reply) == len(REPLY.encode())
    return word_engine(token_at_length={start + i: t for i, t in enumerate([*reply, EOS_ID])})


async def test_chat_logprob_bytes_join_to_the_reply(serve, byte_tokenizer: Tokenizer) -> None:
    async with serve(scripted(byte_tokenizer), tokenizer=byte_tokenizer) as served:
        body = {"messages": MESSAGES, "max_tokens": 20, "logprobs": True, "top_logprobs": 1}
        with trio.fail_after(60):
            response = await served.client.post("/v1/chat/completions", json=body)
            whole = await response.get_json()
            streamed = await post_stream(served.client, "/v1/chat/completions", {**body, "stream": True})
            response = await served.client.post("/v1/chat/completions",
                                                json={**body, "return_tokens_as_token_ids": True})
            as_ids = await response.get_json()
        assert response.status_code == 200, as_ids
        [choice] = whole["choices"]
        assert choice["message"]["content"] == REPLY
        entries = choice["logprobs"]["content"]
        assert "\N{REPLACEMENT CHARACTER}" in [e["token"] for e in entries]  # the emoji's bytes, one per token
        assert b"".join(bytes(e["bytes"]) for e in entries[:-1]) == REPLY.encode()
        assert (entries[-1]["token"], bytes(entries[-1]["bytes"])) == ("<eos>", b"<eos>")  # EOS: its text
        # The alternatives are byte tokens too: none of them is given U+FFFD's bytes either.
        assert all(bytes(top["bytes"]) != "\ufffd".encode() for e in entries for top in e["top_logprobs"])
        chunks = [e for e in streamed.events if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]]
        streamed_entries = [entry for c in chunks for entry in c["choices"][0]["logprobs"]["content"]]
        assert streamed_entries == entries
        for entry in as_ids["choices"][0]["logprobs"]["content"]:
            assert entry["token"].startswith("token_id:") and bytes(entry["bytes"]) == entry["token"].encode()
