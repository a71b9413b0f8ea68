"""``GET /scheduler/stats``: sliding-window latency percentiles, throughput, queue and KV state.

Fed by ``RequestTracker`` records in the telemetry actor. Latencies go into two windows (``stats.py``):
the last 60 s (60 one-second slots) and the last 1,000 requests (10 slots of 100 finished requests; a
latency observed while request number ``k`` is the newest finished one falls in slot ``k // 100``).
Throughput is tokens over the time window divided by its span (shorter right after start).
"""

from __future__ import annotations

from typing import Any

from inference_server.telemetry.events import FirstToken, RequestRejected
from inference_server.telemetry.records import RequestRecord, StepRecord
from inference_server.telemetry.stats import SlidingSketch, SlidingSum
from inference_server.telemetry.tracker import LiveRequest, RecordConsumer

TIME_SLOTS, SLOT_SECONDS = 60, 1.0
REQUEST_SLOTS, SLOT_REQUESTS = 10, 100
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
LATENCIES = ("ttft", "itl", "e2e", "queue_time")


class StatsCollector(RecordConsumer):
    def __init__(self, start_time: float) -> None:
        self.start_time = start_time
        self.by_time = {name: SlidingSketch(TIME_SLOTS) for name in LATENCIES}
        self.by_requests = {name: SlidingSketch(REQUEST_SLOTS) for name in LATENCIES}
        self.prompt_tokens = SlidingSum(TIME_SLOTS)
        self.output_tokens = SlidingSum(TIME_SLOTS)
        self.finished_requests = SlidingSum(TIME_SLOTS)
        self.num_finished = 0
        self.finish_reasons: dict[str, int] = {}
        self.rejections: dict[str, int] = {}
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_running = self.num_waiting = self.num_preempted = 0
        self.kv_usage: dict[str, float] = {"full": 0.0}
        self.last_step_id: int | None = None
        self.last_time = start_time

    # -- records -------------------------------------------------------------------------------------
    def _observe(self, name: str, time: float, value: float, count: int = 1) -> None:
        self.by_time[name].add(int(time // SLOT_SECONDS), value, count)
        self.by_requests[name].add(self.num_finished // SLOT_REQUESTS, value, count)
        self.last_time = max(self.last_time, time)

    def started(self, request: LiveRequest, cached_prompt_tokens: int, first_time: bool) -> None:
        if first_time:
            self.prefix_queries += request.prompt_tokens
            self.prefix_hits += cached_prompt_tokens

    def first_token(self, request: LiveRequest, event: FirstToken) -> None:
        self._observe("ttft", event.time, event.ttft)

    def finished(self, record: RequestRecord) -> None:
        self._observe("e2e", record.finished, record.e2e)
        self._observe("queue_time", record.finished, record.queue_time)
        self.num_finished += 1
        self.finished_requests.add(int(record.finished // SLOT_SECONDS), 1)
        self.finish_reasons[record.finish_reason] = self.finish_reasons.get(record.finish_reason, 0) + 1

    def step(self, record: StepRecord) -> None:
        epoch = int(record.time // SLOT_SECONDS)
        for itl, count in record.inter_token_latencies:
            self._observe("itl", record.time, itl, count)
        self.prompt_tokens.add(epoch, record.num_prefill_tokens)
        self.output_tokens.add(epoch, record.num_sampled)
        self.preemptions += len(record.preempted)
        self.num_running, self.num_waiting = record.num_running, record.num_waiting
        self.kv_usage = {"full": record.kv_usage_full}
        if record.kv_usage_sliding is not None:
            self.kv_usage["sliding"] = record.kv_usage_sliding
        self.last_step_id = record.step_id
        self.last_time = max(self.last_time, record.time)

    def rejected(self, event: RequestRejected) -> None:
        self.rejections[event.code] = self.rejections.get(event.code, 0) + 1

    # -- the report ----------------------------------------------------------------------------------
    def snapshot(self, now: float, *, num_preempted: int | None = None) -> dict[str, Any]:
        """The stats document at time ``now`` (trio clock)."""
        epoch = int(now // SLOT_SECONDS)
        span = max(1e-9, min(TIME_SLOTS * SLOT_SECONDS, now - self.start_time))
        request_epoch = self.num_finished // SLOT_REQUESTS
        return {
            "window_last_60s": {
                "seconds": round(span, 3),
                "finished_requests": int(self.finished_requests.window(epoch)),
                "latency_seconds": {n: _percentiles(self.by_time[n].window(epoch)) for n in LATENCIES},
                "throughput_tokens_per_second": {
                    "prompt": self.prompt_tokens.window(epoch) / span,
                    "output": self.output_tokens.window(epoch) / span,
                },
            },
            "window_last_1000_requests": {
                "latency_seconds": {n: _percentiles(self.by_requests[n].window(request_epoch)) for n in LATENCIES},
            },
            "requests": {
                "running": self.num_running, "waiting": self.num_waiting,
                "preempted": self.num_preempted if num_preempted is None else num_preempted,
                "finished_total": self.num_finished, "finished_by_reason": dict(self.finish_reasons),
                "preemptions_total": self.preemptions,
            },
            "kv_cache": {
                "usage": dict(self.kv_usage),
                "prefix_cache": {"queried_tokens": self.prefix_queries, "hit_tokens": self.prefix_hits,
                                 "hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else None},
            },
            "rejections_by_reason": dict(self.rejections),
            "last_step_id": self.last_step_id,
        }


def _percentiles(sketch: Any) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {"count": sketch.count}
    for name, q in QUANTILES.items():
        value = sketch.quantile(q)
        out[name] = None if value is None else round(value, 6)
    return out
