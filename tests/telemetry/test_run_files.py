"""The per-run SQLite file and the JSONL timeline: schema, trace-id keying, drop counts, crash survival, and
the timeline's step ids matching the SQLite ``steps`` rows on a served fake engine (mock clock)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from inference_server.actors.telemetry import Telemetry
from inference_server.config import Settings
from inference_server.http import create_app
from inference_server.server import supervise_engine
from inference_server.supervisor import Engine
from inference_server.telemetry.events import (
    FirstToken,
    RequestFinished,
    RequestQueued,
    RequestRejected,
    RequestStarted,
)
from inference_server.telemetry.observability import Observability
from inference_server.telemetry.sqlite_sink import SCHEMA_VERSION

SRC = Path(__file__).resolve().parents[2] / "src"


def rows(path: Path, query: str) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute(query).fetchall()


def meta(path: Path) -> dict[str, str]:
    return dict(rows(path, "SELECT key, value FROM meta"))


def request_events(request_id: int, trace_id: str | None, t0: float) -> list:
    return [RequestQueued(t0, request_id, 12, "tenant", trace_id, 1),
            RequestStarted(t0 + 0.5, request_id, 4),
            FirstToken(t0 + 0.75, request_id, 0.75),
            RequestFinished(t0 + 2.0, request_id, "stop", 12, 5, 4, 2.0, 0.75, "tenant", trace_id)]


def test_schema_trace_id_keying_and_meta(tmp_path: Path) -> None:
    observability = Observability(Telemetry(), "m", start_time=100.0)
    path = tmp_path / "run.sqlite"
    observability.open_sqlite(path, {"model": "m", "settings": {"max_batch_size": 8}})
    for event in [*request_events(1, "trace-a", 101.0), *request_events(2, None, 102.0),
                  RequestRejected(103.0, "overloaded", "full", "trace-r")]:
        observability.tracker(event)
    observability.close()
    tables = {name for (name,) in rows(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"meta", "requests", "steps", "rejections"} <= tables
    assert rows(path, "PRAGMA journal_mode") == [("wal",)]
    by_trace = rows(path, "SELECT request_id, session_id, priority, arrival, admitted, first_token, finished, "
                          "prompt_tokens, cached_tokens, output_tokens, finish_reason, error FROM requests "
                          "WHERE trace_id = 'trace-a'")
    assert by_trace == [(1, "tenant", 1, 1.0, 1.5, 1.75, 3.0, 12, 4, 5, "stop", None)]
    assert rows(path, "SELECT count(*) FROM requests WHERE trace_id IS NULL") == [(1,)]
    assert rows(path, "SELECT trace_id, code FROM rejections") == [("trace-r", "overloaded")]
    values = meta(path)
    assert int(values["schema_version"]) == SCHEMA_VERSION
    assert values["model"] == "m" and json.loads(values["settings"]) == {"max_batch_size": 8}
    assert float(values["start_time_unix"]) > 0 and float(values["end_time_unix"]) >= float(values["start_time_unix"])
    assert json.loads(values["drops"]) == {"sqlite_writer": 0, "inbox": 0, "subscribers": 0}


def test_a_full_writer_queue_drops_counts_and_records_the_count(tmp_path: Path) -> None:
    telemetry = Telemetry(inbox_capacity=2)
    for i in range(5):
        telemetry.emit(RequestStarted(float(i), i, 0))  # nobody drains: 3 inbox drops
    observability = Observability(telemetry, "m", start_time=0.0)
    path = tmp_path / "run.sqlite"
    sink = observability.open_sqlite(path, {}, capacity=3, start_writer=False)  # the writer is stalled
    for i in range(5):
        for event in request_events(i, f"t{i}", float(i)):
            observability.tracker(event)
    assert sink.writer.dropped == 2
    assert observability.stats_document(10.0)["telemetry"]["dropped"] == {
        "inbox": 3, "subscribers": 0, "sqlite_writer": 2}
    observability.close()  # the stalled writer's rows are written by close
    assert rows(path, "SELECT trace_id FROM requests ORDER BY request_id") == [("t0",), ("t1",), ("t2",)]
    assert json.loads(meta(path)["drops"]) == {"sqlite_writer": 2, "inbox": 3, "subscribers": 0}


def test_a_crash_keeps_every_batch_written_before_it(tmp_path: Path) -> None:
    """A process killed (``os._exit``: no close, no flush of the rest) leaves a readable file with every
    batch the writer committed."""
    path = tmp_path / "run.sqlite"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(SRC)!r})
        from inference_server.telemetry.sqlite_sink import SQLiteRunSink
        from inference_server.telemetry.records import RequestRecord
        sink = SQLiteRunSink(__import__("pathlib").Path({str(path)!r}), start_time=0.0, meta={{}})
        def record(i):
            return RequestRecord(i, f"t{{i}}", None, 0, 0.0, 0.1, 0.2, 1.0, 3, 0, 2, "stop", None, 0)
        for i in range(10):
            sink.finished(record(i))
        sink.writer.flush()
        for i in range(10, 15):
            sink.writer.offer(("r", ()))  # pending, never written
        os._exit(9)
    """)
    completed = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert completed.returncode == 9
    assert rows(path, "SELECT count(*) FROM requests") == [(10,)]


async def test_timeline_step_ids_match_sqlite_steps_on_a_served_engine(tmp_path: Path, autojump_clock) -> None:
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
    from http_testkit import make_parts, post_stream, word_engine

    settings = Settings(telemetry_dir=str(tmp_path / "telemetry"), timeline_dir=str(tmp_path / "timeline"))
    model = word_engine(step_seconds=0.01)
    engine = Engine(make_parts(model, None, num_blocks=24))
    observability = Observability.attach(engine.telemetry, "tiny", settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise_engine, engine, lambda code: None)
        app = create_app(engine, settings, observability=observability)
        async with app.test_app() as test_app:
            client = test_app.test_client()

            async def one(i: int) -> None:
                result = await post_stream(client, "/generate", {
                    "prompt_token_ids": [2, *range(30, 41)], "max_tokens": 30, "ignore_eos": True, "stream": True},
                    headers={"X-Trace-Id": f"trace-{i}"})
                assert result.status == 200

            async with trio.open_nursery() as clients:
                for i in range(4):
                    clients.start_soon(one, i)
        await engine.drain(0)
    observability.close()
    [database] = (tmp_path / "telemetry").glob("run-*.sqlite")
    [timeline] = (tmp_path / "timeline").glob("run-*.jsonl")
    lines = [json.loads(line) for line in timeline.read_text().splitlines()]
    step_rows = rows(database, "SELECT step_id, prefill_tokens, decode_tokens, preempted FROM steps ORDER BY step_id")
    assert [line["step_id"] for line in lines] == [row[0] for row in step_rows]
    assert [(line["tokens"]["prefill"], line["tokens"]["decode"], len(line["preempted"])) for line in lines] == [
        row[1:] for row in step_rows]
    assert sum(len(line["preempted"]) for line in lines) > 0  # 24 blocks are too few for four requests
    assert {r for line in lines for r in line["finished"]} == {1, 2, 3, 4}
    for line in lines:
        assert sum(n for _, n, _ in line["batch"]) == line["tokens"]["prefill"] + line["tokens"]["decode"]
    traces = rows(database, "SELECT trace_id, output_tokens, finish_reason FROM requests ORDER BY trace_id")
    assert traces == [(f"trace-{i}", 30, "length") for i in range(4)]


async def test_profiler_ranges_name_each_phase_by_step_id(autojump_clock) -> None:
    import sys as _sys

    from torch.profiler import ProfilerActivity, profile

    from inference_server.offline import collect
    from inference_server.telemetry import profiler_ranges

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
    from http_testkit import make_parts, word_engine

    from inference_server.records.requests import GenerationRequest
    from inference_server.records.sampling_params import SamplingParams

    model = word_engine(step_seconds=0.01)
    parts = attrs.evolve(make_parts(model, None), step=ranged_step(model))
    steps: list[int] = []
    token_steps: list[int] = []  # steps whose tokens reached requests
    profiler_ranges.enable(True)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            async with trio.open_nursery() as nursery:
                engine = await nursery.start(Engine(parts).run)
                engine.telemetry.sinks.append(lambda e: steps.append(e.step_id) if hasattr(e, "step_id") else None)
                engine.telemetry.sinks.append(
                    lambda e: token_steps.append(e.step_id) if getattr(e, "num_generated", 0) else None)
                request = GenerationRequest(params=SamplingParams(max_tokens=4, ignore_eos=True),
                                            prompt_ids=(2, 30, 31))
                await collect(engine.submit(request))
                engine.close()
    finally:
        profiler_ranges.enable(False)
    names = {event.name for event in prof.events()}
    assert steps
    for step_id in steps:
        assert {f"step {step_id} schedule", f"step {step_id} execute"} <= names, step_id
    assert token_steps
    # Delivery ranges are keyed by the step whose tokens they deliver (with overlap, not the step just planned).
    assert {f"step {step_id} deliver" for step_id in token_steps} <= names


def test_model_runner_opens_stage_forward_and_sample_ranges() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from inference_server.backends.model_runner import ModelRunner
    from inference_server.backends.paged_kv import FULL_GROUP, SLIDING_GROUP, PagedKVStorage
    from inference_server.models.loading.loader import build_model, init_dummy_weights
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import ScheduledSequence, StepPlan
    from inference_server.telemetry import profiler_ranges

    spec = parse_model_spec(preset_config("gemma-4-31b-tiny"))
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=1)
    storage = PagedKVStorage(spec.cache_layers, {FULL_GROUP: 8, SLIDING_GROUP: 8}, 4, torch.float32, "cpu")
    runner = ModelRunner(model, spec, storage, torch.device("cpu"))
    plan = StepPlan(7, (ScheduledSequence(1, (2, 3, 4), 0, ((0,), (0,)), True, SamplingParams(), True, 3),))
    profiler_ranges.enable(True)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof, profiler_ranges.phase("execute", plan.step_id):
            result = runner.execute(plan)
    finally:
        profiler_ranges.enable(False)
    assert len(result.tokens) == 1
    names = {event.name for event in prof.events()}
    assert {f"step 7 {phase}" for phase in ("execute", "stage", "forward", "sample")} <= names


def ranged_step(step: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
    """An async step function (the executor's ``StepFunction``) in an ``execute`` profiler range per step, as the
    executor puts a runner's launch."""
    from inference_server.telemetry import profiler_ranges

    async def run(plan: Any) -> Any:
        with profiler_ranges.phase("execute", plan.step_id):
            return await step(plan)

    return run
