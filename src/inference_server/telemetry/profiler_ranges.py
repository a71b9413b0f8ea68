"""Profiler ranges per step phase (``torch.profiler.record_function``), named ``step <id> <phase>``.

A profiler trace of a run (``torch.profiler.profile``, or Nsight with ``emit_nvtx``) then lines up with the
JSONL timeline, whose events carry the same step ids. Entering a ``record_function`` costs ~15 µs on CPU even
when no profiler records, so ranges are off unless ``enable(True)`` was called (the server turns them on when
``TIMELINE_DIR`` is set), and even then are entered only while a profiler records; otherwise ``phase``
returns one shared null context.

Phases: ``schedule`` (demand, grant, plan: scheduler actor), ``execute`` (launching the step, in the
executor's worker thread) and inside it ``stage`` (inputs and block tables to the device), ``forward`` and
``sample`` (the model runners), ``collect`` (waiting for the step's tokens and reading them), and
``deliver`` (the tokens to the request streams; keyed by the step whose tokens it delivers).
"""

from __future__ import annotations

import contextlib
from typing import Any

_NULL = contextlib.nullcontext()
_enabled = False
_torch: Any = None  # imported by ``enable(True)``, at start-up: importing torch takes seconds


def enable(on: bool) -> None:
    """Turn ranges on or off (process-wide, like the profiler itself). Call it before serving: turning
    them on imports torch, which must not happen on the event loop while requests wait."""
    # The one process-wide switch of the package: the profiler it serves records the whole process (every thread
    # and step), and the server turns ranges on once at start-up, before any step runs.
    global _enabled, _torch
    if on and _torch is None:
        import torch

        _torch = torch
    _enabled = on


def enabled() -> bool:
    return _enabled


def phase(name: str, step_id: int) -> contextlib.AbstractContextManager[Any]:
    """A profiler range ``step <step_id> <name>`` when ranges are on and a profiler is recording (the torch
    profiler, or Nsight through ``emit_nvtx``), else a null context."""
    if not _enabled or not _torch.autograd._profiler_enabled():  # 0.1 µs; a record_function costs ~15 µs
        return _NULL
    return _torch.profiler.record_function(f"step {step_id} {name}")
