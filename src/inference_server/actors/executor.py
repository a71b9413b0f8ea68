"""Executor actor: runs the scheduler's ``StepPlan``s on the model, one step launched ahead when overlapping.

The scheduler sends ``StepPlan``s and ``Drain``s; the executor answers with ``StepResult``s, in plan order.
With ``depth`` 0 every plan is launched and collected at once: one result per plan, the scheduler waits
for it before planning again. With ``depth`` 1 (overlap, ``OVERLAP``) a plan is launched *before* the
previous step is collected, so the device runs step N while the host receives step N's predecessor's tokens,
delivers them and plans step N+1: each plan is answered by the result of the step before it (nothing for
the first), and a ``Drain`` (sent when the scheduler has nothing more to plan) is answered by the last one.

Steps run behind a ``StepPipeline``:

* ``RunnerPipeline`` drives a model runner's ``launch``/``collect`` in one dedicated worker thread
  (``trio.to_thread.run_sync`` with a ``CapacityLimiter(1)``), one thread hop per step: launch this plan,
  then wait for the oldest step (a device event wait, which releases the GIL) and read its tokens. The
  thread is never abandoned on cancellation: a step in flight always completes, so the KV it writes is
  consistent.
* ``FunctionPipeline`` wraps an in-loop ``async (plan) -> StepResult`` function (tests, benchmarks with a
  fake model): it computes at launch, and resolves ``PENDING_TOKEN``s from the previous result on the host,
  so such functions always see real token ids.
"""

from __future__ import annotations

import abc
import operator
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs
import trio

from inference_server.records.steps import ScheduledSequence, StepPlan, StepResult
from inference_server.telemetry import profiler_ranges

StepFunction = Callable[[StepPlan], Awaitable[StepResult]]

_SEQUENCE_FIELDS = tuple(field.name for field in attrs.fields(ScheduledSequence))
_sequence_values = operator.attrgetter(*_SEQUENCE_FIELDS)
_TOKEN_IDS = _SEQUENCE_FIELDS.index("token_ids")


def with_last_token(sequence: ScheduledSequence, token: int) -> ScheduledSequence:
    """``sequence`` with its last token replaced: ``attrs.evolve``'s result, at a third of its cost (this
    runs for every pending sequence of every step)."""
    values = list(_sequence_values(sequence))
    values[_TOKEN_IDS] = (*sequence.token_ids[:-1], token)
    return ScheduledSequence(*values)


@attrs.frozen
class Drain:
    """Ask the executor for the result of the step in flight (the scheduler has nothing more to plan)."""


class StepPipeline(abc.ABC):
    """Launch steps and collect their results in launch order."""

    @abc.abstractmethod
    async def advance(self, plan: StepPlan | None, collect: bool) -> StepResult | None:
        """Launch ``plan`` (if any), then, if ``collect``, wait for the oldest launched step and return its
        result (None when ``collect`` is false)."""


class SteppedRunner(Protocol):
    """What ``RunnerPipeline`` needs of a model runner (``backends/model_runner.py``)."""

    def launch(self, plan: StepPlan) -> Any: ...

    def collect(self, launched: Any) -> StepResult: ...


class RunnerPipeline(StepPipeline):
    """A model runner's ``launch``/``collect``, one worker-thread hop per ``advance``."""

    def __init__(self, runner: SteppedRunner, *, threaded: bool = True) -> None:
        self.runner = runner
        self.threaded = threaded  # False: run in the event loop (tests under trio's mock clock)
        self._limiter = trio.CapacityLimiter(1)
        self._launched: deque[tuple[int, object]] = deque()

    def _advance(self, plan: StepPlan | None, collect: bool) -> StepResult | None:
        if plan is not None:
            with profiler_ranges.phase("execute", plan.step_id):
                self._launched.append((plan.step_id, self.runner.launch(plan)))
        if not collect:
            return None
        step_id, launched = self._launched.popleft()
        with profiler_ranges.phase("collect", step_id):
            return self.runner.collect(launched)

    async def advance(self, plan: StepPlan | None, collect: bool) -> StepResult | None:
        if not self.threaded:
            return self._advance(plan, collect)
        return await trio.to_thread.run_sync(self._advance, plan, collect, limiter=self._limiter)


class FunctionPipeline(StepPipeline):
    """An in-loop step function as a pipeline (see the module docstring)."""

    def __init__(self, step: StepFunction) -> None:
        self.step = step
        self._results: deque[StepResult] = deque()
        self._last_samples: dict[int, int] = {}

    async def advance(self, plan: StepPlan | None, collect: bool) -> StepResult | None:
        if plan is not None:
            result = await self.step(self._resolved(plan))
            self._last_samples = {t.request_id: t.token_id for t in result.tokens}
            self._results.append(result)
        return self._results.popleft() if collect else None

    def _resolved(self, plan: StepPlan) -> StepPlan:
        """``plan`` with every ``PENDING_TOKEN`` replaced by the previous step's sample (one pass: with overlap
        almost every sequence of a decode step is pending)."""
        samples = self._last_samples
        resolved = tuple(with_last_token(s, samples[s.request_id]) if s.pending else s for s in plan.sequences)
        if all(map(operator.is_, resolved, plan.sequences)):
            return plan
        return attrs.evolve(plan, sequences=resolved)


def as_pipeline(step: StepFunction | StepPipeline) -> StepPipeline:
    return step if isinstance(step, StepPipeline) else FunctionPipeline(step)


class Executor:
    """Runs plans through a ``StepPipeline`` with ``depth`` steps launched ahead (see the module docstring)."""

    def __init__(self, pipeline: StepPipeline, plans: trio.MemoryReceiveChannel[StepPlan | Drain],
                 results: trio.MemorySendChannel[StepResult], *, depth: int = 0) -> None:
        if depth not in (0, 1):
            raise ValueError(f"depth must be 0 or 1, got {depth}")
        self.pipeline = pipeline
        self.plans = plans
        self.results = results
        self.depth = depth
        self.in_flight = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.plans, self.results:
            async for message in self.plans:
                if isinstance(message, Drain):
                    while self.in_flight:
                        await self._advance(None)
                    continue
                self.in_flight += 1
                await self._advance(message)

    async def _advance(self, plan: StepPlan | None) -> None:
        collect = plan is None or self.in_flight > self.depth
        result = await self.pipeline.advance(plan, collect)
        if result is not None:
            self.in_flight -= 1
            await self.results.send(result)


__all__ = ["Drain", "Executor", "FunctionPipeline", "RunnerPipeline", "StepFunction",
           "StepPipeline", "as_pipeline"]
