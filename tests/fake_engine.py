"""The fake engine: a deterministic stand-in for the model step, shared by the core, actor and bench harnesses.

A step answers every sampled sequence of the plan at once with ``token(length, last_token)``, where ``length`` is
the sequence's length after the step's tokens (``cached_len + len(token_ids)``). The same step runs two ways:

* ``execute(plan)``, synchronous: what a core-scheduler harness calls in place of the runner;
* ``await engine(plan)``, in the trio loop: an executor step function for ``EngineParts.step`` (it may sleep
  ``step_seconds``, wait on ``gate``, or raise from step ``fail_at`` on).

``check_contiguous`` asserts that each request's chunks arrive in order without a gap (a new or reset request
may start anywhere), which is how the scheduler tests catch a plan that skips or repeats tokens. The bench's
zero-cost server (``bench/http_overhead.py``, ``bench/burst.py``) turns it and ``keep_plans`` off, so that its
step costs (next to) nothing and keeps nothing.

The HTTP test kit's ``FakeModel`` (``tests/test_http/http_testkit.py``) is the richer double of the same step for
the routes (words by length, EOS, logprobs, the real sampler).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from inference_server.records.steps import SampledToken, StepPlan, StepResult


def next_token(length: int, last_token: int) -> int:
    """The fake model: the next token depends on the sequence's length and its last token (ids 3..99)."""
    return (last_token * 31 + length * 7) % 97 + 3


class FakeEngine:
    """A deterministic step function (see the module docstring).

    ``plans`` records every plan stepped; ``tokens_computed`` counts the tokens stepped over (prompt chunks
    included); ``progress`` is each running request's length so far (``check_contiguous``).
    """

    def __init__(self, step_seconds: float = 0.0, fail_at: int | None = None, *,
                 token: Callable[[int, int], int] = next_token, logprob: float = -1.0,
                 check_contiguous: bool = True, keep_plans: bool = True) -> None:
        self.step_seconds = step_seconds
        self.fail_at = fail_at
        self.token = token
        self.logprob = logprob
        self.check_contiguous = check_contiguous
        self.keep_plans = keep_plans
        self.gate: trio.Event | None = None  # when set, in-loop steps wait for it (a stalled executor)
        self.plans: list[StepPlan] = []
        self.progress: dict[int, int] = {}
        self.tokens_computed = 0

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, synchronously: the sampled tokens of ``plan`` (the step takes ``step_seconds``)."""
        tokens = []
        for seq in plan.sequences:
            length = seq.cached_len + len(seq.token_ids)
            if self.check_contiguous:
                assert seq.reset or self.progress[seq.request_id] == seq.cached_len, (seq.request_id, seq.cached_len)
                self.progress[seq.request_id] = length
            self.tokens_computed += len(seq.token_ids)
            if seq.sample:
                tokens.append(SampledToken(seq.request_id, self.token(length, seq.token_ids[-1]), self.logprob))
        if self.check_contiguous:
            for request_id in plan.finished_request_ids:
                self.progress.pop(request_id, None)
        return StepResult(plan.step_id, tuple(tokens), plan.num_tokens, self.step_seconds)

    async def __call__(self, plan: StepPlan) -> StepResult:
        """One step in the trio loop: record the plan, wait for ``gate``, sleep ``step_seconds``, fail from step
        ``fail_at`` on (an executor crash), else ``execute``."""
        if self.keep_plans:
            self.plans.append(plan)
        if self.gate is not None:
            await self.gate.wait()
        await trio.sleep(self.step_seconds)  # a checkpoint even at 0, as an executor step is
        if self.fail_at is not None and plan.step_id >= self.fail_at:
            raise RuntimeError("injected executor failure")
        return self.execute(plan)
