"""Start ``fake_server.py`` as a child process and find its URL (shared by the CLI and Prometheus tests)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT = 120.0
SCRIPT = Path(__file__).with_name("fake_server.py")


@contextmanager
def fake_server(env: dict[str, str], log_path: Path, step_seconds: float = 0.005,
                command: list[str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """``fake_server.py`` (or ``command``) with ``env``; yields the process and its URL, kills it at exit."""
    command = command or [sys.executable, str(SCRIPT), str(step_seconds)]
    full_env = {**os.environ, "HOST": "127.0.0.1", "PORT": "0", "SHUTDOWN_TIMEOUT": "5", "LOG_LEVEL": "info", **env}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, env=full_env,
                                   stdout=subprocess.PIPE, stderr=log_file)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.decode()) for line in process.stdout], daemon=True).start()
    url = None
    deadline = time.monotonic() + START_TIMEOUT
    while url is None and time.monotonic() < deadline and process.poll() is None:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].strip()
    try:
        if url is None:
            raise RuntimeError(f"the fake server did not start:\n{log_path.read_text()}")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
