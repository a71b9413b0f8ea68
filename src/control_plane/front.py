"""The front: one HTTP server in front of the replicas, with the single server's routes (the app around it
is ``front_app.py``).

Generation routes (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``) are routed
by the policy (``router.py``) on the request's routing key (``routing_key.py``) and proxied to the chosen
replica; streams (SSE, NDJSON) are passed through chunk by chunk as they arrive. Every other route the
single server has (``/v1/models``, ``/tokenize``, ``/openapi.json``, errors for unknown routes, ...) is proxied
to a healthy replica as is. Every proxied response carries ``X-Replica``.

Failures: a replica that refuses the connection is skipped and the request goes to another (it never
reached the first). A replica lost after the request was sent ends the request with an error, never a hang:
a JSON response becomes a 502 ``replica_failed`` in the OpenAI error shape; a stream already started gets an
SSE error event and ``[DONE]`` (the single server's in-band error form). Losing a replica (feed broken or
silent, ``replica_feed.py``) cancels every read from it at once.
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge
from quart import Response, request
from werkzeug.datastructures import Headers

from control_plane.prefix_index import PrefixIndex
from control_plane.replica_feed import Replica, ReplicaLost, follow
from control_plane.replicas import ReplicaSource
from control_plane.router import NoReplicaError, Policy, ReplicaLoad, RoutingKey, make_policy
from control_plane.routing_key import GENERATION_ROUTES, routing_key
from inference_server.core.validation import PromptTokenizer
from inference_server.http.errors import ApiError, unavailable
from inference_server.http.sse import DONE, event

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "content-length", "host"})
REPLICA_HEADER = "X-Replica"
STREAMING_TYPES = ("text/event-stream", "application/x-ndjson")
CLOSE_TIMEOUT_SECONDS = 1.0


def replica_failed(replica: int, error: BaseException) -> ApiError:
    return ApiError(502, f"replica {replica} failed while serving the request: {type(error).__name__}: {error}",
                    "server_error", "replica_failed")


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


@attrs.define(eq=False, slots=False)
class Front:
    """The front's state: replicas, index, policy, the HTTP client and the router's metrics."""

    source: ReplicaSource
    policy_name: str = "prefix_aware"
    tokenizer: PromptTokenizer | None = None
    index: PrefixIndex = attrs.Factory(PrefixIndex)
    replicas: list[Replica] = attrs.field(init=False)
    policy: Policy = attrs.field(init=False)
    client: httpx.AsyncClient | None = None
    nursery: trio.Nursery | None = None
    registry: CollectorRegistry = attrs.Factory(lambda: CollectorRegistry(auto_describe=True))

    def __attrs_post_init__(self) -> None:
        self.replicas = [Replica(i, ReplicaLoad(i)) for i in range(self.source.count)]
        self.policy = make_policy(self.policy_name, self.index)
        self.routed = Counter("control_plane:routed_requests", "Requests routed, by replica and reason.",
                              ["replica", "reason"], registry=self.registry)
        self.blocks_requested = Counter("control_plane:prefix_blocks_requested",
                                        "Whole prompt blocks of routed generation requests.", registry=self.registry)
        self.blocks_matched = Counter("control_plane:prefix_blocks_matched",
                                      "Of those, blocks cached on the chosen replica (per the index).",
                                      registry=self.registry)
        self.replica_losses = Counter("control_plane:replica_losses", "Times a replica was lost.", ["replica"],
                                      registry=self.registry)
        self.healthy_gauge = Gauge("control_plane:replicas_healthy", "Healthy replicas.", registry=self.registry)
        self.healthy_gauge.set_function(lambda: sum(r.healthy for r in self.replicas))
        self.in_flight_gauge = Gauge("control_plane:requests_in_flight", "Requests proxied and not ended.",
                                     ["replica"], registry=self.registry)

    @property
    def block_size(self) -> int | None:
        return next((r.block_size for r in self.replicas if r.healthy and r.block_size), None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow every replica until cancelled (the HTTP client lives as long)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(10.0, read=None, write=30.0, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client, trio.open_nursery() as nursery:
            self.client, self.nursery = client, nursery
            for replica in self.replicas:
                nursery.start_soon(self._follow, replica)
            task_status.started()

    async def _follow(self, replica: Replica) -> None:
        assert self.client is not None
        await follow(replica, self.source, self.index, self.client,
                     lambda lost: self.replica_losses.labels(str(lost.replica_id)).inc())

    # -- proxying --------------------------------------------------------------------------------------

    async def proxy(self, path: str) -> Response:
        """Route and proxy one request (see the module docstring)."""
        assert self.client is not None
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        key = RoutingKey()
        routed = request.method == "POST" and path in GENERATION_ROUTES
        if routed:
            key = routing_key(path, _json_or_none(body), request.headers.get("X-Session-Id"), self.tokenizer,
                              self.block_size)
        refused: set[int] = set()
        while True:
            try:
                decision = self.policy.choose(key, [r.load for r in self.replicas if r.replica_id not in refused])
            except NoReplicaError:
                return error_response(unavailable("no replica is ready; retry later", "no_replica"))
            replica = self.replicas[decision.replica_id]
            generation, url = replica.generation, f"{replica.url}{path}"
            outgoing = self.client.build_request(request.method, url, params=request.query_string.decode(),
                                                 headers=headers, content=body)
            self._opened(replica)
            try:
                upstream = await replica.read(generation, functools.partial(self.client.send, outgoing, stream=True))
            except httpx.ConnectError:  # never reached the replica: try another
                self._closed(replica)
                refused.add(replica.replica_id)
                continue
            except (httpx.HTTPError, ReplicaLost, OSError) as error:
                self._closed(replica)
                return error_response(replica_failed(replica.replica_id, error))
            if routed:
                self.routed.labels(str(replica.replica_id), decision.reason).inc()
                self.blocks_requested.inc(len(key.block_hashes))
                self.blocks_matched.inc(decision.matched_blocks)
            return await self._respond(replica, generation, upstream)

    def _opened(self, replica: Replica) -> None:
        replica.load.in_flight += 1
        self.in_flight_gauge.labels(str(replica.replica_id)).set(replica.load.in_flight)

    def _closed(self, replica: Replica) -> None:
        replica.load.in_flight -= 1
        self.in_flight_gauge.labels(str(replica.replica_id)).set(replica.load.in_flight)

    async def _respond(self, replica: Replica, generation: int, upstream: httpx.Response) -> Response:
        headers = Headers([(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP])
        headers.add(REPLICA_HEADER, str(replica.replica_id))
        content_type = upstream.headers.get("content-type", "")
        if not content_type.startswith(STREAMING_TYPES):
            try:
                content = await replica.read(generation, upstream.aread)
            except (httpx.HTTPError, ReplicaLost, OSError) as error:
                return error_response(replica_failed(replica.replica_id, error))
            finally:
                await _close(upstream)
                self._closed(replica)
            return Response(content, status=upstream.status_code, headers=headers)
        ending = _Ending(self, replica, upstream)
        body = self._stream(replica, generation, upstream, ending, content_type.startswith("text/event-stream"))
        weakref.finalize(body, ending.abandoned).atexit = False  # Quart never started the body: client gone
        response = Response(body, status=upstream.status_code, headers=headers)
        response.timeout = None
        return response

    async def _stream(self, replica: Replica, generation: int, upstream: httpx.Response, ending: _Ending,
                      sse: bool) -> AsyncIterator[bytes]:
        """The replica's chunks as they come; if it is lost meanwhile, an SSE error event and ``[DONE]``.
        Yields outside any cancel scope (trio's rule for async generators)."""
        chunks = upstream.aiter_raw()
        failure: BaseException | None = None
        try:
            while True:
                try:
                    chunk = await replica.read(generation, chunks.__anext__)
                except StopAsyncIteration:
                    break
                except (httpx.HTTPError, ReplicaLost, OSError) as error:
                    failure = error
                    break
                yield chunk
            if failure is not None:
                log.warning("stream from replica %d broke: %r", replica.replica_id, failure)
                if sse:
                    yield event(replica_failed(replica.replica_id, failure).body()) + DONE
        finally:
            await ending.end()

@attrs.define(eq=False)
class _Ending:
    """Ends a streamed proxy exactly once: closes the upstream response and counts the request out."""

    front: Front
    replica: Replica
    upstream: httpx.Response
    done: bool = False

    async def end(self) -> None:
        if self.done:
            return
        self.done = True
        self.front._closed(self.replica)
        await _close(self.upstream)

    def abandoned(self) -> None:
        """The body was garbage-collected unread: end it from the front's nursery."""
        if not self.done and self.front.nursery is not None:
            self.front.nursery.start_soon(self.end)


async def _close(upstream: httpx.Response) -> None:
    with trio.move_on_after(CLOSE_TIMEOUT_SECONDS) as scope:
        scope.shield = True
        await upstream.aclose()


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload), status=status, content_type="application/json")


def error_response(error: ApiError) -> Response:
    return Response(error.json_bytes(), status=error.status, content_type="application/json",
                    headers=error.headers())
