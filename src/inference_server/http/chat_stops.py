"""The stop conditions every chat request gets: the served chat template's turn markers.

A chat reply ends where the template would start or end a turn (``<end_of_turn>``, ``<start_of_turn>`` for
Gemma). Each marker is added twice: as a stop string (a model that spells the marker out in pieces) and, when
it is one token, as a stop token id (the detokenizer hides special tokens, so a string match alone would
miss a marker emitted as its own token). Neither shows in the reply unless ``include_stop_str_in_output``.
Ids that already end generation (the model's EOS ids) are not repeated, so such a finish still reports
``stop_reason: null``. A request with ``ignore_eos`` (benchmarks fixing the output length) gets none.
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_server.models.chat_templates import turn_markers
from inference_server.records.sampling_params import SamplingParams


@attrs.frozen
class ChatStops:
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer: Any | None, eos_token_ids: frozenset[int]) -> ChatStops:
        """The markers of ``tokenizer``'s chat template (none without a tokenizer or a template)."""
        token_to_id = getattr(tokenizer, "token_to_id", None)
        if tokenizer is None or token_to_id is None:
            return cls()
        markers = turn_markers(getattr(tokenizer, "chat_template", None), token_to_id,
                               [getattr(tokenizer, "eos_token", None)])
        ids = [token_to_id(m) for m in markers]
        return cls(markers, tuple(i for i in dict.fromkeys(ids) if i is not None and i not in eos_token_ids))

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the markers added to its own stops (unless it ignores EOS)."""
        if params.ignore_eos or not (self.strings or self.token_ids):
            return params
        stop = params.stop + tuple(s for s in self.strings if s not in params.stop)
        stop_ids = params.stop_token_ids + tuple(i for i in self.token_ids if i not in params.stop_token_ids)
        return attrs.evolve(params, stop=stop, stop_token_ids=stop_ids)
