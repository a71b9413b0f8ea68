"""vLLM's ``bad_words`` as token sequences: what admission gives the sampler (``SamplingParams.bad_words_token_ids``).

vLLM's rule (``SamplingParams.update_from_tokenizer``): each word is encoded without special tokens as written
(leading whitespace stripped), and again after a space, because most tokenizers spell a word differently at
the start of the text and after a space; the spaced spelling is kept only when it is as many tokens as the
plain one and starts with another token (otherwise it adds nothing, or would ban a longer, different
sequence's prefix). The sampler bans each sequence's last token wherever the output ends with the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from inference_server.records.errors import RequestError


class WordEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def bad_words_token_ids(words: Sequence[str], tokenizer: WordEncoder | None) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell ``words`` (see the module docstring); a ``RequestError`` naming
    ``bad_words`` without a tokenizer or for a word that encodes to no token."""
    if not words:
        return ()
    if tokenizer is None:
        raise RequestError("invalid_request", "bad_words needs the model's tokenizer, which this engine was "
                           "started without", "bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise RequestError("invalid_request", f"bad_words: {word[:40]!r} encodes to no token", "bad_words")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(dict.fromkeys(sequences))
