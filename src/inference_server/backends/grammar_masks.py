"""Constrained rows' token bitmasks: filled on the host by llguidance, copied to the device for the sampler.

A ``GrammarState`` is one request's decoding state (an llguidance matcher) and how many of its output
tokens the matcher has consumed. ``BitmaskFiller.advance`` feeds every constrained row its new tokens;
``BitmaskFiller.fill`` writes one step's masks for the constrained rows only, ``[K, ceil(V / 32)]`` int32 (bit
``i % 32`` of word ``i // 32`` set: token ``i`` allowed), into a pinned host buffer, all rows at once in
llguidance's worker threads (the GIL released), and returns their device copy with the batch row of each
(``non_blocking``: the host does not wait for it). Unconstrained rows have no mask at all: the sampler does not
touch them.

Two pinned buffers alternate: the copy of one step's masks may still be queued on the stream while the next
step's are written (the runner has waited for the previous step's tokens by then, so for the copy before it).
On a CPU device the buffers are the masks themselves, read by the step's sampling before their next turn.

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

    @property
    def stopped(self) -> bool:
        """Whether the matcher consumes nothing more: refused, in error, or its grammar complete (what follows
        is the EOS that ends the request, or a token that overlap computed past its end and the scheduler
        discards)."""
        return self.broken or self.matcher.is_error() or self.matcher.is_stopped()

    @classmethod
    def start(cls, compiled: CompiledGrammar) -> GrammarState:
        return cls(compiled.matcher())

    def advance(self, output_ids: Sequence[int]) -> None:
        """Consume ``output_ids[consumed:]`` (a request's output so far), one row alone."""
        self.consume(output_ids[self.consumed:])

    def consume(self, new: Sequence[int]) -> None:
        """Consume ``new``, the tokens output after the ``consumed`` ones (nothing when ``stopped``)."""
        self.consumed += len(new)
        if not new or self.stopped:
            return
        accepted = self.matcher.try_consume_tokens(list(new))
        if accepted < len(new) and not self.matcher.is_stopped():
            self.broken = True
            log.warning("a constrained request's token was refused by its grammar: %s",
                        self.matcher.get_error()[:200] or self.matcher.stop_reason())


class BitmaskFiller:
    """Advances the constrained rows and fills their bitmasks (see the module docstring). One per runner; not
    thread-safe (one thread at a time)."""

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int], device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._turn = 0
        self._executor = llguidance.LLExecutor()
        eos_only = np.zeros(self.words, dtype=np.uint32)
        for token in eos_token_ids:
            eos_only[token // 32] |= np.uint32(1 << (token % 32))
        self._eos_only = torch.from_numpy(eos_only.view(np.int32))

    def _buffer(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next pinned (masks ``[count, words]`` int32, rows ``[count]`` int64) pair of host buffers."""
        if not self._buffers or self._buffers[0][1].shape[0] < count:
            size = max(count, 64)
            self._buffers = [(torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._pinned),
                              torch.empty(size, dtype=torch.int64, pin_memory=self._pinned)) for _ in range(2)]
        self._turn ^= 1
        bits, rows = self._buffers[self._turn]
        return bits[:count], rows[:count]

    def advance(self, updates: Sequence[tuple[GrammarState, Sequence[int]]]) -> None:
        """Feed each state its new output tokens (``GrammarState.consume``), one row after the other: a few µs a
        token in this thread, where waking llguidance's workers (``consume_token_par``) cost more wall time than it
        saved on a loaded host (figures in the commit that chose this)."""
        for state, new in updates:
            state.consume(new)

    def fill(self, constrained: Sequence[tuple[GrammarState, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks of ``constrained`` (state, batch row) pairs (each state already advanced) on the device:
        ``(masks [K, words] int32, rows [K] int64)``, in the order given."""
        bits, rows = self._buffer(len(constrained))
        rows.numpy()[:] = [row for _, row in constrained]
        live = []
        for k, (state, _) in enumerate(constrained):
            if state.ends_only:
                bits[k].copy_(self._eos_only)
            else:
                live.append((state.matcher, k))
        if live:
            self._executor.unsafe_compute_mask_ptr(live, bits.data_ptr(), self.words * 4, len(constrained))
        if self._pinned:
            return bits.to(self.device, non_blocking=True), rows.to(self.device, non_blocking=True)
        return bits, rows  # the host's own: read by this step's sampling before the buffer's next turn
