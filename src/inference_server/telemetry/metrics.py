"""``GET /metrics``: Prometheus families fed from telemetry records (never from the engine's hot path).

vLLM's names (``../shared/reference/peers.md`` §1.3) with a ``model_name`` label, so dashboards, routers
and load tools that scrape ``vllm:*`` work unchanged; ``inference_server:*`` families cover what vLLM lacks:
KV usage per block group, requests waiting after a preemption, rejections by reason, tokens per session
(the fair-share policy's currency), step time by phase, and telemetry drops. Each engine gets its own
``CollectorRegistry`` (tests run several engines in one process).

Counters and histograms move as records arrive; gauges are the state after the latest record. Telemetry
drop counters are read from their owners at scrape time (a custom collector).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from inference_server.telemetry.events import FirstToken, RequestRejected
from inference_server.telemetry.records import RequestRecord, StepRecord
from inference_server.telemetry.tracker import LiveRequest, RecordConsumer, RequestTracker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_SESSIONS = 100  # distinct session labels; later sessions are counted under "_other" (bounded cardinality)
OTHER_SESSION = "_other"
NO_SESSION = "_none"

# vLLM's bucket ladders, extended downwards for CPU-fast fake engines and small models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20)


class PrometheusMetrics(RecordConsumer):
    """The Prometheus families of one engine, updated from records."""

    def __init__(self, model_name: str, tracker: RequestTracker,
                 drop_counts: Callable[[], dict[str, int]] = dict) -> None:
        disable_created_metrics()  # no ``*_created`` series (process-wide; vLLM's exposition has none either)
        self.registry = CollectorRegistry(auto_describe=True)
        self.tracker = tracker
        self.sessions: set[str] = set()
        m = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: list[str] = m) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        # -- vLLM's families ---------------------------------------------------------------------------
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage of the full-attention block group "
                              "(1 = full).", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens computed (recomputes included).", m,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m, registry=r)
        self.success = Counter("vllm:request_success", "Requests ended, by finish reason.",
                               [*m, "finished_reason"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute).", m, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m,
                                   registry=r)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        # Observed in bulk (one call per distinct latency of a step, with its token count).
        self.itl = WeightedHistogram("vllm:inter_token_latency_seconds", "Latency between consecutive tokens.",
                                     ITL_BUCKETS, model_name)
        r.register(self.itl)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Mean inter-token latency per request.",
                         ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to end.", REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to end.", REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to end.", REQUEST_BUCKETS)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens computed per step.", TOKEN_BUCKETS)
        self.request_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation = hist("vllm:request_generation_tokens", "Generated tokens per request.",
                                       TOKEN_BUCKETS)
        self.request_preemptions = hist("vllm:request_num_preemptions", "Preemptions per request.",
                                        PREEMPTION_BUCKETS)
        # -- ours --------------------------------------------------------------------------------------
        self.kv_group_usage = Gauge("inference_server:kv_cache_usage_perc", "KV-cache usage by block group.",
                                    [*m, "group"], registry=r)
        self.preempted_waiting = Gauge("inference_server:num_requests_preempted", "Requests waiting again after "
                                       "a preemption.", m, registry=r)
        self.rejections = Counter("inference_server:rejections", "Requests refused before queueing, by reason.",
                                  [*m, "reason"], registry=r)
        self.session_tokens = Counter("inference_server:session_tokens", "Tokens computed per session_id "
                                      "(fair-share currency; _none: no session).", [*m, "session_id"], registry=r)
        self.session_requests = Counter("inference_server:session_requests", "Requests ended per session_id.",
                                        [*m, "session_id"], registry=r)
        self.step_phase = hist("inference_server:step_phase_seconds", "Step time by phase (schedule, execute, "
                               "deliver).", STEP_BUCKETS, [*m, "phase"])
        self.steps = Counter("inference_server:steps", "Engine steps.", m, registry=r)
        r.register(_DropCollector(model_name, drop_counts))
        self._bind(model_name)

    def _bind(self, model: str) -> None:
        """Children with the model label bound once (and present at 0 before anything happens)."""
        self.model = model
        self._running = self.running.labels(model)
        self._waiting = self.waiting.labels(model)
        self._kv_usage = self.kv_usage.labels(model)
        self._prompt_tokens = self.prompt_tokens.labels(model)
        self._generation_tokens = self.generation_tokens.labels(model)
        self._preemptions = self.preemptions.labels(model)
        self._prefix_queries = self.prefix_queries.labels(model)
        self._prefix_hits = self.prefix_hits.labels(model)
        self._ttft = self.ttft.labels(model)
        self._tpot = self.tpot.labels(model)
        self._e2e = self.e2e.labels(model)
        self._queue = self.queue.labels(model)
        self._inference = self.inference.labels(model)
        self._prefill = self.prefill.labels(model)
        self._decode = self.decode.labels(model)
        self._iteration_tokens = self.iteration_tokens.labels(model)
        self._request_prompt = self.request_prompt.labels(model)
        self._request_generation = self.request_generation.labels(model)
        self._request_preemptions = self.request_preemptions.labels(model)
        self._preempted_waiting = self.preempted_waiting.labels(model)
        self._steps = self.steps.labels(model)
        self._phases = {p: self.step_phase.labels(model, p) for p in ("schedule", "execute", "deliver")}
        self._kv_full = self.kv_group_usage.labels(model, "full")
        self._kv_sliding: Any = None  # bound at the first step of a model with a sliding-window group
        self._session_tokens: dict[str, Any] = {}  # session label -> bound child (a labels() call costs µs)
        for reason in ("stop", "length", "abort", "timeout", "error"):
            self.success.labels(model, reason)

    def _session(self, session_id: str | None) -> str:
        label = session_id or NO_SESSION
        if label in self.sessions:
            return label
        if len(self.sessions) >= MAX_SESSIONS:
            return OTHER_SESSION
        self.sessions.add(label)
        return label

    # -- records -------------------------------------------------------------------------------------
    def started(self, request: LiveRequest, cached_prompt_tokens: int, first_time: bool) -> None:
        if first_time:
            self._prefix_queries.inc(request.prompt_tokens)
            self._prefix_hits.inc(cached_prompt_tokens)
        self._sync_counts()

    def queued(self, request: LiveRequest) -> None:
        self._sync_counts()

    def first_token(self, request: LiveRequest, event: FirstToken) -> None:
        self._ttft.observe(event.ttft)

    def finished(self, record: RequestRecord) -> None:
        self.success.labels(self.model, record.finish_reason).inc()
        self.session_requests.labels(self.model, self._session(record.session_id)).inc()
        self._e2e.observe(record.e2e)
        self._queue.observe(record.queue_time)
        self._request_prompt.observe(record.prompt_tokens)
        self._request_generation.observe(record.output_tokens)
        self._request_preemptions.observe(record.preemptions)
        if record.admitted is not None:
            self._inference.observe(record.finished - record.admitted)
            if record.first_token is not None:
                self._prefill.observe(record.first_token - record.admitted)
        if record.first_token is not None:
            self._decode.observe(record.finished - record.first_token)
        tpot = record.time_per_output_token
        if tpot is not None:
            self._tpot.observe(tpot)
        self._sync_counts()

    def step(self, record: StepRecord) -> None:
        self._steps.inc()
        self._prompt_tokens.inc(record.num_prefill_tokens)
        self._generation_tokens.inc(record.num_sampled)
        self._iteration_tokens.observe(record.num_prefill_tokens + record.num_decode_tokens)
        if record.preempted:
            self._preemptions.inc(len(record.preempted))
        for itl, count in record.inter_token_latencies:
            self.itl.observe(itl, count)
        self._phases["schedule"].observe(record.schedule_seconds)
        self._phases["execute"].observe(record.execute_seconds)
        self._phases["deliver"].observe(record.deliver_seconds)
        self._kv_usage.set(record.kv_usage_full)
        self._kv_full.set(record.kv_usage_full)
        if record.kv_usage_sliding is not None:
            if self._kv_sliding is None:
                self._kv_sliding = self.kv_group_usage.labels(self.model, "sliding")
            self._kv_sliding.set(record.kv_usage_sliding)
        for session, tokens in record.session_tokens:
            label = self._session(session)
            child = self._session_tokens.get(label)
            if child is None:
                child = self._session_tokens[label] = self.session_tokens.labels(self.model, label)
            child.inc(tokens)
        self._sync_counts()

    def rejected(self, event: RequestRejected) -> None:
        self.rejections.labels(self.model, event.code).inc()

    def _sync_counts(self) -> None:
        tracker = self.tracker
        self._running.set(tracker.num_running)
        self._waiting.set(tracker.num_waiting)
        self._preempted_waiting.set(tracker.num_preempted_waiting)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _DropCollector(Collector):
    """Telemetry drop counters, read from their owners at scrape time."""

    def __init__(self, model: str, drop_counts: Callable[[], dict[str, int]]) -> None:
        self.model = model
        self.drop_counts = drop_counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("inference_server:telemetry_dropped_events", "Telemetry events dropped, by "
                                     "where (inbox, subscribers, or a sink's writer queue).",
                                     labels=["model_name", "where"])
        for where, count in sorted(self.drop_counts().items()):
            family.add_metric([self.model, where], count)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())


class WeightedHistogram(Collector):
    """A Prometheus histogram that takes ``observe(value, count)``: many equal observations in one call."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], model: str) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = [*buckets, math.inf]
        self.model = model
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # the first bucket with value <= le
        self.sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        family.add_metric([self.model], buckets, sum_value=self.sum)
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        return iter(())
