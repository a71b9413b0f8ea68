"""Routing keys read from request bodies as the single server reads them: token ids or text (tokenised),
chat messages through the template, the first of several prompts, the session from the body or the
``X-Session-Id`` header, the cache salt in the hashes; anything unreadable gives an empty key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from control_plane.routing_key import routing_key
from inference_server.core.block_hashes import chain_hashes

BS = 2


class WordTokenizer:
    """One id per character (enough to see what was tokenised)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return [2] + [ord(c) for m in messages for c in f"{m['role']}:{m['content']};"]


TOKENIZER = WordTokenizer()


def test_token_ids_text_and_chat() -> None:
    ids = [5, 6, 7, 8, 9]
    assert routing_key("/generate", {"prompt_token_ids": ids, "session_id": "s"}, None, None, BS).block_hashes \
        == tuple(chain_hashes(ids, BS))
    text = routing_key("/v1/completions", {"prompt": "abcd", "user": "u"}, None, TOKENIZER, BS)
    assert text.block_hashes == tuple(chain_hashes(TOKENIZER.encode("abcd"), BS)) and text.session_id == "u"
    several = routing_key("/v1/completions", {"prompt": [[5, 6, 7], [1, 1]]}, None, None, BS)
    assert several.block_hashes == tuple(chain_hashes([5, 6, 7], BS))
    chat = routing_key("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]}, "header", TOKENIZER, BS)
    assert chat.block_hashes == tuple(chain_hashes(TOKENIZER.apply_chat_template(
        [{"role": "user", "content": "hi"}]), BS)) and chat.session_id == "header"
    salted = routing_key("/generate", {"prompt_token_ids": ids, "cache_salt": "t"}, None, None, BS)
    assert salted.block_hashes == tuple(chain_hashes(ids, BS, "t")) != tuple(chain_hashes(ids, BS))


def test_what_cannot_be_read_routes_by_load() -> None:
    assert routing_key("/generate", {"prompt": "text"}, None, None, BS).block_hashes == ()  # no tokenizer
    assert routing_key("/v1/chat/completions", {"messages": "nonsense"}, None, TOKENIZER, BS).block_hashes == ()
    assert routing_key("/v1/completions", [1, 2], "s", TOKENIZER, BS).session_id == "s"
    assert routing_key("/v1/completions", {"prompt": [1, 2, 3]}, None, None, None).block_hashes == ()
