"""KV allocator actor: the sole owner of the block pools and the radix prefix cache.

It answers exactly one batched ``StepDemand`` with one ``StepGrant`` per step (``core/kv_grants.py``), so
"can I allocate" and "allocate" are one atomic decision on state no other task touches. After each grant it
publishes what the step changed in the prefix cache (inserted and evicted block hashes) as one numbered
``KVBlocksChanged`` telemetry event, the feed of ``GET /kv/events``.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from inference_server.core.kv_grants import StepDemand, StepGrant, allocate_step
from inference_server.core.kv_manager import KVManager
from inference_server.telemetry.events import KVBlocksChanged, TelemetryEvent


class KVAllocator:
    def __init__(self, kv: KVManager, demands: trio.MemoryReceiveChannel[StepDemand],
                 grants: trio.MemorySendChannel[StepGrant],
                 allocate: Callable[[KVManager, StepDemand], StepGrant] = allocate_step,
                 emit: Callable[[TelemetryEvent], None] | None = None) -> None:
        self.kv = kv
        self.demands = demands
        self.grants = grants
        self.allocate = allocate  # allocate_step, or a fault-injecting wrapper of it (FAULTS alloc_refuse)
        self.emit = emit

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.demands, self.grants:
            async for demand in self.demands:
                grant = self.allocate(self.kv, demand)
                self.publish_cache_changes()
                await self.grants.send(grant)

    def publish_cache_changes(self) -> None:
        """One ``KVBlocksChanged`` for what the prefix cache stored and evicted since the last call (none
        when nothing changed; the log is emptied even without a listener, so it never grows)."""
        batch = self.kv.events.take()
        if batch is not None and self.emit is not None:
            self.emit(KVBlocksChanged(trio.current_time(), batch.seq, batch.stored, batch.removed))
