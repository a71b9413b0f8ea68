"""Everything an engine's telemetry feeds, in one place: stats, Prometheus, the SQLite file, the timeline.

``Observability.attach(engine, ...)`` puts one sink on the engine's telemetry actor (the ``RequestTracker``)
and hands its records to the consumers. The server attaches it before the engine starts and calls
``close()`` after the engine stopped (writer threads joined, files complete). Only trio's clock is read
here (``start_time``); everything else runs in the telemetry actor's task or in writer threads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from inference_server.telemetry import profiler_ranges
from inference_server.telemetry.metrics import PrometheusMetrics
from inference_server.telemetry.run_stats import StatsCollector
from inference_server.telemetry.sqlite_sink import SQLiteRunSink, run_file_name
from inference_server.telemetry.timeline import TimelineSink
from inference_server.telemetry.tracker import RequestTracker

if TYPE_CHECKING:
    from inference_server.actors.telemetry import Telemetry
    from inference_server.config import Settings

log = logging.getLogger(__name__)


class Observability:
    def __init__(self, telemetry: Telemetry, model_name: str, *, start_time: float | None = None) -> None:
        self.telemetry = telemetry
        self.model_name = model_name
        self.start_time = trio.current_time() if start_time is None else start_time
        self.tracker = RequestTracker()
        self.stats = StatsCollector(self.start_time)
        self.metrics = PrometheusMetrics(model_name, self.tracker, self.drop_counts)
        self.sqlite: SQLiteRunSink | None = None
        self.timeline: TimelineSink | None = None
        self.tracker.consumers += [self.stats, self.metrics]
        telemetry.sinks.append(self.tracker)

    @classmethod
    def attach(cls, telemetry: Telemetry, model_name: str, settings: Settings | None = None) -> Observability:
        """Stats and metrics always; the SQLite file with ``TELEMETRY_DIR``, the timeline (and profiler
        ranges) with ``TIMELINE_DIR``."""
        observability = cls(telemetry, model_name)
        if settings is not None and settings.telemetry_dir:
            observability.open_sqlite(Path(settings.telemetry_dir) / run_file_name(".sqlite"),
                                      {"model": model_name, "settings": attrs.asdict(settings)})
        if settings is not None and settings.timeline_dir:
            observability.open_timeline(Path(settings.timeline_dir) / run_file_name(".jsonl"))
        return observability

    def open_sqlite(self, path: Path, meta: dict[str, Any], **options: Any) -> SQLiteRunSink:
        self.sqlite = SQLiteRunSink(path, start_time=self.start_time, meta=meta, extra_drops=self._other_drops,
                                    **options)
        self.tracker.consumers.append(self.sqlite)
        log.info("per-run telemetry: %s", path)
        return self.sqlite

    def open_timeline(self, path: Path, **options: Any) -> TimelineSink:
        self.timeline = TimelineSink(path, start_time=self.start_time, **options)
        self.tracker.consumers.append(self.timeline)
        profiler_ranges.enable(True)
        log.info("step timeline: %s", path)
        return self.timeline

    def _other_drops(self) -> dict[str, int]:
        """Every drop count but the SQLite writer's own (which the SQLite sink adds to its meta row)."""
        return {k: v for k, v in self.drop_counts().items() if k != "sqlite_writer"}

    def _upstream_drops(self) -> dict[str, int]:
        return {"inbox": self.telemetry.dropped_events, "subscribers": self.telemetry.subscriber_drops}

    def drop_counts(self) -> dict[str, int]:
        """Events lost so far, by where: the telemetry inbox, subscribers, and each writer's queue."""
        drops = self._upstream_drops()
        if self.sqlite is not None:
            drops["sqlite_writer"] = self.sqlite.writer.dropped
        if self.timeline is not None:
            drops["timeline_writer"] = self.timeline.writer.dropped
        return drops

    def stats_document(self, now: float | None = None) -> dict[str, Any]:
        now = trio.current_time() if now is None else now
        document = {"model": self.model_name, "uptime_seconds": round(now - self.start_time, 3),
                    **self.stats.snapshot(now, num_preempted=self.tracker.num_preempted_waiting)}
        document["requests"]["running"] = self.tracker.num_running
        document["requests"]["waiting"] = self.tracker.num_waiting
        document["telemetry"] = {"events_seen": self.telemetry.events_seen, "dropped": self.drop_counts()}
        return document

    def close(self) -> None:
        """Write what the file sinks hold and close them (after the engine stopped)."""
        if self.sqlite is not None:
            self.sqlite.close()
        if self.timeline is not None:
            self.timeline.close()
            profiler_ranges.enable(False)
