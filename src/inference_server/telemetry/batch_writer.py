"""A bounded hand-off from the telemetry actor to a writer thread that writes in batches.

``offer(item)`` is called in the telemetry actor's task: it appends to a deque (no lock, no wait) unless
``capacity`` items are already pending, in which case the item is dropped and counted. The writer thread
wakes every ``interval`` seconds, or as soon as ``batch_size`` items are pending, takes everything pending
and passes it to ``write(items)`` (one transaction, one file write). ``close()`` writes what is left and
joins the thread, so a clean shutdown loses nothing; a crash loses at most the items not yet written.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_CAPACITY = 65536
DEFAULT_BATCH_SIZE = 512
DEFAULT_INTERVAL = 0.5


class BatchWriter(Generic[T]):
    def __init__(self, write: Callable[[list[T]], None], *, name: str, capacity: int = DEFAULT_CAPACITY,
                 batch_size: int = DEFAULT_BATCH_SIZE, interval: float = DEFAULT_INTERVAL, start: bool = True) -> None:
        self._write = write
        self.name = name
        self.capacity = capacity
        self.batch_size = batch_size
        self.interval = interval
        self.dropped = 0
        self.written = 0
        self.batches = 0
        self.failed: BaseException | None = None
        self._pending: collections.deque[T] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._writing = False
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{name}", daemon=True)
        if start:
            self._thread.start()

    def offer(self, item: T) -> bool:
        """Queue ``item`` for the writer; False (and counted) when ``capacity`` items are pending."""
        if self._closing or len(self._pending) >= self.capacity or self.failed is not None:
            self.dropped += 1
            return False
        self._pending.append(item)
        if len(self._pending) >= self.batch_size:
            self._wake.set()
        return True

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def flush(self, timeout: float = 10.0) -> None:
        """Block until everything offered so far is written (tests and shutdown; never the event loop)."""
        with self._idle:
            self._wake.set()
            self._idle.wait_for(lambda: (not self._pending and not self._writing) or self.failed is not None, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is pending and join the writer thread (idempotent)."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._pending and self.failed is None:
            self._drain()  # never started: write in the caller's thread

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            closing = self._closing
            self._drain()
            if closing:
                return

    def _drain(self) -> None:
        while self._pending:
            self._writing = True
            items = [self._pending.popleft() for _ in range(min(len(self._pending), self.batch_size * 8))]
            try:
                self._write(items)
            except Exception as error:  # a full disk must not take the engine down: stop writing, count drops
                log.error("telemetry %s writer failed; dropping further items", self.name, exc_info=error)
                self.failed = error
                self.dropped += len(items) + len(self._pending)
                self._pending.clear()
            else:
                self.written += len(items)
                self.batches += 1
        with self._idle:
            self._writing = False
            self._idle.notify_all()
