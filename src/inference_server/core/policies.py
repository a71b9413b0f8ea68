"""Admission order and preemption victims: FCFS, fair share per session, and priority.

Fair share is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024): every session has a counter of the service it received (prompt tokens weighted 1, generated
tokens weighted 2); the waiting request of the session with the smallest counter goes first, and a session
that becomes active again is lifted to the smallest counter among active sessions so it cannot bank credit
while idle. A session sending ten times more work therefore gets the same token rate, not ten times more.

Priority is applied first under both policies: a smaller ``priority`` is served first and preempted last.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from inference_server.core.request import Request

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
ANONYMOUS_SESSION = ""


def session_of(request: Request) -> str:
    return request.session_id if request.session_id is not None else ANONYMOUS_SESSION


SortKey = tuple[float, ...]
"""A request's place in an ordering: compared element by element, smallest first."""


class SchedulingPolicy:
    """FCFS: priority, then arrival order."""

    name = "fcfs"

    def admission_key(self, request: Request) -> SortKey:
        return (request.priority, request.arrival_index)

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        return sorted(waiting, key=self.admission_key)

    def victim_key(self, request: Request) -> SortKey:
        """The running request with the largest key is preempted first (lowest priority, newest)."""
        return (request.priority, request.arrival_index)

    def on_arrival(self, request: Request, active_sessions: AbstractSet[str]) -> None:
        """Called when a request enters the waiting queue for the first time."""

    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """Record service a request received in one step."""


class FairSharePolicy(SchedulingPolicy):
    """Virtual token counter per session (see the module docstring)."""

    name = "fair"

    def __init__(self) -> None:
        self.counters: defaultdict[str, float] = defaultdict(float)

    def admission_key(self, request: Request) -> SortKey:
        return (request.priority, self.counters[session_of(request)], request.arrival_index)

    def victim_key(self, request: Request) -> SortKey:
        return (request.priority, self.counters[session_of(request)], request.arrival_index)

    def on_arrival(self, request: Request, active_sessions: AbstractSet[str]) -> None:
        session = session_of(request)
        if session in active_sessions:
            return
        others = [self.counters[s] for s in active_sessions if s != session]
        if others:
            self.counters[session] = max(self.counters[session], min(others))

    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        self.counters[session_of(request)] += PROMPT_WEIGHT * prompt_tokens + OUTPUT_WEIGHT * output_tokens


def make_policy(name: str) -> SchedulingPolicy:
    if name == "fcfs":
        return SchedulingPolicy()
    if name == "fair":
        return FairSharePolicy()
    raise ValueError(f"unknown scheduling policy {name!r}; accepted: fcfs, fair")
