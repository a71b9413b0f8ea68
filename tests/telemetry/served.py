"""Start ``fake_server.py`` as a child process and find its URL (shared by the CLI and Prometheus tests)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kit.server_process import launched  # bench/, on sys.path through tests/conftest.py

START_TIMEOUT = 120.0
SCRIPT = Path(__file__).with_name("fake_server.py")


@contextmanager
def fake_server(env: dict[str, str], log_path: Path, step_seconds: float = 0.005,
                command: list[str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """``fake_server.py`` (or ``command``) with ``env``; yields the process and its URL, kills it at exit."""
    command = command or [sys.executable, str(SCRIPT), str(step_seconds)]
    with launched({"SHUTDOWN_TIMEOUT": "5", "LOG_LEVEL": "info", **env}, log_path, command=command,
                  start_timeout=START_TIMEOUT, stop_timeout=0) as (process, url):
        yield process, url
