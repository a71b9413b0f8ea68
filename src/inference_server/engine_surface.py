"""``ServingEngine``: what the HTTP layer and the server need of an engine, whichever process runs it.

Two engines implement it: ``supervisor.Engine`` (the actors in this process) and ``ipc.remote_engine.RemoteEngine``
(the front's engine when ``ENGINE_PROCESS=separate`` runs the actors in a child process, docs/ipc.md). HTTP code
types its engine as ``ServingEngine`` and never reaches past it, so every route works the same in both modes.

Contracts shared by both:

* ``submit`` never blocks; its handle yields an admission (or raises the refusal) then updates ending in exactly
  one terminal one.
* ``read_counts`` and ``read_kv_cache_snapshot`` are awaited (a question to the other process when split); the
  in-process engine answers without a checkpoint, so a snapshot read right after subscribing to ``telemetry``
  sees no batch fall in between (``GET /kv/events``). Across processes a batch already reflected in the
  snapshot may still arrive after it: consumers skip batches numbered at or below the snapshot's ``seq``.
* ``telemetry`` carries every event of the engine's requests and steps (forwarded from the engine process when
  split), so ``Observability``, ``/telemetry/tail`` and ``/kv/events`` read one feed either way.
* ``drain(timeout)`` returns once the engine has stopped (every admitted request has its terminal update).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from inference_server.actors.request_handle import RequestHandle
from inference_server.actors.telemetry import Telemetry
from inference_server.records.requests import GenerationRequest
from inference_server.supervisor import EngineCounts, EngineInfo, EngineState, KVCacheSnapshot


class ServingEngine(Protocol):
    """See the module docstring."""

    state: EngineState
    telemetry: Telemetry

    @property
    def info(self) -> EngineInfo: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def failed(self) -> bool: ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    async def compile_constraints(self, requests: Sequence[GenerationRequest]) -> None: ...

    async def read_counts(self) -> EngineCounts: ...

    async def read_kv_cache_snapshot(self) -> KVCacheSnapshot: ...

    def seconds_since_progress(self) -> float | None: ...

    async def drain(self, timeout: float) -> None: ...
