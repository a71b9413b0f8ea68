"""``GET /debug/engine``: what the engine holds right now, for leak checks after a load run.

Read-only and cheap (a few counters): ``{"state", "requests", "stream_entries", "kv_sequences",
"kv_blocks_in_use", "kv_blocks_cached"}`` from ``ServingEngine.read_counts`` (with a separate engine process:
the engine's counts, and ``stream_entries`` on both sides together). An idle engine must report 0 for
everything but ``kv_blocks_cached`` (the prefix cache keeps evictable blocks); ``bench/fault_run.py`` checks
exactly that.
"""

from __future__ import annotations

import attrs
from quart import Response

from inference_server.http.responses import json_response
from inference_server.http.state import AppState


class DebugRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def engine(self) -> Response:
        """``GET /debug/engine``."""
        engine = self.state.engine
        counts = await engine.read_counts()
        return json_response({"state": engine.state.value, **attrs.asdict(counts)})
