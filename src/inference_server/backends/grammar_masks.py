"""Constrained rows' token bitmasks: filled on the host by llguidance, copied to the device for the sampler.

A ``GrammarState`` is one request's decoding state (an llguidance matcher) and how many of its output
tokens the matcher has consumed; ``advance`` feeds it the rest. ``BitmaskFiller.fill`` writes one step's
masks, ``[N, ceil(V / 32)]`` int32 (bit ``i % 32`` of word ``i // 32`` set: token ``i`` allowed), into a
pinned host buffer, all constrained rows at once in llguidance's worker threads (the GIL released), every
other row all ones, and returns the device copy (``non_blocking``: the host does not wait for it).

Two pinned buffers alternate: the copy of one step's masks may still be queued on the stream while the next
step's are written (the runner has waited for the previous step's tokens by then, so for the copy before it).

A matcher that ever refuses a token (only a bug or a logit edit that emptied a row can cause it) allows EOS
alone from then on, so the request ends instead of producing output the constraint does not allow.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import attrs
import llguidance
import numpy as np
import torch

from inference_server.core.grammar_compiler import CompiledGrammar

log = logging.getLogger(__name__)


@attrs.define
class GrammarState:
    """One constrained request's matcher and how many output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    consumed: int = 0
    broken: bool = False  # a token was refused: the matcher no longer follows the output (EOS only from now)

    @property
    def ends_only(self) -> bool:
        """Whether the row may only end (EOS): its matcher refused a token or is in llguidance's error state."""
        return self.broken or self.matcher.is_error()

    @classmethod
    def start(cls, compiled: CompiledGrammar) -> GrammarState:
        return cls(compiled.matcher())

    def advance(self, output_ids: Sequence[int]) -> None:
        """Consume ``output_ids[consumed:]`` (a request's output so far). A stopped matcher (its grammar
        complete) consumes nothing more: what follows is the EOS that ends the request, or a token that
        overlap computed past its end and the scheduler discards."""
        new = output_ids[self.consumed:]
        self.consumed = len(output_ids)
        if not new or self.broken or self.matcher.is_error() or self.matcher.is_stopped():
            return
        accepted = self.matcher.try_consume_tokens(list(new))
        if accepted < len(new) and not self.matcher.is_stopped():
            self.broken = True
            log.warning("a constrained request's token was refused by its grammar: %s",
                        self.matcher.get_error()[:200] or self.matcher.stop_reason())


class BitmaskFiller:
    """Fills one step's bitmask rows (see the module docstring). One per runner; not thread-safe."""

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int], device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        self._executor = llguidance.LLExecutor()
        eos_only = np.zeros(self.words, dtype=np.uint32)
        for token in eos_token_ids:
            eos_only[token // 32] |= np.uint32(1 << (token % 32))
        self._eos_only = torch.from_numpy(eos_only.view(np.int32))

    def _buffer(self, rows: int) -> torch.Tensor:
        if not self._buffers or self._buffers[0].shape[0] < rows:
            size = max(rows, 64)
            self._buffers = [torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._pinned)
                             for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn][:rows]

    def fill(self, rows: int, constrained: Sequence[tuple[GrammarState, int]]) -> torch.Tensor:
        """The ``[rows, words]`` masks on the device: ``constrained`` (state, row) pairs from their matchers
        (each already advanced), every other row all ones."""
        host = self._buffer(rows)
        host.fill_(-1)
        live = [(state.matcher, row) for state, row in constrained if not state.ends_only]
        for state, row in constrained:
            if state.ends_only:
                host[row].copy_(self._eos_only)
        if live:
            self._executor.unsafe_compute_mask_ptr(live, host.data_ptr(), self.words * 4, rows)
        if self._pinned:
            return host.to(self.device, non_blocking=True)
        return host.clone()
