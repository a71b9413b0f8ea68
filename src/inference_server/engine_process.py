"""The engine process of ``ENGINE_PROCESS=separate``: the engine's actors and the model, serving one front over
the Unix socket it inherited (docs/ipc.md, "The engine split").

Run by the front (``engine_spawn.py``) as ``python -m inference_server.engine_process --channel-fd N --settings
JSON --engine-factory module:function --front-pid PID`` with its socket end in ``pass_fds`` and the front's
``Settings`` as JSON. In order:

1. SIGINT and SIGTERM are ignored, first thing, before torch is imported: signals belong to the front, which
   drains the engine with a ``Drain`` message; a signal sent to the process group (``systemctl stop``,
   ``kill -TERM -- -PGID``, Ctrl-C) therefore reaches the engine only as the front's ``Drain``.
2. On Linux the kernel is asked to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``): the
   socket's EOF ends an engine that runs its loop, this ends one wedged in a device call, so no engine outlives
   its front holding GPU memory. A front that died before the death signal was set (this process is then
   someone else's child already) ends this process at once.
3. The engine parts are built by the factory (default: ``engine_factory.engine_parts``, as the in-process server
   builds them; tests and the HTTP overhead benchmark pass their fake step), the
   channel is opened on the inherited descriptor and ``serve_engine`` serves until the engine stops.

Exit status: 0 after a clean stop (a drain), 1 after an engine failure or a failed start-up (the front sees
the channel close without a ``Hello`` and fails too).
"""

from __future__ import annotations

import signal

# Before anything slow is imported: a group signal during start-up must not kill the engine either.
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from inference_server.config import Settings, SettingsError  # noqa: E402  (pure Python: no torch, no trio)

if TYPE_CHECKING:
    from inference_server.supervisor import EngineParts

PR_SET_PDEATHSIG = 1
CHANNEL_CAPACITY = 16
"""Messages the engine buffers from the front (each a batch of submits and aborts; docs/ipc.md, decision 3)."""
GC_YOUNG_THRESHOLD = 10_000
"""Net allocations of tracked objects that start a young collection in this process (CPython's default: 700)."""
EXIT_OK, EXIT_FAILED = 0, 1

log = logging.getLogger("inference_server.engine_process")


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when its parent exits (Linux ``prctl``); False where unsupported.
    A parent that died before the call (this process was reparented already) ends this process now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os._exit(EXIT_FAILED)  # the front died while this process started: nobody would ever drain it
    return armed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inference_server.engine_process", description=__doc__)
    parser.add_argument("--channel-fd", type=int, required=True, help="the inherited socket end")
    parser.add_argument("--settings", required=True, help="the front's Settings as JSON")
    parser.add_argument("--front-pid", type=int, default=None, help="the front's pid (default: the parent now)")
    parser.add_argument("--engine-factory", default="inference_server.engine_factory:engine_parts",
                        help="module:function building the EngineParts from the Settings (tests, benchmarks)")
    args = parser.parse_args(argv)
    die_with_parent(args.front_pid if args.front_pid is not None else os.getppid())
    settings = Settings(**json.loads(args.settings))
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    sock = socket.socket(fileno=args.channel_fd)
    try:
        return serve_settings(settings, sock, args.engine_factory)
    except SettingsError as error:  # a setting the device or the model refuses: its message says which
        log.error("%s", error)
        return EXIT_FAILED
    except Exception:
        log.exception("the engine process failed")
        return EXIT_FAILED


def settle_heap() -> None:
    """Freeze what start-up built, as the in-process server does (``server._freeze_startup_heap``: full
    collections skip the model), and raise the young generation's threshold to ``GC_YOUNG_THRESHOLD``: each
    step allocates a burst of short-lived records (a token, an update, a sequence per request) that refcounting
    frees before the next step, and at CPython's 700 those bursts alone started a young collection every few
    steps, each traversing the step's live lists; the engine's loop makes almost no cyclic garbage."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def serve_settings(settings: Settings, sock: socket.socket, factory: str) -> int:
    """Build the engine's parts with ``factory(settings)`` (``module:function``) and serve them on ``sock``
    until the engine stops; the exit status."""
    import importlib

    import trio

    from inference_server.ipc.channel import open_socket_channel
    from inference_server.ipc.engine_server import serve_engine
    from inference_server.ipc.messages import FRONT_TO_ENGINE
    from inference_server.supervisor import Engine
    from inference_server.telemetry import profiler_ranges

    module, _, function = factory.partition(":")
    try:
        parts: EngineParts = getattr(importlib.import_module(module), function)(settings)
    except BaseException:
        sock.close()  # the front sees the close before any Hello: a failed start
        raise
    engine = Engine(parts)
    if settings.timeline_dir:
        profiler_ranges.enable(True)  # the step phases' profiler ranges are per process (the front writes the file)
    settle_heap()

    async def serve() -> bool:
        async with open_socket_channel(sock, CHANNEL_CAPACITY, receive_type=FRONT_TO_ENGINE) as channel:
            return await serve_engine(engine, channel)

    failed = trio.run(serve)
    log.info("the engine process exits (%s)", "failed" if failed else "drained")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
