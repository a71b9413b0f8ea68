"""One SQLite file per run (``TELEMETRY_DIR/run-<UTC time>-<pid>.sqlite``): requests, steps, rejections, meta.

Rows are built in the telemetry actor (cheap tuples) and written by a ``BatchWriter`` thread, one
transaction per batch, in WAL mode: the engine never waits for the disk, a full hand-off queue drops rows
and counts them (the counts land in ``meta``), and after a crash the file holds every batch committed so far.
``close()`` (the server calls it after the engine stops, on SIGTERM too) writes the rest and the final meta.

Times are seconds since the run started (``meta.start_time_unix`` anchors them to the wall clock).
``requests`` is keyed by the client's ``X-Trace-Id`` (indexed; ``request_id`` is the engine's number).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from inference_server.telemetry.batch_writer import BatchWriter
from inference_server.telemetry.events import RequestRejected
from inference_server.telemetry.records import RequestRecord, StepRecord
from inference_server.telemetry.tracker import RecordConsumer

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    request_id INTEGER PRIMARY KEY, trace_id TEXT, session_id TEXT, priority INTEGER NOT NULL,
    arrival REAL NOT NULL, admitted REAL, first_token REAL, finished REAL NOT NULL,
    prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    finish_reason TEXT NOT NULL, error TEXT, preemptions INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS requests_by_trace ON requests (trace_id);
CREATE TABLE IF NOT EXISTS steps (
    step_id INTEGER PRIMARY KEY, time REAL NOT NULL, execute_s REAL NOT NULL, schedule_s REAL NOT NULL,
    deliver_s REAL NOT NULL, prefill_tokens INTEGER NOT NULL, decode_tokens INTEGER NOT NULL,
    sampled_tokens INTEGER NOT NULL, num_sequences INTEGER NOT NULL, waiting INTEGER NOT NULL,
    running INTEGER NOT NULL, kv_usage_full REAL NOT NULL, kv_usage_sliding REAL, admitted INTEGER NOT NULL,
    preempted INTEGER NOT NULL, finished INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rejections (time REAL NOT NULL, trace_id TEXT, code TEXT NOT NULL, message TEXT);
"""
REQUEST_INSERT = "INSERT OR REPLACE INTO requests VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
STEP_INSERT = "INSERT OR REPLACE INTO steps VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
REJECTION_INSERT = "INSERT INTO rejections VALUES (?,?,?,?)"


def run_file_name(suffix: str) -> str:
    return time.strftime("run-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}{suffix}"


class SQLiteRunSink(RecordConsumer):
    def __init__(self, path: Path, *, start_time: float, meta: Mapping[str, Any],
                 extra_drops: Callable[[], dict[str, int]] = dict, capacity: int = 65536,
                 start_writer: bool = True) -> None:
        self.path = path
        self.start_time = start_time  # trio clock reading at the run's start: rows are relative to it
        self.extra_drops = extra_drops
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        base = {"schema_version": SCHEMA_VERSION, "start_time_unix": time.time(), **meta}
        self._write_meta({k: json.dumps(v) if not isinstance(v, str) else v for k, v in base.items()})
        self.writer: BatchWriter[tuple[str, tuple]] = BatchWriter(self._write, name="sqlite", capacity=capacity,
                                                                  start=start_writer)

    # -- records (telemetry actor) --------------------------------------------------------------------
    def finished(self, r: RequestRecord) -> None:
        t = self.start_time
        self.writer.offer(("r", (
            r.request_id, r.trace_id, r.session_id, r.priority, r.arrival - t, _rel(r.admitted, t),
            _rel(r.first_token, t), r.finished - t, r.prompt_tokens, r.cached_prompt_tokens, r.output_tokens,
            r.finish_reason, r.error, r.preemptions)))

    def step(self, s: StepRecord) -> None:
        self.writer.offer(("s", (
            s.step_id, s.time - self.start_time, s.execute_seconds, s.schedule_seconds, s.deliver_seconds,
            s.num_prefill_tokens, s.num_decode_tokens, s.num_sampled,
            len(s.plan.sequences) if s.plan is not None else 0, s.num_waiting, s.num_running, s.kv_usage_full,
            s.kv_usage_sliding, len(s.admitted), len(s.preempted), len(s.finished))))

    def rejected(self, event: RequestRejected) -> None:
        self.writer.offer(("x", (event.time - self.start_time, event.trace_id, event.code, event.message)))

    # -- the writer thread -----------------------------------------------------------------------------
    def _write(self, items: list[tuple[str, tuple]]) -> None:
        rows: dict[str, list[tuple]] = {"r": [], "s": [], "x": []}
        for kind, row in items:
            rows[kind].append(row)
        with self._db:  # one transaction per batch
            self._db.execute("BEGIN")
            self._db.executemany(REQUEST_INSERT, rows["r"])
            self._db.executemany(STEP_INSERT, rows["s"])
            self._db.executemany(REJECTION_INSERT, rows["x"])
            self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", self._drop_meta().items())

    def _drop_meta(self) -> dict[str, str]:
        return {"drops": json.dumps({"sqlite_writer": self.writer.dropped, **self.extra_drops()})}

    def _write_meta(self, values: Mapping[str, str]) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", values.items())

    def close(self) -> None:
        """Write what is pending, the final drop counts and the end time; then close the file."""
        self.writer.close()
        self._write_meta({**self._drop_meta(), "end_time_unix": json.dumps(time.time())})
        self._db.close()


def _rel(value: float | None, origin: float) -> float | None:
    return None if value is None else value - origin
