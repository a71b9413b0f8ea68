"""``GET /debug/engine``: what the engine holds right now, for leak checks after a load run.

Read-only and cheap (a few counters): ``{"state", "requests", "stream_entries", "kv_sequences",
"kv_blocks_in_use", "kv_blocks_cached"}`` from ``ServingEngine.read_counts`` (with a separate engine process:
the engine's counts, and ``stream_entries`` on both sides together). An idle engine must report 0 for
everything but ``kv_blocks_cached`` (the prefix cache keeps evictable blocks); ``bench/fault_run.py`` checks
exactly that.

The counts are awaited (a question to the engine process when it is separate): an engine process that stopped
answering (SIGSTOP, a hang in a step) would hold every probe forever, so the route waits at most
``COUNTS_TIMEOUT_SECONDS`` and then answers 503 ``unavailable``: never counts it does not have (zeros would read
as a clean engine).
"""

from __future__ import annotations

import attrs
import trio
from quart import Response

from inference_server.http.errors import unavailable
from inference_server.http.responses import json_response
from inference_server.http.state import AppState

COUNTS_TIMEOUT_SECONDS = 10.0
"""Longest wait for the engine's counts (module docstring); an answering engine replies within a step."""


class DebugRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def engine(self) -> Response:
        """``GET /debug/engine``."""
        engine = self.state.engine
        with trio.move_on_after(COUNTS_TIMEOUT_SECONDS):
            counts = await engine.read_counts()
            return json_response({"state": engine.state.value, **attrs.asdict(counts)})
        raise unavailable(f"the engine did not answer within {COUNTS_TIMEOUT_SECONDS:g} s (its state: "
                          f"{engine.state.value}); it may be hung")
