"""Start a server as a child process and learn its URL from the line it prints, ``... listening on URL``.

One launch-and-wait loop for the benchmark drivers (``serving_table.py``) and the tests that run a real server
(``tests/telemetry/served.py``, ``tests/test_http/test_serve_process.py``, ``tests/test_bench``). stdout is read
by a daemon thread (so a chatty server never blocks on a full pipe); stderr goes to a log file.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

SERVE_COMMAND = [sys.executable, "-m", "inference_server", "serve"]


class ServerDidNotStart(RuntimeError):
    """The process exited, or printed no URL within the timeout; the message ends with its log."""


def wait_for_url(process: subprocess.Popen[bytes], timeout: float) -> str | None:
    """The URL from the first ``listening on URL`` line of ``process``'s stdout, or ``None`` if it exits or
    ``timeout`` seconds pass first. Keeps draining stdout afterwards."""
    assert process.stdout is not None
    stdout = process.stdout
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:
        for line in stdout:
            lines.put(line.decode(errors="replace"))

    threading.Thread(target=drain, daemon=True).start()
    return url_from_lines(lines, process, timeout)


def url_from_lines(lines: queue.Queue[str], process: subprocess.Popen[bytes], timeout: float) -> str | None:
    """The URL of the first ``listening on URL`` line put on ``lines`` (by a thread reading the server's
    stdout), or ``None`` if ``process`` exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if "listening on " in line:
            return line.split("listening on ", 1)[1].strip()
    return None


def wait_until_ready(url: str, timeout: float, process: subprocess.Popen[bytes] | None = None) -> bool:
    """Poll ``GET url/ready`` until it answers 200 (the model is loaded and warm), ``process`` exits or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as response:
                if response.status == 200 and json.loads(response.read()).get("status") == "ready":
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.2)
    return False


@contextmanager
def launched(env: Mapping[str, str], log_path: Path, *, command: list[str] | None = None, cwd: Path | None = None,
             start_timeout: float = 120.0, ready_timeout: float = 0.0,
             stop_timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``command`` (default: ``python -m inference_server serve``) with ``os.environ`` updated by ``env``
    plus ``HOST=127.0.0.1`` and ``PORT=0`` unless ``env`` sets them; yield the process and its URL. With
    ``ready_timeout`` > 0, also wait for ``/ready`` to answer 200. At exit: SIGTERM, then SIGKILL after
    ``stop_timeout`` seconds (0: kill at once)."""
    full_env = {**os.environ, "HOST": "127.0.0.1", "PORT": "0", **env}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command or SERVE_COMMAND, env=full_env, cwd=cwd, stdout=subprocess.PIPE,
                                   stderr=log_file)
    try:
        url = wait_for_url(process, start_timeout)
        if url is None:
            exited = process.poll()
            why = f"exited (status {exited}) before it was listening" if exited is not None \
                else f"did not start within {start_timeout:.0f} s"
            raise ServerDidNotStart(f"the server {why}:\n{log_path.read_text(errors='replace')[-4000:]}")
        if ready_timeout and not wait_until_ready(url, ready_timeout, process):
            raise ServerDidNotStart(f"{url}/ready did not answer 200 within {ready_timeout:.0f} s:\n"
                                    f"{log_path.read_text(errors='replace')[-4000:]}")
        yield process, url
    finally:
        stop(process, stop_timeout)


def stop(process: subprocess.Popen[bytes], timeout: float) -> None:
    if process.poll() is None and timeout > 0:
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout)
    if process.poll() is None:
        process.kill()
        process.wait(30)
