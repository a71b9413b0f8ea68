"""The synchronous fault wrappers (``FAULTS``, see ``core/faults.py``): a KV allocator that sometimes acts
as if the pool were full, and a tokenizer that sometimes raises. Installed only when their fault is on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs

from inference_server.core.faults import FaultDecisions, InjectedFault
from inference_server.core.kv_grants import StepDemand, StepGrant
from inference_server.core.kv_manager import BlockTables, KVManager, SequenceId
from inference_server.core.validation import PromptTokenizer

AllocateStep = Callable[[KVManager, StepDemand], StepGrant]
"""The KV allocator's per-step decision (``core.kv_grants.allocate_step`` or a wrapper of it)."""


def refusing_allocator(allocate: AllocateStep, decisions: FaultDecisions) -> AllocateStep:
    """``allocate``, except that on the steps ``decisions`` picks (``alloc_refuse``) the pool counts as full.

    On such a step the releases are applied first (a full pool gets back what finished requests free), then
    ``allocate`` runs against a view in which no block that was available after the releases may be taken:
    a sequence may only grow within the blocks it holds or into blocks that preempting a victim frees in
    this same step, and no new request starts. That is what real KV pressure does, so the scheduler answers
    with its usual means: requests wait, running ones are preempted (recomputed later), none is lost.
    """

    def allocate_with_refusals(kv: KVManager, demand: StepDemand) -> StepGrant:
        if not decisions.fires("alloc_refuse"):
            return allocate(kv, demand)
        for request_id, computed in demand.releases:
            kv.release_sequence(request_id, computed)
        # The view offers exactly the calls allocate_step makes; it is not a KVManager subclass on purpose
        # (every other call would silently reach the real pools).
        return allocate(cast(KVManager, FullPoolView(kv)), attrs.evolve(demand, releases=()))

    return allocate_with_refusals


class FullPoolView:
    """``kv`` as seen on a refused step: only blocks freed after the view was made may be allocated."""

    def __init__(self, kv: KVManager) -> None:
        self._kv = kv
        self._baseline = kv.full_pool.num_available
        self.block_size = kv.block_size
        self.full_pool = kv.full_pool
        self.sliding_pool = kv.sliding_pool

    def can_append(self, seq_id: SequenceId, num_new_tokens: int) -> bool:
        kv = self._kv
        num_blocks = -(-(kv.num_tokens(seq_id) + num_new_tokens) // kv.block_size)
        new_blocks = num_blocks - len(kv.block_tables(seq_id).full)
        freed = kv.full_pool.num_available - self._baseline
        return new_blocks <= max(0, freed) and kv.can_append(seq_id, num_new_tokens)

    def append_slots(self, seq_id: SequenceId, num_new_tokens: int) -> None:
        self._kv.append_slots(seq_id, num_new_tokens)

    def append_in_block(self, seq_id: SequenceId) -> BlockTables | None:
        return self._kv.append_in_block(seq_id)  # takes no block, so a full pool changes nothing

    def start_sequence(self, seq_id: SequenceId, prompt: Sequence[int], extra_key: Any = None, *,
                       use_prefix_cache: bool = True) -> int:
        return self._kv.start_sequence(seq_id, prompt, extra_key, use_prefix_cache=use_prefix_cache)

    def release_sequence(self, seq_id: SequenceId, computed_tokens: Sequence[int] | None = None) -> None:
        self._kv.release_sequence(seq_id, computed_tokens)

    def num_tokens(self, seq_id: SequenceId) -> int:
        return self._kv.num_tokens(seq_id)

    def block_tables(self, seq_id: SequenceId) -> BlockTables:
        return self._kv.block_tables(seq_id)


class FaultyTokenizer:
    """A tokenizer whose ``encode`` / ``apply_chat_template`` raise ``InjectedFault`` for the requests
    ``decisions`` picks (``tokenizer_error``); everything else (decode, eos ids, ...) is the inner one's."""

    def __init__(self, inner: PromptTokenizer, decisions: FaultDecisions) -> None:
        self._inner = inner
        self._decisions = decisions

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._maybe_fail()
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        """The inner template's ids; ``template_kwargs`` (a request's ``tools``, ``chat_template_kwargs``)
        go on to it as admission passes them."""
        self._maybe_fail()
        return self._inner.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, **template_kwargs)

    def _maybe_fail(self) -> None:
        if self._decisions.fires("tokenizer_error"):
            raise InjectedFault(f"injected tokenizer_error (#{self._decisions.counts['tokenizer_error']})")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
