"""Display strings of single token ids, for logprobs (``tokens``, ``top_logprobs`` keys, chat ``token``).

A token's string is the tokenizer's decode of that one id (special tokens included), cached per id. Without
a tokenizer (dummy presets) it is ``token_id:<id>``, vLLM's spelling for ids returned as tokens.
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

    def __call__(self, token_id: int) -> str:
        return self.text(token_id)


def _id_text(token_id: int) -> str:
    return f"token_id:{token_id}"
