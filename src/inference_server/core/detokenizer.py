"""Incremental detokenisation: turn a stream of token ids into a stream of complete text pieces.

Technique (after vLLM's ``prefix_offset``/``read_offset``): decoding single tokens is wrong for
SentencePiece (a leading ``▁`` becomes a space, or is stripped, depending on position) and for byte
tokens (``<0xE2>``, byte-level BPE pieces) that carry part of a UTF-8 character. So each step decodes a
short window of ids, ``ids[prefix:]``, and emits what it adds beyond ``text(ids[prefix:read])``, the
window's already-emitted part. Both decodes start at the same token, so position effects cancel out.
While the window's text ends in U+FFFD (an incomplete character), nothing is emitted and the window
grows. Once text is emitted, the window slides forward: ``prefix, read = read, len(ids)``.

The initial window holds the last few prompt ids (``context_tokens``). It is moved back by up to 3 ids
if it would otherwise start inside a character split over byte tokens. Byte fallback turns a whole run
of byte tokens into U+FFFD once any byte in it is invalid, so a run cut in the middle would hide the
first output token's bytes.

Per-token cost is one backend decode of a window of a few tokens, plus one more decode each time the
window slides. Ids from before ``prefix`` are dropped, so memory stays constant.

Fast path: a tokenizer that offers ``token_piece`` (``PieceDecoder``: the text an ordinary token appends to
any decode, for decoders that join per-token texts) lets most tokens skip both decodes. When the window is
all emitted and every id in it has a piece, ``decode(window + [t])`` is ``emitted_text + piece(t)``, and
after the slide the window is ``[t]`` with ``piece(t)`` as its text; so a token with a non-empty piece that
does not end in U+FFFD is emitted as its piece, leaving exactly the state the decodes would have left.
Anything else (byte tokens, special tokens, an empty piece, a window still holding back text) takes the
decode path above.

Contract: given ids whose bytes form valid UTF-8 (anything ``encode`` produces, and normal model
output), the emitted pieces are always whole characters. With no prompt, they concatenate (``flush()``
included) to ``decode(ids)``. With a prompt, they concatenate to ``decode(prompt + ids)`` minus its
``decode(prompt)`` prefix. That is the same string unless the decoder strips a leading space (Llama-style
SentencePiece), where the prompt-relative form keeps the space the output really continues with.

Limitation: ``flush()`` releases a held-back incomplete character at the end as U+FFFD, as ``decode``
does. Byte tokens that are invalid in the middle of the output may render differently from one full
decode, because SentencePiece byte fallback replaces a whole run of byte tokens once any byte in it is
invalid. vLLM has the same limitation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["IncrementalDetokenizer", "PieceDecoder", "TokenDecoder"]

REPLACEMENT_CHARACTER = "\ufffd"
_MAX_CONTINUATION_BYTES = 3


class TokenDecoder(Protocol):
    """What the detokenizer needs: ``inference_server.models.tokenizer.Tokenizer`` satisfies it."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@runtime_checkable
class PieceDecoder(TokenDecoder, Protocol):
    """A decoder that also knows each ordinary token's own text (``Tokenizer.token_piece`` states the
    contract: ``decode(ids + [t]) == decode(ids) + token_piece(t)`` when every id has a piece)."""

    def token_piece(self, token_id: int) -> str | None: ...


class IncrementalDetokenizer:
    """Per-request incremental decoder; not thread-safe (one owner feeds it tokens in order)."""

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        context_tokens: int = 5,
    ) -> None:
        """``prompt_ids``: the tokens the output continues (only the last ``context_tokens`` are used),
        so that the first output token decodes as it does in context (e.g. its leading space)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._piece = tokenizer.token_piece if isinstance(tokenizer, PieceDecoder) else None
        self._window: list[int] = self._prompt_context(prompt_ids, context_tokens)
        self._read = len(self._window)  # window[:read] is already emitted (or prompt)
        self._emitted_text = self._decode(self._window)
        self._window_has_pieces = self._has_pieces(self._window)  # every id in the window has a piece

    def add_token(self, token_id: int) -> str:
        """Append one id; return the newly completed text (``""`` while a character is incomplete)."""
        if self._piece is not None:
            piece = self._piece(token_id)
            if piece is None:
                self._window_has_pieces = False
            elif self._window_has_pieces and self._read == len(self._window) and piece \
                    and not piece.endswith(REPLACEMENT_CHARACTER):
                # decode(window + [t]) == emitted_text + piece: emit it and slide to [t] without decoding.
                self._window.clear()
                self._window.append(token_id)
                self._read = 1
                self._emitted_text = piece
                return piece
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= len(self._emitted_text) or text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._emit(text)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append several ids; return the text they complete (same result as adding them one by one)."""
        return "".join(self.add_token(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Release held-back text at the end of generation (may end in U+FFFD, as ``decode`` would)."""
        text = self._decode(self._window)
        if len(text) <= len(self._emitted_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        """Return ``text`` beyond the emitted part and slide the window to the tokens just emitted."""
        new_text = text[len(self._emitted_text) :]
        del self._window[: self._read]
        self._read = len(self._window)
        self._emitted_text = self._decode(self._window)
        self._window_has_pieces = self._has_pieces(self._window)
        return new_text

    def _has_pieces(self, ids: Sequence[int]) -> bool:
        piece = self._piece
        return piece is not None and all(piece(i) is not None for i in ids)

    def _prompt_context(self, prompt_ids: Sequence[int], context_tokens: int) -> list[int]:
        """The last ``context_tokens`` prompt ids, extended back by up to 3 ids (a UTF-8 character has at
        most 4 bytes) while the window would start inside a character split over byte tokens."""
        if context_tokens <= 0:
            return []
        start = max(len(prompt_ids) - context_tokens, 0)
        for _ in range(_MAX_CONTINUATION_BYTES):
            if start == 0 or not self._decode(prompt_ids[start:]).startswith(REPLACEMENT_CHARACTER):
                break
            start -= 1
        return list(prompt_ids[start:])

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
