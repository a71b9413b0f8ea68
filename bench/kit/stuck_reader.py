"""A client that opens a streamed response and never reads it, and how to tell that the server's writes to it
are stuck (its TCP window is full and the server has bytes it cannot send).

Used by ``fault_run.py`` (``--stuck-readers``: what a stop signal does with such clients) and the server's drain
tests. Blocking sockets and polling (no threads, no event loop), so a test or a script can use it alike.

Telling the server is stuck writes to us: on Linux, ``/proc/net/tcp`` (and ``tcp6``) show each socket's send
queue (bytes written by the process that the peer has not acknowledged): the server's side of our connection
holds bytes while our receive window is closed. The writes are stuck once that queue stops growing while the
server keeps producing tokens for us (``stuck_when``'s ``progress``: e.g. the server's generated-token count),
which a full socket buffer is the only reason for: an unblocked writer hands every new event to the kernel.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

SMALL_RCVBUF = 2048
"""Our receive buffer (the kernel doubles it): the window closes after a few events."""


class StuckReader:
    """One raw HTTP/1.1 connection that sends a streamed ``POST`` and then reads nothing until ``read_all``."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        parts = urlsplit(url)
        self.server = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.sock = socket.socket(socket.AF_INET6 if ":" in self.server[0] else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)  # before connect: sets the window
        self.sock.connect(self.server)
        self.port = self.sock.getsockname()[1]
        payload = json.dumps(body).encode()
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def read_all(self, timeout: float) -> tuple[bytes, str]:
        """Everything the server sent (kept in our socket or still coming), until the connection ends or
        ``timeout`` seconds pass; and how it ended: ``eof``, ``reset`` or ``timeout``."""
        self.sock.settimeout(timeout)
        received = bytearray()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                data = self.sock.recv(65536)
                if not data:
                    return bytes(received), "eof"
                received += data
        except ConnectionResetError:
            return bytes(received), "reset"
        except TimeoutError:
            pass
        return bytes(received), "timeout"

    def close(self) -> None:
        self.sock.close()


def server_send_queue(server_port: int, client_port: int) -> int | None:
    """Bytes the server's side of the loopback connection ``server_port`` <-> ``client_port`` holds unacknowledged
    (``/proc/net/tcp``'s ``tx_queue``); None where that is unknown (not Linux, or no such connection)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if (local_port, remote_port) == (server_port, client_port):
                return int(fields[4].split(":")[0], 16)
    return None


def stuck_when(readers: list[StuckReader], progress: Callable[[], float], *, min_progress: float,
               timeout: float, interval: float = 0.25) -> bool:
    """Wait until the server's send queue to every reader is non-empty and has not grown while ``progress()``
    (something the server produces for them, e.g. generated tokens) grew by ``min_progress``; False if that
    did not happen within ``timeout`` seconds or the send queues cannot be read (not Linux)."""
    deadline = time.monotonic() + timeout
    since: dict[int, tuple[int, float]] = {}  # reader port -> (its send queue, progress) when that was first seen
    while time.monotonic() < deadline:
        now = progress()
        stuck = 0
        for reader in readers:
            queued = server_send_queue(reader.server[1], reader.port)
            if queued is None:
                return False
            first = since.get(reader.port)
            if first is None or queued != first[0]:
                since[reader.port] = (queued, now)
            elif queued > 0 and now - first[1] >= min_progress:
                stuck += 1
        if stuck == len(readers):
            return True
        time.sleep(interval)  # a poll interval: the loop ends on the condition
    return False
