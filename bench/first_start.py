"""Time from launching ``inference-server serve`` to the first ``/ready`` 200: a first start (an empty cache
folder: the GGUF is assembled, its header parsed and indexed, the tokenizer converted and exported) and a later
start (everything cached). A benchmark, not a test: it prints the figures and the server's start-up phases.

    uv run python bench/first_start.py            # the embedded model; both starts
    uv run python bench/first_start.py --later-only

``XDG_CACHE_HOME`` points at a fresh temporary folder for the first start (``~/.cache/inference_server`` is
reused otherwise, which would make a "first" start a later one); the later start reuses that folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

START_LIMIT_SECONDS = 900


def time_to_ready(cache_home: Path, extra_env: dict[str, str]) -> tuple[float, list[str]]:
    """Seconds from launch to ``/ready`` 200, and the server's start-up log lines."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "PORT": "0", "DEVICE": "cpu", "LOG_LEVEL": "info",
           **extra_env}
    log_path = cache_home / f"server-{time.time_ns()}.log"
    started = time.perf_counter()
    with log_path.open("wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "inference_server", "serve"], env=env,
                                   stdout=subprocess.PIPE, stderr=log_file)
    try:
        assert process.stdout is not None
        url = None
        for raw in process.stdout:
            line = raw.decode()
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].strip()
                break
        if url is None:
            raise RuntimeError(f"the server did not start:\n{log_path.read_text()}")
        while time.perf_counter() - started < START_LIMIT_SECONDS:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        elapsed = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(30)
    launched = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.perf_counter() - started)))
    lines = [f"launched at {launched}"] + [line for line in log_path.read_text().splitlines()
                                           if "inference_server.startup" in line or "start-up phases" in line]
    return elapsed, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--later-only", action="store_true", help="only a start with the usual cache folder")
    args = parser.parse_args()
    if args.later_only:
        cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        seconds, lines = time_to_ready(cache_home, {})
        print(f"later start: {seconds:.1f} s to /ready", *lines, sep="\n  ")
        return
    with tempfile.TemporaryDirectory(prefix="first-start-") as folder:
        for label in ("first start (empty cache)", "later start (cached)"):
            seconds, lines = time_to_ready(Path(folder), {})
            print(f"{label}: {seconds:.1f} s to /ready", *lines, sep="\n  ")


if __name__ == "__main__":
    main()
