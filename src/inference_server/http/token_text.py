"""Display strings of single token ids, for logprobs (``tokens``, ``top_logprobs`` keys, chat ``token``), and
their bytes (chat's ``bytes``).

A token's string is the tokenizer's decode of that one id (special tokens included), cached per id. Without
a tokenizer (dummy presets) it is ``token_id:<id>``, vLLM's spelling for ids returned as tokens. A token's
bytes are the tokenizer's ``token_bytes`` (a byte token's own byte, where its string is U+FFFD), else the
UTF-8 of its string.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

CACHE_SIZE = 65536


class TokenText:
    def __init__(self, tokenizer: Any | None) -> None:
        decode = getattr(tokenizer, "decode", None)
        if decode is None:
            self.text = _id_text
        else:
            @lru_cache(maxsize=CACHE_SIZE)
            def text(token_id: int) -> str:
                return decode([token_id], skip_special_tokens=False)

            self.text = text
        token_bytes = getattr(tokenizer, "token_bytes", None)
        if token_bytes is None:
            self.bytes = self._text_bytes
        else:
            @lru_cache(maxsize=CACHE_SIZE)
            def bytes_of(token_id: int) -> list[int]:
                return list(token_bytes(token_id))

            self.bytes = bytes_of

    def __call__(self, token_id: int) -> str:
        return self.text(token_id)

    def _text_bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode("utf-8", "replace"))


def _id_text(token_id: int) -> str:
    return f"token_id:{token_id}"
