"""One replica as the front sees it, and the task that follows its ``GET /kv/events`` feed.

The feed is the replica's health check and its load report as well as its cache index: while it is
connected and lines (at least a heartbeat a second) keep coming, the replica is healthy; its snapshot and
batches keep the ``PrefixIndex`` exact (a batch out of sequence reconnects for a fresh snapshot). When the
feed breaks or falls silent for ``SILENCE_SECONDS``, the replica turns unhealthy at once: it leaves the
index, its ``generation`` moves on and every proxied read from it is cancelled (those requests end with an
error at the front rather than hanging on a dead or wedged peer); the source is told (Ray restarts the
actor) and the task reconnects once the replica serves again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import httpx
import trio

from control_plane.prefix_index import PrefixIndex
from control_plane.replicas import ReplicaGone, ReplicaSource
from control_plane.router import ReplicaLoad
from inference_server.core.block_hashes import HASH_SCHEME

log = logging.getLogger(__name__)
T = TypeVar("T")

SILENCE_SECONDS = 10.0  # the feed sends a line at least every second; ten seconds without one: wedged
CONNECT_SECONDS = 10.0


class ReplicaLost(Exception):
    """The replica serving a proxied request went away."""


@attrs.define(eq=False)
class Replica:
    replica_id: int
    load: ReplicaLoad
    url: str | None = None
    block_size: int | None = None
    same_hashes: bool = True  # its HASH_SCHEME equals ours (else its hashes are not indexed)
    generation: int = 0  # moves on each time it is lost: reads of an older generation fail at once
    losses: int = 0  # times it went from healthy to lost
    reads: set[trio.CancelScope] = attrs.Factory(set)  # proxied reads in progress (cancelled when lost)

    @property
    def healthy(self) -> bool:
        return self.load.healthy

    def lose(self, index: PrefixIndex) -> None:
        """Unhealthy now: out of the index and of routing; in-flight reads end."""
        self.load.healthy = False
        self.generation += 1
        index.drop(self.replica_id)
        for scope in list(self.reads):
            scope.cancel()

    async def read(self, generation: int, receive: Callable[[], Awaitable[T]]) -> T:
        """``await receive()``, failing with ``ReplicaLost`` if the replica is (or gets) lost meanwhile."""
        if generation != self.generation:
            raise ReplicaLost(f"replica {self.replica_id} was lost")
        with trio.CancelScope() as scope:
            self.reads.add(scope)
            try:
                return await receive()
            finally:
                self.reads.discard(scope)
        raise ReplicaLost(f"replica {self.replica_id} was lost")


async def follow(replica: Replica, source: ReplicaSource, index: PrefixIndex, client: httpx.AsyncClient,
                 on_lost: Callable[[Replica], None] | None = None) -> None:
    """Keep ``replica``'s health, load and index entries current until cancelled (or until its source says it
    will not come back); ``on_lost`` is called each time it goes from healthy to lost."""
    while True:
        try:
            replica.url = await source.address(replica.replica_id)
        except ReplicaGone as error:
            log.error("replica %d will not come back: %s", replica.replica_id, error)
            return
        reason = "feed ended"
        try:
            if await _read_feed(replica, index, client):
                continue  # resynchronise: the replica is fine
        except (httpx.HTTPError, OSError, ValueError, trio.TooSlowError) as error:
            reason = f"{type(error).__name__}: {error}"
        was_healthy = replica.healthy
        replica.lose(index)
        if was_healthy:
            log.warning("replica %d (%s) lost: %s", replica.replica_id, replica.url, reason)
            replica.losses += 1
            if on_lost is not None:
                on_lost(replica)
        await source.failed(replica.replica_id, reason)


async def _read_feed(replica: Replica, index: PrefixIndex, client: httpx.AsyncClient) -> bool:
    """Follow the feed until it ends (False) or a batch comes out of sequence (True: reconnect)."""
    timeout = httpx.Timeout(CONNECT_SECONDS, read=SILENCE_SECONDS)
    async with client.stream("GET", f"{replica.url}/kv/events", timeout=timeout) as response:
        if response.status_code != 200:
            raise ValueError(f"/kv/events answered {response.status_code}")
        seq: int | None = None
        async for line in response.aiter_lines():
            if not line:
                continue
            seq = _apply(replica, index, json.loads(line), seq)
            if seq is None:
                return True  # a batch out of sequence: reconnect for a fresh snapshot
    return False


def _apply(replica: Replica, index: PrefixIndex, line: dict[str, Any], seq: int | None) -> int | None:
    """Apply one feed line; the last batch number applied (None: resynchronise)."""
    kind = line.get("event")
    if kind == "snapshot":
        replica.block_size = int(line["block_size"])
        replica.same_hashes = line.get("hash_scheme") == HASH_SCHEME
        if not replica.same_hashes:
            log.warning("replica %d hashes blocks differently (another Python build?): routing it by load only",
                        replica.replica_id)
        index.reset(replica.replica_id, line["hashes"] if replica.same_hashes else ())
        if not replica.healthy:
            log.info("replica %d serving at %s", replica.replica_id, replica.url)
        replica.load.healthy = True
        return int(line["seq"])
    if seq is None:
        return None
    if kind == "kv":
        number = int(line["seq"])
        if number <= seq:
            return seq  # already in the snapshot
        if number != seq + 1:
            log.info("replica %d: kv batch %d after %d (lost batches): resynchronising", replica.replica_id,
                     number, seq)
            return None
        if replica.same_hashes:
            index.apply(replica.replica_id, line["stored"], line["removed"])
        return number
    if kind == "load":
        replica.load.waiting = int(line["waiting"])
        replica.load.running = int(line["running"])
        replica.load.kv_usage = float(line["kv_usage"])
    return seq
