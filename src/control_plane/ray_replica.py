"""Replicas as Ray core actors: one ``inference-server`` engine and HTTP server per actor, placed by Ray (one
GPU each, or CPUs), restarted by Ray when its process dies (``max_restarts``), killed for a restart when the
front finds it wedged.

Inside the actor the ordinary server (``inference_server.server.run_server``: the trio actors and
Hypercorn, unchanged) runs in a dedicated thread, started by the actor's constructor, which returns once
the server listens. The actor's Ray methods (``url``, ``ping``, ``stop``) run on Ray's own thread
and never enter trio; clients speak HTTP to the server directly (the front proxies to it). If the server
ends on its own (an engine failure: the server has already ended every request with an error), the
process exits, which Ray sees as a death and answers with a restart. Why a thread and not trio's guest
mode on Ray's asyncio loop: docs/control_plane.md ("Bridging trio and Ray").

A replica binds ``host`` on an ephemeral port (``127.0.0.1`` on a local Ray; ``0.0.0.0`` on a multi-node
cluster, advertised at the node's IP).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import attrs
import trio

from control_plane.replicas import ReplicaGone
from inference_server.config import Settings, env_name, load_settings
from inference_server.server import ThreadControls, run_server

log = logging.getLogger(__name__)

START_POLL_SECONDS = 0.5
STOP_SECONDS = 30.0
PING_SECONDS = 5.0
NODE_IP = "node-ip"  # ``advertise``: the IP of the node the actor landed on


def settings_overrides(settings: Settings) -> dict[str, str]:
    """Every setting as the environment string that gives it (to hand the driver's settings to replicas)."""
    values = {}
    for field in attrs.fields(Settings):
        value = getattr(settings, field.name)
        values[env_name(field)] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return values


class ReplicaServer:
    """The actor's body (``ray.remote`` wraps it in ``RayReplicas``; plain Python otherwise)."""

    def __init__(self, overrides: dict[str, str], host: str, advertise: str | None = None) -> None:
        logging.basicConfig(level=overrides.get("LOG_LEVEL", "info").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from inference_server.engine_factory import build_engine_parts

        settings = load_settings(overrides={**overrides, "HOST": host, "PORT": "0"}, dotenv_path=None)
        parts = build_engine_parts(settings).parts
        self._controls = ThreadControls()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, args=(parts, settings), name="inference-server",
                                        daemon=True)
        self._thread.start()
        while not self._controls.listening.wait(START_POLL_SECONDS):
            if not self._thread.is_alive():
                raise RuntimeError("the replica's server stopped during start-up (see its log)")
        url = self._controls.urls[0]
        if advertise == NODE_IP:
            import ray

            advertise = ray.util.get_node_ip_address()
        if advertise is not None:
            url = f"http://{advertise}:{url.rsplit(':', 1)[1]}"
        self._url = url
        log.info("replica serving at %s (pid %d)", url, os.getpid())

    def _serve(self, parts: Any, settings: Settings) -> None:
        code = run_server(parts, settings, controls=self._controls)
        if not self._stopping:  # the engine failed: die, so that Ray restarts the replica
            log.error("the replica's server ended (exit status %d): exiting for a restart", code)
            logging.shutdown()
            os._exit(1)

    def url(self) -> str:
        return self._url

    def ping(self) -> bool:
        """True while the server's event loop answers (Ray's call reaching us says the process lives)."""
        return self._thread.is_alive() and self._controls.responsive(PING_SECONDS)

    def stop(self) -> None:
        """Drain and stop the server (as SIGTERM does), waiting at most ``STOP_SECONDS``."""
        self._stopping = True
        self._controls.stop()
        self._thread.join(STOP_SECONDS)


class RayReplicas:
    """``count`` replica actors on the connected Ray cluster (``ray.init`` first), a ``ReplicaSource``."""

    def __init__(self, count: int, overrides: dict[str, str], *, num_gpus: float, num_cpus: float,
                 max_restarts: int = -1, host: str = "127.0.0.1", advertise_node_ip: bool = False,
                 health_timeout: float = 10.0, sequential: bool = False) -> None:
        """``sequential``: start each replica once the previous one serves (when they share a cache that
        the first start fills: the embedded model's assembled file and header index)."""
        import ray

        self.health_timeout = health_timeout
        actor_class = ray.remote(ReplicaServer)
        advertise = NODE_IP if advertise_node_ip else None
        self._options = dict(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=0,
                             max_concurrency=4)
        self.actors: list[Any] = []
        for _ in range(count):
            self.actors.append(actor_class.options(**self._options).remote(overrides, host, advertise))
            if sequential:
                ray.get(self.actors[-1].url.remote())

    @property
    def count(self) -> int:
        return len(self.actors)

    async def address(self, replica: int) -> str:
        """Waits while the actor starts or restarts; ``ReplicaGone`` once Ray gave up on it."""
        import ray

        while True:
            try:
                return str(await trio.to_thread.run_sync(ray.get, self.actors[replica].url.remote(),
                                                         abandon_on_cancel=True))
            except ray.exceptions.ActorDiedError as error:
                raise ReplicaGone(f"replica {replica} is dead: {error}") from error
            except ray.exceptions.RayActorError:  # restarting or unreachable for now
                await trio.sleep(1.0)

    async def failed(self, replica: int, reason: str) -> None:
        """The feed broke or fell silent: if the actor still answers and its server runs, the loss was
        the network's (reconnect); otherwise kill it so that Ray starts a fresh one."""
        import ray

        actor = self.actors[replica]
        alive = False
        with trio.move_on_after(self.health_timeout):
            try:
                alive = bool(await trio.to_thread.run_sync(ray.get, actor.ping.remote(), abandon_on_cancel=True))
            except ray.exceptions.RayActorError:
                alive = False
        if not alive:
            log.warning("replica %d unhealthy (%s): asking Ray to restart it", replica, reason)
            ray.kill(actor, no_restart=False)
        await trio.sleep(0.5)

    def shutdown(self) -> None:
        """Stop every replica (drain, then end its actor for good)."""
        import ray

        stops = [actor.stop.remote() for actor in self.actors]
        try:
            ray.get(stops, timeout=STOP_SECONDS + 5)
        except Exception as error:  # a dead or restarting replica: killing it below is enough
            log.info("stopping replicas: %r", error)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
