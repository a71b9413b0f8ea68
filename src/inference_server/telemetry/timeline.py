"""The step timeline: one JSON line per scheduler decision (``TIMELINE_DIR/run-<UTC time>-<pid>.jsonl``).

Each line: ``step_id`` (the same id as the SQLite ``steps`` row and the profiler ranges ``step <id>
<phase>``), ``t`` (seconds since the run started), the requests ``admitted`` (started or restarted),
``preempted`` and ``finished`` since the previous step, the ``batch`` (``[request_id, tokens, "p"|"d"]``
per sequence: prefill chunk or decode), ``tokens`` by phase, ``kv_usage`` per block group, queue depths and
``seconds`` per phase (``schedule``, ``execute``, ``deliver``). Lines are encoded and written by a
``BatchWriter`` thread; the telemetry actor only queues the record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from inference_server.telemetry.batch_writer import BatchWriter
from inference_server.telemetry.records import StepRecord
from inference_server.telemetry.tracker import RecordConsumer


def step_line(record: StepRecord, start_time: float) -> dict:
    kv = {"full": round(record.kv_usage_full, 6)}
    if record.kv_usage_sliding is not None:
        kv["sliding"] = round(record.kv_usage_sliding, 6)
    return {
        "step_id": record.step_id,
        "t": round(record.time - start_time, 6),
        "admitted": list(record.admitted),
        "preempted": list(record.preempted),
        "finished": list(record.finished),
        "batch": _batch(record),
        "tokens": {"prefill": record.num_prefill_tokens, "decode": record.num_decode_tokens,
                   "sampled": record.num_sampled},
        "kv_usage": kv,
        "waiting": record.num_waiting,
        "running": record.num_running,
        "seconds": {"schedule": record.schedule_seconds, "execute": record.execute_seconds,
                    "deliver": record.deliver_seconds},
    }


def _batch(record: StepRecord) -> list[list]:
    """``[request_id, tokens, "p"|"d"]`` per sequence (the same rule as ``StepRecord.batch``, without the
    intermediate records: this runs once per step in the writer thread)."""
    if record.plan is None:
        return []
    return [[s.request_id, s.num_tokens, "d" if s.num_tokens == 1 and s.cached_len >= s.prompt_len else "p"]
            for s in record.plan.sequences]


class TimelineSink(RecordConsumer):
    def __init__(self, path: Path, *, start_time: float, capacity: int = 65536, start_writer: bool = True) -> None:
        self.path = path
        self.start_time = start_time
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self.writer: BatchWriter[StepRecord] = BatchWriter(self._write, name="timeline", capacity=capacity,
                                                           start=start_writer)

    def step(self, record: StepRecord) -> None:
        self.writer.offer(record)

    def _write(self, records: list[StepRecord]) -> None:
        self._file.write("".join(json.dumps(step_line(r, self.start_time), separators=(",", ":")) + "\n"
                                 for r in records))
        self._file.flush()

    def close(self) -> None:
        self.writer.close()
        self._file.close()
