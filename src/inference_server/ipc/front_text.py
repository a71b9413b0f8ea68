"""``RequestText``: one request's detokenisation and stop strings in the front process (docs/ipc.md, decision 1).

With a separate engine process the engine runs each request's ``StopChecker`` without stop strings and no
detokenizer: its updates carry token ids (with logprobs) and empty text, and end only for token-level reasons
(EOS, stop token ids, ``max_tokens``) or the engine's own (abort, error, timeout). The front runs, per request,
the ``IncrementalDetokenizer`` and a ``StopChecker`` with the strings and rewrites each update as the in-process
scheduler would have built it: the same text (held back while it may start a stop string), the same finish.

The front's checker has the engine's EOS ids, stop token ids, ``min_tokens`` and ``ignore_eos`` (so both agree on
every token-level finish, token by token) but no length bound (the engine resolves ``max_tokens`` against the
model's limits; its ``length`` finish releases what was held back, as the checker's own would). When the
front's checker ends the request on a token the engine did not end it on (a stop string), :meth:`apply` builds
the terminal update here and says so: the caller delivers it, asks the engine to stop the request, and drops the
engine's later updates for it.

Pure Python: no trio (``tests/test_layering.py``).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Collection

from inference_server.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from inference_server.core.stop_checker import StopChecker, ends_after_last_token
from inference_server.ipc.messages import Tokens
from inference_server.records.requests import RequestUpdate, TokenOutput
from inference_server.records.sampling_params import SamplingParams

_NO_TOPS = itertools.repeat(())
"""Each token's top logprobs when the update has none (``zip`` stops at the ids)."""


class RequestText:
    """See the module docstring: built once the request's admission (its prompt ids) reached the front."""

    __slots__ = ("cached_prompt_tokens", "checker", "detokenizer", "prompt_tokens")

    def __init__(self, params: SamplingParams, prompt_ids: tuple[int, ...], tokenizer: TokenDecoder | None,
                 eos_token_ids: Collection[int]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids,
                                                  skip_special_tokens=params.skip_special_tokens) \
            if tokenizer is not None else None
        self.checker = StopChecker.from_params(params, eos_token_ids, max_tokens=sys.maxsize)
        self.prompt_tokens = len(prompt_ids)
        self.cached_prompt_tokens = 0

    def _release_held_character(self, tokens: list[TokenOutput]) -> None:
        """The output ended after ``tokens[-1]``: add to its text the incomplete character the detokenizer holds
        back (as U+FFFD, as ``decode`` writes it; ``stop_checker.ends_after_last_token``)."""
        if self.detokenizer is not None:
            last = tokens[-1]
            tokens[-1] = TokenOutput(last.token_id, last.text + self.detokenizer.flush(), last.logprob,
                                     last.top_logprobs)

    def apply(self, update: Tokens) -> tuple[RequestUpdate, bool]:
        """The engine's ``update`` (ids, no text) as a ``RequestUpdate`` with its text; True when this process
        ended the request (a stop string, the update returned is its terminal one and the engine has not ended
        it)."""
        if update.cached_prompt_tokens and not update.finished:  # the engine sends it with the first update
            self.cached_prompt_tokens = update.cached_prompt_tokens
        detokenizer, checker = self.detokenizer, self.checker
        token_ids = update.token_ids
        tops = update.top_logprobs or _NO_TOPS
        tokens: list[TokenOutput] = []
        for token_id, logprob, top in zip(token_ids, update.logprobs, tops, strict=False):  # tops may be endless
            stop = checker.update(token_id, detokenizer.add_token(token_id) if detokenizer is not None else "")
            tokens.append(TokenOutput(token_id, stop.text, logprob, top))
            if stop.finish_reason is not None:
                if len(tokens) == len(token_ids) and update.finish_reason == stop.finish_reason:
                    if ends_after_last_token(stop):  # nothing more will complete a held character
                        self._release_held_character(tokens)
                    break  # the engine ended it on this same token (EOS, a stop token id): its terminal stands
                return RequestUpdate(
                    update.request_id, tuple(tokens), stop.finish_reason, stop.stop_reason, stop.error,
                    prompt_tokens=self.prompt_tokens, completion_tokens=checker.num_tokens,
                    cached_prompt_tokens=self.cached_prompt_tokens, prompt_logprobs=update.prompt_logprobs,
                ), update.finish_reason is None
        if update.finish_reason == "length" and tokens and not checker.finished:
            last = tokens[-1]  # the budget ran out: what was held back is released, as the checker's own length does
            tokens[-1] = TokenOutput(last.token_id, last.text + checker.flush(), last.logprob, last.top_logprobs)
            self._release_held_character(tokens)
        if update.finished:
            return update.update(tuple(tokens)), False
        # the cached count rode on the first update for this process only: the client's running updates carry 0
        return update.update(tuple(tokens), cached_prompt_tokens=0), False
