"""KV allocator actor: the sole owner of the block pools and the radix prefix cache.

It answers exactly one batched ``StepDemand`` with one ``StepGrant`` per step (``core/kv_grants.py``), so
"can I allocate" and "allocate" are one atomic decision on state no other task touches.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from inference_server.core.kv_grants import StepDemand, StepGrant, allocate_step
from inference_server.core.kv_manager import KVManager


class KVAllocator:
    def __init__(self, kv: KVManager, demands: trio.MemoryReceiveChannel[StepDemand],
                 grants: trio.MemorySendChannel[StepGrant],
                 allocate: Callable[[KVManager, StepDemand], StepGrant] = allocate_step) -> None:
        self.kv = kv
        self.demands = demands
        self.grants = grants
        self.allocate = allocate  # allocate_step, or a fault-injecting wrapper of it (FAULTS alloc_refuse)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.demands, self.grants:
            async for demand in self.demands:
                await self.grants.send(self.allocate(self.kv, demand))
