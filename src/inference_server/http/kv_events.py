"""``GET /kv/events``: the prefix cache's block hashes as a live NDJSON feed, for a multi-replica router.

Lines (one JSON object each):

* ``{"event": "snapshot", "seq": S, "block_size": B, "hash_scheme": H, "hashes": [...]}`` first, and again
  whenever the feed lost events: every chained block hash cached now (``core/block_hashes.py``; ``H`` is the
  producer's ``HASH_SCHEME`` probe, which a consumer compares with its own);
* ``{"event": "kv", "seq": n, "stored": [...], "removed": [...]}`` for each step that changed the cache. A
  consumer applies the batches with ``seq > S`` in order (set add / discard) and skips the others; that
  keeps its copy exact (``core/kv_events.py``). A ``seq`` that skips a number means a batch was lost: the
  next snapshot (sent here as soon as the loss is seen) repairs it;
* ``{"event": "load", "waiting": w, "running": r, "kv_usage": u}`` with the latest step's figures, in each
  chunk that follows steps and at least every ``HEARTBEAT_SECONDS`` (so a reader also learns that the
  replica is alive when it is idle).

The snapshot is taken after subscribing, so every batch after its ``seq`` reaches the feed (or is counted as
lost). In one process no checkpoint separates the two; with a separate engine process (``ENGINE_PROCESS``) a
batch already in the snapshot may reach the feed after it, which the consumer's rule above skips.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Response

from inference_server.actors.telemetry import Subscription
from inference_server.core.block_hashes import HASH_SCHEME
from inference_server.engine_surface import ServingEngine
from inference_server.http.sse import dumps
from inference_server.http.state import AppState
from inference_server.telemetry.events import KVBlocksChanged, StepCompleted

FEED_CAPACITY = 4096
HEARTBEAT_SECONDS = 1.0
MAX_EVENTS_PER_CHUNK = 256
NDJSON_CONTENT_TYPE = "application/x-ndjson"


class KVEventRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def events(self) -> Response:
        """``GET /kv/events``: a snapshot, then the cache's changes and the load, until the client leaves."""
        engine = self.state.engine
        subscription = engine.telemetry.subscribe(FEED_CAPACITY)
        first = await _snapshot_line(engine)  # subscribed first: no batch after the snapshot can be missed
        response = Response(_feed(engine, subscription, first), content_type=NDJSON_CONTENT_TYPE,
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response.timeout = None  # type: ignore[assignment]
        return response


async def _snapshot_line(engine: ServingEngine) -> bytes:
    snapshot = await engine.read_kv_cache_snapshot()
    return _line({"event": "snapshot", "seq": snapshot.seq, "block_size": snapshot.block_size,
                  "hash_scheme": HASH_SCHEME, "hashes": list(snapshot.hashes)})


async def _feed(engine: ServingEngine, subscription: Subscription, first: bytes) -> AsyncIterator[bytes]:
    """The feed's chunks; yields outside any cancel scope (trio's rule for async generators) and
    unsubscribes in ``finally``."""
    load: dict[str, Any] = {"event": "load", "waiting": 0, "running": 0, "kv_usage": 0.0}
    lost = 0
    try:
        yield first
        while True:
            events: list[object] = []
            with trio.move_on_after(HEARTBEAT_SECONDS):
                events.append(await subscription.receive())
            while events and len(events) < MAX_EVENTS_PER_CHUNK:
                try:
                    events.append(subscription.receive_nowait())
                except trio.WouldBlock:
                    break
            lines = []
            for event in events:
                if isinstance(event, KVBlocksChanged):
                    lines.append(_line({"event": "kv", "seq": event.seq, "stored": list(event.stored),
                                        "removed": list(event.removed)}))
                elif isinstance(event, StepCompleted):
                    load.update(waiting=event.num_waiting, running=event.num_running, kv_usage=event.kv_usage)
            if subscription.dropped > lost:  # batches may be missing: a fresh snapshot repairs the copy
                lost = subscription.dropped
                lines.append(await _snapshot_line(engine))
            lines.append(_line(load))
            yield b"".join(lines)
    except (trio.EndOfChannel, trio.ClosedResourceError):
        return  # the engine stopped: the feed ends
    finally:
        subscription.close()


def _line(payload: dict[str, Any]) -> bytes:
    return dumps(payload).encode() + b"\n"
