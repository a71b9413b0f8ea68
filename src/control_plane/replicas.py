"""Where the front finds its replicas: a fixed list of URLs, or Ray actors (``ray_replica.py``).

A source answers ``address(i)`` (waiting while replica ``i`` starts or restarts) and is told when the front
finds replica ``i`` unhealthy (``failed(i)``), so a source that can restart replicas does.
"""

from __future__ import annotations

from typing import Protocol

import trio


class ReplicaGone(RuntimeError):
    """A replica that will not come back (its restarts are spent): the front stops waiting for it."""


class ReplicaSource(Protocol):
    @property
    def count(self) -> int: ...

    async def address(self, replica: int) -> str:
        """The base URL of replica ``replica`` once it serves (waits while it starts or restarts)."""
        ...

    async def failed(self, replica: int, reason: str) -> None:
        """The front lost replica ``replica`` (feed broken or silent): restart it if possible."""
        ...


class StaticReplicas:
    """Replicas started elsewhere (``inference-server serve`` processes, another scheduler's pods): the
    front only routes to them; a lost one is retried every ``retry_seconds``."""

    def __init__(self, urls: list[str], retry_seconds: float = 1.0) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.retry_seconds = retry_seconds

    @property
    def count(self) -> int:
        return len(self.urls)

    async def address(self, replica: int) -> str:
        return self.urls[replica]

    async def failed(self, replica: int, reason: str) -> None:
        await trio.sleep(self.retry_seconds)
