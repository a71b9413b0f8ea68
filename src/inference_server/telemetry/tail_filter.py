"""What ``GET /telemetry/tail`` prints for each telemetry event: JSON-ready dicts, filtered by session or trace.

Request events are matched by ``session_id`` / ``trace_id`` (learnt from each request's ``RequestQueued``;
the ids of requests queued before the tail started are unknown, so their events are not matched). Steps
are shown unfiltered, or, with a filter, only those whose batch holds a matching request (``steps=False``
hides them).
"""

from __future__ import annotations

from typing import Any

from inference_server.telemetry.events import (
    FirstToken,
    KVBlocksChanged,
    RequestFinished,
    RequestQueued,
    RequestRejected,
    RequestStarted,
    StepCompleted,
    TelemetryEvent,
)

MAX_REMEMBERED = 100_000  # request ids kept for matching (bounded: a long tail must not grow forever)


class TailFilter:
    def __init__(self, session_id: str | None = None, trace_id: str | None = None, steps: bool = True) -> None:
        self.session_id = session_id
        self.trace_id = trace_id
        self.steps = steps
        self._matching: set[int] = set()
        # Matching requests that ended since the last step: a step's finished requests are reported before
        # the step itself, so the next step line is the one that sampled their last token.
        self._ending: set[int] = set()

    @property
    def filtered(self) -> bool:
        return self.session_id is not None or self.trace_id is not None

    def _matches(self, session_id: str | None, trace_id: str | None) -> bool:
        return ((self.session_id is None or session_id == self.session_id)
                and (self.trace_id is None or trace_id == self.trace_id))

    def line(self, event: TelemetryEvent) -> dict[str, Any] | None:
        """The line to print for ``event``, or None when the filter hides it."""
        if isinstance(event, StepCompleted):
            return self._step(event)
        if isinstance(event, KVBlocksChanged):  # counts only; GET /kv/events carries the hashes
            if self.filtered or not self.steps:
                return None
            return {"event": "kv_blocks", "t": event.time, "seq": event.seq, "stored": len(event.stored),
                    "removed": len(event.removed)}
        if isinstance(event, RequestQueued):
            if not self._matches(event.session_id, event.trace_id):
                return None
            if self.filtered and len(self._matching) < MAX_REMEMBERED:
                self._matching.add(event.request_id)
            return {"event": "queued", "t": event.time, "request_id": event.request_id,
                    "trace_id": event.trace_id, "session_id": event.session_id, "priority": event.priority,
                    "prompt_tokens": event.prompt_tokens}
        if isinstance(event, RequestRejected):  # a rejection carries no session: a session filter hides it
            if self.session_id is not None or not self._matches(None, event.trace_id):
                return None
            return {"event": "rejected", "t": event.time, "trace_id": event.trace_id, "code": event.code,
                    "message": event.message}
        if self.filtered and event.request_id not in self._matching:
            return None
        if isinstance(event, RequestStarted):
            return {"event": "started", "t": event.time, "request_id": event.request_id,
                    "cached_prompt_tokens": event.cached_prompt_tokens}
        if isinstance(event, FirstToken):
            return {"event": "first_token", "t": event.time, "request_id": event.request_id, "ttft": event.ttft}
        if isinstance(event, RequestFinished):
            self._matching.discard(event.request_id)
            self._ending.add(event.request_id)
            return {"event": "finished", "t": event.time, "request_id": event.request_id,
                    "trace_id": event.trace_id, "session_id": event.session_id,
                    "finish_reason": event.finish_reason, "prompt_tokens": event.prompt_tokens,
                    "cached_prompt_tokens": event.cached_prompt_tokens, "output_tokens": event.completion_tokens,
                    "e2e": event.e2e_latency, "error": event.error}
        return None

    def _step(self, event: StepCompleted) -> dict[str, Any] | None:
        ending, self._ending = self._ending, set()
        if not self.steps:
            return None
        ids = [s.request_id for s in event.plan.sequences] if event.plan is not None else []
        if self.filtered and not (self._matching.intersection(ids) or ending.intersection(ids)):
            return None
        waiting, running = event.queue_at_step
        return {"event": "step", "t": event.time, "step_id": event.step_id, "sequences": event.num_sequences,
                "prefill_tokens": event.num_prefill_tokens, "decode_tokens": event.num_decode_tokens,
                "preempted": list(event.preempted), "waiting": waiting, "running": running,
                "kv_usage": event.kv_usage, "seconds": event.seconds}
