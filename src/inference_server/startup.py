"""Start-up phases a person can follow: each phase logs when it begins and how long it took, and shows its
progress: a bar redrawn in place when stderr is a terminal, a log line at each quarter otherwise (so a log
file or a CI job gets a few plain lines, never carriage returns).

``phase(name, total=..., unit=...)`` is a context manager yielding a ``Progress`` (``advance(n)``, or
``wrap(iterable)``); with no ``total`` the phase only reports its start and its time. Finished phases are
kept in order for ``summary()``, the one line that says where the start-up time went. Pure Python: no
package imports, so any layer may use it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO, TypeVar

log = logging.getLogger("inference_server.startup")

T = TypeVar("T")
BAR_WIDTH = 30
REDRAW_SECONDS = 0.1
"""Most one redraw of a terminal bar per this many seconds (the last one is always drawn)."""

_finished: list[tuple[str, float]] = []


class Progress:
    """Progress of one phase toward ``total`` items (see the module docstring)."""

    def __init__(self, name: str, total: int | None, unit: str, stream: IO[str] | None = None,
                 tty: bool | None = None) -> None:
        self.name, self.total, self.unit = name, total, unit
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._quarters_logged = 0
        self._drawn_at = -REDRAW_SECONDS
        self._drew = False

    def advance(self, count: int = 1) -> None:
        self.done += count
        if not self.total:
            return
        if self.tty:
            now = time.perf_counter()
            if now - self._drawn_at >= REDRAW_SECONDS or self.done >= self.total:
                self._drawn_at = now
                self._draw()
            return
        quarters = min(4, self.done * 4 // self.total)
        if quarters > self._quarters_logged:
            self._quarters_logged = quarters
            log.info("%s: %d%% (%d/%d %s)", self.name, quarters * 25, self.done, self.total, self.unit)

    def wrap(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, advancing by one as each is consumed."""
        for item in items:
            yield item
            self.advance()

    def _draw(self) -> None:
        assert self.total
        fraction = min(1.0, self.done / self.total)
        filled = int(fraction * BAR_WIDTH)
        self.stream.write(f"\r{self.name} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:4.0%} "
                          f"{self.done}/{self.total} {self.unit}")
        self.stream.flush()
        self._drew = True

    def close(self) -> None:
        if self._drew:
            self.stream.write("\n")
            self.stream.flush()


@contextmanager
def phase(name: str, *, total: int | None = None, unit: str = "items", stream: IO[str] | None = None,
          tty: bool | None = None) -> Iterator[Progress]:
    """Run one start-up phase: log its start, show its progress, log and record its time."""
    log.info("%s ...", name)
    started = time.perf_counter()
    progress = Progress(name, total, unit, stream, tty)
    try:
        yield progress
    except BaseException:
        progress.close()
        log.info("%s: failed after %.1f s", name, time.perf_counter() - started)
        raise
    progress.close()
    elapsed = time.perf_counter() - started
    _finished.append((name, elapsed))
    log.info("%s: done in %.1f s", name, elapsed)


def finished_phases() -> list[tuple[str, float]]:
    """This process's finished phases, in order, with their seconds."""
    return list(_finished)


def summary() -> str:
    """``name 1.2 s, name 0.3 s, ... (total 1.5 s)`` over the finished phases."""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in _finished)
    return f"{parts} (total {sum(seconds for _, seconds in _finished):.1f} s)"
