"""Serving the front: Hypercorn in our own ``trio.run`` beside the replica feeds, until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from control_plane.front import Front
from control_plane.front_app import create_front_app

log = logging.getLogger(__name__)

GRACEFUL_SECONDS = 2.0


def serve_front(front: Front, host: str, port: int, *, max_body_bytes: int | None = None) -> None:
    """Run the front on ``host:port`` until a signal (then in-flight proxies get ``GRACEFUL_SECONDS``)."""
    trio.run(_main, front, host, port, max_body_bytes)


async def _main(front: Front, host: str, port: int, max_body_bytes: int | None) -> None:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = GRACEFUL_SECONDS
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            app = create_front_app(front, max_body_bytes=max_body_bytes)
            binds = await nursery.start(_http, app, config, stop, nursery.cancel_scope)
            for bind in binds:
                print(f"control_plane front ({front.policy_name}) listening on {bind}", flush=True)
            nursery.start_soon(_report_ready, front)
            async for signum in signals:
                log.info("%s: stopping the front", signal.Signals(signum).name)
                stop.set()
                break


async def _http(app: object, config: Config, stop: trio.Event, done: trio.CancelScope, *,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Hypercorn until ``stop``; then everything else the front runs ends too."""
    await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)  # type: ignore[arg-type]
    done.cancel()


async def _report_ready(front: Front) -> None:
    while not all(r.healthy for r in front.replicas):
        await trio.sleep(0.5)
    print(f"control_plane: all {len(front.replicas)} replicas ready", flush=True)
