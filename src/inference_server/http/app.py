"""The Quart-Trio app factory: routes, JSON error handlers, trace ids, and framework settings.

``create_app(engine, settings)`` serves an engine that is already running (``server.serve`` starts the
engine first, then the app; tests do the same with a fake step function). The app never starts or stops the
engine: it only submits requests and reads their streams.

Framework settings that matter:

* ``RESPONSE_TIMEOUT = None``: Quart's default (60 s) would silently cut any longer SSE stream. Deadlines are
  the engine's (``ADMISSION_TIMEOUT``), reported in-band.
* ``BODY_TIMEOUT``: a request body must arrive within ``BODY_TIMEOUT_SECONDS`` (else 408); it bounds only
  the upload, never the response.
* ``MAX_BODY_BYTES = settings.max_body_bytes``: a larger body is a 413, sent once the body has been read and
  discarded (``http/body.py``). Quart's ``MAX_CONTENT_LENGTH`` stays unset: Quart would refuse the body
  without reading it, and the client would see a broken pipe rather than the 413.
* ``AccessLog`` (``http/access_log.py``, unless ``ACCESS_LOG=false``) writes one line per request once its
  response is sent: method, path, status, trace id, tokens in / out, TTFT and total time.
* ``CorsPolicy`` (``http/cors.py``, only with ``ALLOWED_ORIGINS``): browser cross-origin access.
* ``ConnectionPolicy`` (``http/connection.py``) wraps the ASGI app: ``Connection: close`` whenever the
  connection will not or should not be reused (a body left unread, the server draining, or its engine failed).

Every error is JSON in the OpenAI shape, including 404 (unknown route), 405 (wrong method, with ``Allow``),
408, 413 and 500; nothing is ever HTML. Every response carries ``X-Trace-Id`` (and the same value as
``X-Request-Id``, OpenAI's name): the client's (``X-Trace-Id``, else ``X-Request-Id``; validated: 1-128 visible
ASCII characters) or a fresh one; generation routes pass it to the engine as the request's
trace id.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

import attrs
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from inference_server.config import Settings, parse_allowed_origins
from inference_server.engine_surface import ServingEngine
from inference_server.http.access_log import AccessLog
from inference_server.http.connection import ConnectionPolicy
from inference_server.http.convert import REQUEST_ID_HEADER, TRACE_ID_HEADER, client_trace_id
from inference_server.http.cors import CorsPolicy
from inference_server.http.debug import DebugRoutes
from inference_server.http.errors import ApiError, from_http_status, internal_error
from inference_server.http.kv_events import KVEventRoutes
from inference_server.http.native import NativeRoutes
from inference_server.http.observability import ObservabilityRoutes
from inference_server.http.openai import OpenAIRoutes
from inference_server.http.openapi import openapi_document
from inference_server.http.responses import MAX_BODY_BYTES_KEY, error_response, json_response
from inference_server.http.responses_api import ResponsesRoutes
from inference_server.http.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest
from inference_server.http.service import ServiceRoutes
from inference_server.http.state import AppState
from inference_server.http.utility import UtilityRoutes, package_version
from inference_server.telemetry.observability import Observability

log = logging.getLogger(__name__)

BODY_TIMEOUT_SECONDS = 30
STATE_KEY = "inference_server"


@attrs.frozen
class Route:
    method: str
    path: str
    handler: Callable[..., Awaitable[Response]]
    summary: str
    body: type | None = None
    """The attrs record the JSON body is parsed into (``http/schemas.py``); it also makes the OpenAPI schema."""
    query: tuple[str, ...] = ()
    """Query parameters the route reads (documented in the OpenAPI schema)."""
    content_type: str = "application/json"
    """What a 200 carries (JSON unless said; bodies with ``stream`` may also answer ``text/event-stream``)."""

    def line(self) -> str:
        return f"{self.method:<4} {self.path:<28} {self.summary}"


def _routes(state: AppState) -> list[Route]:
    native, openai, service = NativeRoutes(state), OpenAIRoutes(state), ServiceRoutes(state)
    observability, utility = ObservabilityRoutes(state), UtilityRoutes(state)
    routes = [
        Route("POST", "/generate", native.generate, "native generation: text or token ids, SSE with stream=true",
              GenerateRequest),
        Route("GET", "/v1/models", openai.models, "OpenAI: the served model"),
        Route("GET", "/v1/models/<path:model>", openai.model, "OpenAI: one model's card"),
        Route("POST", "/v1/completions", openai.completions, "OpenAI: text completions (stream, n, logprobs)",
              CompletionRequest),
        Route("POST", "/v1/chat/completions", openai.chat_completions, "OpenAI: chat completions (stream, n, "
              "logprobs)", ChatCompletionRequest),
        Route("POST", "/v1/responses", ResponsesRoutes(state).create, "OpenAI Responses API (stateless; stream)"),
        Route("POST", "/tokenize", utility.tokenize, "vLLM: a prompt or chat messages to token ids (count, strings)"),
        Route("POST", "/detokenize", utility.detokenize, "vLLM: token ids to text"),
        Route("GET", "/tokenizer_info", utility.tokenizer_info, "the tokenizer: special tokens, chat template"),
        Route("GET", "/version", utility.version, "the server's version"),
        Route("GET", "/metrics", observability.metrics, "Prometheus metrics (vLLM names, model_name label)",
              content_type="text/plain"),
        Route("GET", "/scheduler/stats", observability.stats, "latency percentiles, throughput, queue, KV usage"),
        Route("GET", "/telemetry/tail", observability.tail, "live NDJSON telemetry (?session_id=&trace_id=&steps=0)",
              query=("session_id", "trace_id", "steps"), content_type="application/x-ndjson"),
        Route("GET", "/kv/events", KVEventRoutes(state).events, "live NDJSON of the prefix cache's block hashes "
              "(snapshot, then inserted/evicted per step; for routers)", content_type="application/x-ndjson"),
        Route("GET", "/health", service.health, "liveness: 200 while the process runs"),
        Route("GET", "/ready", service.ready, "readiness: 503 while starting, draining, failed or stalled"),
        Route("GET", "/debug/engine", DebugRoutes(state).engine, "what the engine holds now (leak checks)"),
        Route("GET", "/", service.index, "this index"),
    ]

    async def openapi_json() -> Response:
        return json_response(document)

    routes.insert(-1, Route("GET", "/openapi.json", openapi_json, "OpenAPI 3.1 schema of these routes"))
    document = openapi_document(routes, title="inference_server", version=package_version())
    service.route_lines = [r.line() for r in routes]
    return routes


def app_state(app: QuartTrio) -> AppState:
    """The shared state of an app made by ``create_app`` (the server flips ``draining`` on it)."""
    return app.extensions[STATE_KEY]


def create_app(engine: ServingEngine, settings: Settings, *, coalesce: bool = True,
               observability: Observability | None = None) -> QuartTrio:
    """The HTTP app serving ``engine`` (already running). ``coalesce=False`` sends one SSE event per token
    (only for measuring what coalescing buys). ``observability``: the engine's telemetry sinks (the server
    attaches them before the engine starts, with the file sinks the settings ask for); when None, stats and
    metrics sinks are attached here."""
    app = QuartTrio("inference_server", static_folder=None)
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=BODY_TIMEOUT_SECONDS, MAX_CONTENT_LENGTH=None,
                      BACKGROUND_TASK_SHUTDOWN_TIMEOUT=2)
    app.config[MAX_BODY_BYTES_KEY] = settings.max_body_bytes
    if observability is None:
        observability = Observability.attach(engine.telemetry, engine.info.model_name)
    state = AppState(engine, settings, observability, coalesce=coalesce)
    app.extensions[STATE_KEY] = state
    # Quart types asgi_app with its exact ASGI TypedDicts; the middleware speaks the generic mapping form.
    # A failed engine counts as draining from the failure on: the process exits within seconds, and the stop
    # sequence flips ``draining`` only once it runs, after the failed requests' answers may already be out.
    app.asgi_app = ConnectionPolicy(app.asgi_app,  # type: ignore[method-assign,assignment,arg-type]
                                    lambda: state.draining or state.engine.failed)
    if settings.access_log:
        app.asgi_app = AccessLog(app.asgi_app, TRACE_ID_HEADER)  # type: ignore[method-assign,assignment,arg-type]
    allowed_origins = parse_allowed_origins(settings.allowed_origins)
    if allowed_origins:  # outermost: a preflight is answered before the access log and the connection policy
        app.asgi_app = CorsPolicy(app.asgi_app, allowed_origins)  # type: ignore[method-assign,assignment,arg-type]
    for route in _routes(state):
        app.add_url_rule(route.path, endpoint=route.path, view_func=route.handler, methods=[route.method])
    _register_trace_ids(app)
    _register_error_handlers(app)
    return app


def _register_trace_ids(app: QuartTrio) -> None:
    @app.before_request
    async def assign_trace_id() -> None:
        g.trace_id = uuid.uuid4().hex
        g.trace_id = client_trace_id(request.headers) or g.trace_id

    @app.after_request
    async def echo_trace_id(response: Response) -> Response:
        trace_id = g.get("trace_id")
        if trace_id is not None:
            response.headers[TRACE_ID_HEADER] = trace_id
            response.headers[REQUEST_ID_HEADER] = trace_id
        return response


def _register_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        response = error_response(from_http_status(error.code or 500, error.description or error.name))
        allow = dict(error.get_headers()).get("Allow")
        if allow:
            response.headers["Allow"] = allow
        return response

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.path, exc_info=error)
        return error_response(internal_error(f"internal server error: {type(error).__name__}"))
