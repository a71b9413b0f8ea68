"""The executor's fault wrapper (``FAULTS`` ``step_error`` / ``step_delay``, see ``core/faults.py``).

Installed around the step pipeline only when one of those faults is on, so a normal run has no extra
branch per step. A slow step sleeps before the real step (the event loop keeps serving meanwhile, as it does
while a real step runs in the worker thread); a failing step raises ``InjectedFault`` instead of running,
which the executor does not catch: the engine fails as on a real device error (``docs/reliability.md``).
"""

from __future__ import annotations

import logging

import trio

from inference_server.actors.executor import StepFunction, StepPipeline, as_pipeline
from inference_server.core.faults import FaultDecisions, InjectedFault
from inference_server.records.steps import StepPlan, StepResult

log = logging.getLogger(__name__)


class FaultyPipeline(StepPipeline):
    """A pipeline with the step faults of ``decisions.spec`` injected before each launch (drawn once per step)."""

    def __init__(self, inner: StepPipeline, decisions: FaultDecisions) -> None:
        self.inner = inner
        self.decisions = decisions
        spec = decisions.spec
        self._delays, self._errors = spec.probability("step_delay") > 0, spec.probability("step_error") > 0

    async def advance(self, plan: StepPlan | None, collect: bool) -> StepResult | None:
        if plan is not None:
            if self._delays and self.decisions.fires("step_delay"):
                await trio.sleep(self.decisions.spec.step_delay_seconds)
            if self._errors and self.decisions.fires("step_error"):
                # Logged with its time so a load run can measure how long the process takes to exit.
                log.error("injected fault: step_error at step %d (%d sequences)", plan.step_id, len(plan.sequences))
                raise InjectedFault(f"injected step_error at step {plan.step_id}")
        return await self.inner.advance(plan, collect)


def faulty_step(step: StepFunction | StepPipeline, decisions: FaultDecisions) -> StepPipeline:
    """``step`` with the step faults of ``decisions.spec`` injected."""
    return FaultyPipeline(as_pipeline(step), decisions)
