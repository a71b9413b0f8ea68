"""Executor actor: runs each ``StepPlan`` on the model in one dedicated worker thread.

``trio.to_thread.run_sync`` with a ``CapacityLimiter(1)`` keeps the event loop serving HTTP while a step
runs; the thread is never abandoned on cancellation (a step in flight always completes, so the KV it writes
is consistent). Tests inject an in-loop step function instead of the thread (see ``StepFunction``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from inference_server.records.steps import StepPlan, StepResult

StepFunction = Callable[[StepPlan], Awaitable[StepResult]]


def threaded(execute: Callable[[StepPlan], StepResult]) -> StepFunction:
    """Run a synchronous ``execute`` (the model runner's) in one dedicated worker thread."""
    limiter = trio.CapacityLimiter(1)

    async def step(plan: StepPlan) -> StepResult:
        return await trio.to_thread.run_sync(execute, plan, limiter=limiter)

    return step


class Executor:
    def __init__(self, step: StepFunction, plans: trio.MemoryReceiveChannel[StepPlan],
                 results: trio.MemorySendChannel[StepResult]) -> None:
        self.step = step
        self.plans = plans
        self.results = results

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.plans, self.results:
            async for plan in self.plans:
                await self.results.send(await self.step(plan))
