"""Service routes: ``GET /`` (the route index), ``GET /health`` (liveness), ``GET /ready`` (readiness)."""

from __future__ import annotations

import json

from quart import Response

from inference_server.http.errors import unavailable
from inference_server.http.responses import JSON_CONTENT_TYPE, error_response, json_response
from inference_server.http.state import AppState
from inference_server.supervisor import EngineState


def readiness(state: AppState) -> str:
    """``ready``, or why not: ``starting``, ``draining``, ``failed``, ``stopped`` or ``stalled`` (work is
    pending and no engine step completed for ``STALL_TIMEOUT`` seconds)."""
    engine = state.engine
    if state.draining or engine.state is EngineState.DRAINING:
        return "draining"
    if engine.state is not EngineState.READY:
        return engine.state.value
    waited = engine.seconds_since_progress()
    stall_timeout = state.settings.stall_timeout
    if stall_timeout > 0 and waited is not None and waited > stall_timeout:
        return "stalled"
    return "ready"


class ServiceRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.route_lines: list[str] = []  # one line per route, filled in by the app factory

    async def index(self) -> Response:
        """``GET /``: the service, its model and one line per route (pretty-printed for curl)."""
        info = self.state.engine.info
        payload = {"service": "inference_server", "model": self.state.model_name,
                   "max_model_len": info.max_model_len, "default_max_tokens": info.default_max_tokens,
                   "routes": self.route_lines, "docs": "docs/api.md",
                   "openapi": "/openapi.json"}
        return Response(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", content_type=JSON_CONTENT_TYPE)

    async def health(self) -> Response:
        """``GET /health``: 200 while the process serves HTTP (liveness; readiness is ``/ready``)."""
        return json_response({"status": "ok"})

    async def ready(self) -> Response:
        """``GET /ready``: 200 when new requests will be served, else 503 with ``Retry-After``."""
        status = readiness(self.state)
        if status == "ready":
            return json_response({"status": "ready", "model": self.state.model_name})
        error = unavailable(f"the server is not ready: {status}", status)
        response = error_response(error)
        payload = {"status": status, **error.body()}
        response.set_data(json.dumps(payload))
        return response
