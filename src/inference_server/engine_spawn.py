"""The front's side of the engine process's life: spawn it on a socketpair, reap it (``ENGINE_PROCESS=separate``).

``spawn_engine(settings, factory)`` makes a connected pair of Unix stream sockets, starts
``python -m inference_server.engine_process`` with one end inherited (``pass_fds``) and closes this process's
copy of that end at once: otherwise the child's death would never read as an EOF here. The child's standard
output goes to this process's standard error (the front's standard output carries the ``listening on`` line a
supervisor may parse); its log lines go to the same standard error, marked ``[engine]``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys

import attrs

from inference_server.config import Settings

log = logging.getLogger(__name__)

DEFAULT_ENGINE_FACTORY = "inference_server.engine_factory:engine_parts"
"""What the engine process builds its ``EngineParts`` with: the model the settings name (tests and the HTTP
overhead benchmark pass their own ``module:function``)."""


@attrs.define(eq=False)
class EngineChild:
    """A spawned engine process and this process's end of its socket."""

    process: subprocess.Popen[bytes]
    socket: socket.socket

    def status(self) -> str:
        """How the child ended (or that it runs), for logs."""
        code = self.process.poll()
        if code is None:
            return "still running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def reap(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the child to exit, SIGKILL it if it has not; its exit status."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("the engine process (pid %d) did not exit %.0f s after the front stopped: killing it",
                      self.process.pid, timeout)
            self.process.kill()
            code = self.process.wait()
        if code != 0:
            log.error("the engine process (pid %d) ended: %s", self.process.pid, self.status())
        return code


def _stderr_fd() -> int | None:
    """This process's standard error as a descriptor for the child's standard output (None: inherit stdout,
    when standard error is no file, e.g. captured)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def spawn_engine(settings: Settings, factory: str = DEFAULT_ENGINE_FACTORY) -> EngineChild:
    """Start the engine process for ``settings`` (see the module docstring)."""
    front_end, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        command = [sys.executable, "-m", "inference_server.engine_process", "--channel-fd", str(engine_end.fileno()),
                   "--settings", json.dumps(attrs.asdict(settings)), "--engine-factory", factory,
                   "--front-pid", str(os.getpid())]
        process = subprocess.Popen(command, pass_fds=(engine_end.fileno(),), stdin=subprocess.DEVNULL,
                                   stdout=_stderr_fd())
    except BaseException:
        front_end.close()
        raise
    finally:
        engine_end.close()  # the child holds its own copy: its death is then an EOF here
    log.info("engine process started (pid %d)", process.pid)
    return EngineChild(process, front_end)
