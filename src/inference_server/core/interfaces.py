"""The engine's seams, named as typed protocols: what the actors need of a step runner, of the scheduler's
planning logic and of the KV cache's bookkeeping. The parts that fill them today (``ModelRunner`` and its CUDA
and Hugging Face subclasses, ``core.scheduler.Scheduler``, ``core.kv_manager.KVManager``) are checked against
them by mypy in ``backends/conformance.py``; a new implementation only has to satisfy the protocol.

Pure Python (no torch, trio or Quart), like the rest of ``core``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from inference_server.core.kv_grants import StepDemand, StepGrant
from inference_server.core.kv_manager import BlockTables, SequenceId
from inference_server.core.radix_cache import ExtraKey
from inference_server.core.request import Request
from inference_server.records.requests import RequestUpdate
from inference_server.records.steps import StepPlan, StepResult

LaunchedT = TypeVar("LaunchedT")


class InferenceBackend(Protocol[LaunchedT]):
    """A step runner: computes the scheduler's ``StepPlan``s on a model (``BACKEND``: reference, custom-cuda,
    hf). ``launch`` queues a step and returns a handle for ``collect``, which waits for it; the executor
    launches step N+1 before collecting step N (overlap), and collects in launch order. A runner forgets a
    request's state when a plan lists it in ``finished_request_ids`` (or calls ``forget``), and starts over on
    a sequence's ``reset`` chunk (preemption)."""

    def launch(self, plan: StepPlan) -> LaunchedT: ...

    def collect(self, launched: LaunchedT) -> StepResult: ...

    def execute(self, plan: StepPlan) -> StepResult:
        """``collect(launch(plan))``."""
        ...

    def forget(self, request_ids: tuple[int, ...]) -> None: ...


class SchedulerInterface(Protocol):
    """The planning logic the scheduler actor drives: requests in, one ``StepDemand`` per step to the KV
    allocator, the grant turned into a ``StepPlan``, and each ``StepResult`` into request updates."""

    @property
    def has_work(self) -> bool: ...

    @property
    def next_step_id(self) -> int: ...

    def add(self, request: Request) -> None: ...

    def abort(self, request_id: int) -> RequestUpdate | None: ...

    def expire(self, now: float) -> list[RequestUpdate]: ...

    def demand(self) -> StepDemand: ...

    def apply_grant(self, grant: StepGrant) -> StepPlan | None: ...

    def on_step_result(self, result: StepResult) -> list[RequestUpdate]: ...


class CacheManager(Protocol):
    """The KV cache's bookkeeping (blocks per sequence; the device storage is the runner's): sequences start
    with their prompt (prefix-cache hits counted), grow by appended slots, and are released once."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_sequences(self) -> int: ...

    def num_tokens(self, seq_id: SequenceId) -> int: ...

    def block_tables(self, seq_id: SequenceId) -> BlockTables: ...

    def start_sequence(self, seq_id: SequenceId, prompt: Sequence[int], extra_key: ExtraKey = None, *,
                       use_prefix_cache: bool = True) -> int: ...

    def can_append(self, seq_id: SequenceId, num_new_tokens: int) -> bool: ...

    def append_slots(self, seq_id: SequenceId, num_new_tokens: int) -> None: ...

    def release_sequence(self, seq_id: SequenceId, computed_tokens: Sequence[int] | None = None) -> None: ...

    def check_integrity(self) -> None: ...
