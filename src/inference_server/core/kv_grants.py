"""The KV allocator's side of a step: one batched demand in, one grant out.

The scheduler never touches blocks. Each step it sends a ``StepDemand``: sequences to release, then what
each request wants this step (running decodes, prefills in progress, new admissions in policy order), and
the order in which running requests may be preempted. ``allocate_step`` answers with a ``StepGrant``:
exactly which tokens each granted request computes and its block tables, and which requests were preempted.
Because "can I allocate" and "allocate" happen inside one call on the allocator's own state, the decision
is atomic. The token budget and sequence cap are applied here because granting a new request depends on its
prefix-cache hit, which only the allocator knows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from inference_server.core.kv_manager import KVManager
from inference_server.records.hot_record import hot_record


@attrs.frozen
class Demand:
    """What one request wants this step.

    ``running``: it holds a KV sequence already and wants ``num_tokens`` more slots (1 for a decode; up to
    ``num_tokens`` for a prefill in progress, cut to the budget unless ``whole``). ``new``: start a sequence
    for ``tokens`` (prompt, plus generated tokens when it is recomputed), share its cached prefix, and grant
    the rest (cut to the budget unless ``whole``).
    """

    request_id: int
    new: bool
    num_tokens: int
    tokens: tuple[int, ...] = ()
    extra_key: Any = None
    whole: bool = False
    use_prefix_cache: bool = True  # False: compute from position 0 (the request needs every prompt logit)


@attrs.frozen
class StepDemand:
    releases: tuple[tuple[int, tuple[int, ...] | None], ...]  # (request id, computed tokens to cache or None)
    items: tuple[Demand, ...]  # in service order: decodes, prefills in progress, then new requests
    victims: tuple[int, ...] | Callable[[], Sequence[int]]
    """Running request ids, the first to preempt first; or a function that returns them, called only when
    the allocator must preempt (most steps do not, and ordering every running request costs time)."""
    token_budget: int
    max_sequences: int
    max_new: int | None = None  # at most this many new requests this step (monolithic prefill: 1)


@hot_record
class Grant:
    request_id: int
    start: int  # first position computed this step (the prefix-cache hit for a new request)
    num_tokens: int
    block_tables: tuple[tuple[int, ...], ...]  # one per block group (full, then sliding)


@attrs.frozen
class StepGrant:
    grants: tuple[Grant, ...]
    preempted: tuple[int, ...]
    free_fraction: float = 1.0  # share of full-group blocks available after the grant
    sliding_free_fraction: float | None = None  # the same for the sliding-window group (None: no such group)


def allocate_step(kv: KVManager, demand: StepDemand) -> StepGrant:
    """Apply ``demand`` to ``kv`` and return what was granted (see the module docstring)."""
    for request_id, computed in demand.releases:
        kv.release_sequence(request_id, computed)
    state = _Allocation(kv, demand)
    for item in demand.items:
        if len(state.grants) >= demand.max_sequences:
            break
        if item.new:
            if not state.admit(item):
                break  # head-of-line: later new requests wait too, so admission order holds
        else:
            state.extend(item)
    pool, sliding = kv.full_pool, kv.sliding_pool
    sliding_free = None if sliding is None else sliding.num_available / max(1, sliding.num_blocks)
    return StepGrant(grants=tuple(state.grants.values()), preempted=tuple(state.preempted),
                     free_fraction=pool.num_available / max(1, pool.num_blocks), sliding_free_fraction=sliding_free)


class _Allocation:
    def __init__(self, kv: KVManager, demand: StepDemand) -> None:
        self.kv = kv
        self.demand = demand
        self.budget = demand.token_budget
        self.grants: dict[int, Grant] = {}
        self.preempted: list[int] = []
        self.num_new = 0
        self._victims: list[int] | None = None

    @property
    def victims(self) -> list[int]:
        """Preemption candidates left, in order (resolved from the demand on first use)."""
        if self._victims is None:
            victims = self.demand.victims
            self._victims = list(victims() if callable(victims) else victims)
        return self._victims

    def _grant(self, request_id: int, start: int, num_tokens: int) -> None:
        self.kv.append_slots(request_id, num_tokens)
        tables = self.kv.block_tables(request_id)
        groups = (tables.full, tables.sliding) if self.kv.sliding_pool is not None else (tables.full,)
        self.grants[request_id] = Grant(request_id, start, num_tokens, groups)
        self.budget -= num_tokens

    def _preempt_for(self, request_id: int, num_tokens: int) -> bool:
        """Preempt victims not yet granted until ``request_id`` fits; False if it was the victim."""
        while not self.kv.can_append(request_id, num_tokens):
            candidates = [v for v in self.victims if v not in self.grants]
            if not candidates:
                return False
            victim = candidates[0]
            self.victims.remove(victim)
            self.kv.release_sequence(victim)
            self.preempted.append(victim)
            if victim == request_id:
                return False
        return True

    def extend(self, item: Demand) -> None:
        if self.preempted and item.request_id in self.preempted:
            return
        if item.num_tokens == 1:  # a decode (or a prefill's last token): try the fast path first
            start = self.kv.num_tokens(item.request_id)
            tables = self.kv.append_in_block(item.request_id)
            if tables is not None:  # no block needed, so nothing to preempt: what the general path would do
                groups = (tables.full, tables.sliding) if self.kv.sliding_pool is not None else (tables.full,)
                self.grants[item.request_id] = Grant(item.request_id, start, 1, groups)
                self.budget -= 1
                return
        num_tokens = item.num_tokens if item.whole or item.num_tokens == 1 else min(item.num_tokens, self.budget)
        if num_tokens <= 0:  # a prefill in progress with no budget left this step
            return
        start = self.kv.num_tokens(item.request_id)
        if self._preempt_for(item.request_id, num_tokens):
            self._grant(item.request_id, start, num_tokens)

    def admit(self, item: Demand) -> bool:
        if self.demand.max_new is not None and self.num_new >= self.demand.max_new:
            return False
        kv = self.kv
        cached = kv.start_sequence(item.request_id, item.tokens, item.extra_key,
                                   use_prefix_cache=item.use_prefix_cache)
        remaining = len(item.tokens) - cached
        num_tokens = remaining if item.whole else min(remaining, self.budget)
        fits_budget = num_tokens <= self.budget or (item.whole and not self.grants)
        if num_tokens <= 0 or not fits_budget or not kv.can_append(item.request_id, num_tokens):
            kv.release_sequence(item.request_id)
            return False
        self._grant(item.request_id, cached, num_tokens)
        self.num_new += 1
        return True
