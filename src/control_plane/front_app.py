"""The front's Quart-Trio app: the routes it answers itself (``/health``, ``/ready``, ``/replicas``, ``/metrics``
and ``/scheduler/stats`` aggregated over replicas, ``/``) and the catch-all that proxies the rest
(``front.Front.proxy``). Errors are JSON in the OpenAI shape, as the single server's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from control_plane.front import Front, error_response, json_response
from control_plane.metrics_merge import merge_expositions
from control_plane.replica_feed import Replica
from inference_server.http.errors import ApiError, from_http_status, unavailable

log = logging.getLogger(__name__)

STATS_TIMEOUT_SECONDS = 5.0


class FrontRoutes:
    """The routes the front answers itself."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def health(self) -> Response:
        return json_response({"status": "ok"})

    async def index(self) -> Response:
        lines = ["control_plane front: the inference server's routes, routed over replicas "
                 f"(policy {self.front.policy_name})", "GET  /replicas   each replica's state",
                 "GET  /metrics    every replica's metrics (label replica) and the router's",
                 "GET  /scheduler/stats   every replica's stats and the totals", "anything else: proxied"]
        return Response("\n".join(lines) + "\n", content_type="text/plain")

    async def metrics(self) -> Response:
        texts = await self._gather("/metrics", lambda response: response.text)
        return Response(merge_expositions(texts, self.front.registry), content_type="text/plain; version=0.0.4")

    async def stats(self) -> Response:
        documents = await self._gather("/scheduler/stats", lambda response: response.json())
        replicas = [self._describe(r) | {"stats": documents.get(r.replica_id)} for r in self.front.replicas]
        totals: dict[str, int] = {"running": 0, "waiting": 0}
        for document in documents.values():
            for name in totals:
                value = (document.get("requests") or {}).get(name)
                totals[name] += value if isinstance(value, int) else 0
        return json_response({"policy": self.front.policy_name, "requests": totals, "replicas": replicas})

    def _describe(self, replica: Replica) -> dict[str, Any]:
        load = replica.load
        return {"replica": replica.replica_id, "url": replica.url, "healthy": replica.healthy,
                "losses": replica.losses, "in_flight": load.in_flight, "waiting": load.waiting,
                "running": load.running, "kv_usage": load.kv_usage,
                "cached_blocks": self.front.index.num_blocks(replica.replica_id)}

    async def _gather(self, path: str, read: Callable[[httpx.Response], Any]) -> dict[int, Any]:
        """``read(GET path)`` of every healthy replica, concurrently; a replica that fails is left out."""
        results: dict[int, Any] = {}

        async def one(replica: Replica) -> None:
            assert self.front.client is not None
            try:
                response = await self.front.client.get(f"{replica.url}{path}", timeout=STATS_TIMEOUT_SECONDS)
                response.raise_for_status()
                results[replica.replica_id] = read(response)
            except (httpx.HTTPError, OSError, ValueError) as error:
                log.info("GET %s from replica %d failed: %r", path, replica.replica_id, error)

        async with trio.open_nursery() as nursery:
            for replica in self.front.replicas:
                if replica.healthy:
                    nursery.start_soon(one, replica)
        return results

    async def replicas(self) -> Response:
        described = [self._describe(r) for r in self.front.replicas]
        return json_response({"policy": self.front.policy_name, "replicas": described})

    async def ready(self) -> Response:
        healthy = sum(r.healthy for r in self.front.replicas)
        if not healthy:
            return error_response(unavailable("no replica is ready", "starting"))
        return json_response({"status": "ready", "replicas_ready": healthy, "replicas": len(self.front.replicas)})


def create_front_app(front: Front, *, max_body_bytes: int | None = None) -> QuartTrio:
    """The front's Quart-Trio app (``front.run`` must be running in the app's loop)."""
    app = QuartTrio("control_plane", static_folder=None)
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=30, MAX_CONTENT_LENGTH=max_body_bytes)

    routes = FrontRoutes(front)

    async def proxied(path: str) -> Response:
        return await front.proxy("/" + path)

    app.add_url_rule("/health", "health", routes.health, methods=["GET"])
    app.add_url_rule("/ready", "ready", routes.ready, methods=["GET"])
    app.add_url_rule("/replicas", "replicas", routes.replicas, methods=["GET"])
    app.add_url_rule("/metrics", "metrics", routes.metrics, methods=["GET"])
    app.add_url_rule("/scheduler/stats", "stats", routes.stats, methods=["GET"])
    app.add_url_rule("/", "index", routes.index, methods=["GET"])
    app.add_url_rule("/<path:path>", "proxied", proxied, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:  # 405, 408, 413, ...: JSON as the server's
        return error_response(from_http_status(error.code or 500, error.description or error.name))

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.path, exc_info=error)
        return error_response(ApiError(500, f"internal error in the front: {type(error).__name__}",
                                       "server_error", "internal_error"))

    return app
