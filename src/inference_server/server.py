"""``inference-server serve``: the engine and Hypercorn in one ``trio.run``, with a signal-driven drain.

Start-up, in order: load the model and size the KV cache (``build_engine_parts``, before the event loop),
start the engine (every actor running), and only then bind the socket and serve HTTP; the listening URL is
printed (``inference-server listening on http://HOST:PORT``) and logged.

Shutdown on SIGTERM or SIGINT (exit status 0):

1. readiness turns 503 and new generation requests get 503 ``draining`` with ``Retry-After`` (the listener
   keeps accepting, so clients get a fast answer rather than a refused or hanging connection); from now on
   every response says ``Connection: close`` (``http/connection.py``), on connections kept alive from
   before the signal too, so clients that reuse connections (and load balancers' pools) open a fresh one
   for their next request instead of finding it closed when HTTP stops; ``/health`` answers 200 until then;
2. in-flight requests get ``SHUTDOWN_TIMEOUT`` seconds to finish (``Engine.drain``); what is left then ends
   with a terminal error event (streams: an error event and ``[DONE]``; others: 503 ``shutdown``; a request
   still in admission, never admitted: 503 ``unavailable``, as a request the drain refused);
3. responses get ``HTTP_FLUSH_SECONDS`` to write their last events; a response still open then is blocked
   writing to a client that stopped reading (its TCP window full), and its connection is closed (reset: the
   client sees its stream cut; ``hypercorn_serve.Connections.abort``). Hypercorn then stops: idle connections
   close at once, other requests get ``HYPERCORN_GRACEFUL_SECONDS`` to finish, and whatever connection is
   left then is closed too (``hypercorn_serve.serve_http``). Closing is the only way to end such a response:
   Hypercorn's socket writes are shielded from cancellation, so a client that does not read would otherwise
   hold the process until the watchdog;
4. a daemon watchdog thread ends the process with ``os._exit`` if it is still alive
   ``SHUTDOWN_TIMEOUT + HARD_EXIT_GRACE_SECONDS`` after the signal: the last resort (an event loop wedged in
   a call that never returns), not a step of a normal stop.

A second signal during the drain ends the in-flight requests at once; one that comes within
``DUPLICATE_SIGNAL_SECONDS`` of the first is the same stop delivered twice (a process-group signal also
forwarded by ``uv run``) and changes nothing. If the engine fails, every in-flight
request has already received a terminal error event (the supervisor's failure policy); the server then
stops the same way and exits with status 1.

**With ``ENGINE_PROCESS=separate``** (``run_split_server``) the engine runs in a child process
(``engine_process.py``) on a socketpair, and this process holds a ``RemoteEngine`` where it holds the ``Engine``
otherwise: the HTTP app, the stop sequence and the signals are the same. The child ignores SIGINT and SIGTERM, so
a signal to the process group stops the server once, through this process's drain (``Drain`` to the child, which
answers ``Stopped`` and exits 0). The child dying ends every open stream with an error event, turns ``/ready``
503 and stops the server with exit status 1; this process dying ends the child (its socket's EOF, and
``PR_SET_PDEATHSIG``). The child is reaped before ``run_split_server`` returns (killed if it has not exited
``HARD_EXIT_GRACE_SECONDS`` after the drain).

**In a thread other than the main one** (a replica inside a Ray actor, ``control_plane``): signal handlers
can only be installed in the main thread, so ``run_server(..., controls=ThreadControls())`` takes its
"signals" from ``ThreadControls.stop`` (callable from any thread; a second call acts as a second signal)
and reports the bound URLs through ``ThreadControls.listening``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

import trio
from hypercorn.config import Config

from inference_server.config import Settings
from inference_server.core.validation import PromptTokenizer
from inference_server.engine_spawn import DEFAULT_ENGINE_FACTORY, EngineChild, spawn_engine
from inference_server.engine_surface import ServingEngine
from inference_server.http import app_state, create_app
from inference_server.http.state import AppState
from inference_server.hypercorn_serve import Connections, serve_http
from inference_server.ipc.channel import open_socket_channel
from inference_server.ipc.messages import ENGINE_TO_FRONT
from inference_server.ipc.remote_engine import RemoteEngine
from inference_server.supervisor import Engine, EngineParts
from inference_server.telemetry.observability import Observability

log = logging.getLogger(__name__)

HTTP_FLUSH_SECONDS = 2.0
HYPERCORN_GRACEFUL_SECONDS = 2.0
HARD_EXIT_GRACE_SECONDS = 10.0
"""The watchdog's time past ``SHUTDOWN_TIMEOUT`` (and the engine process's, to exit once drained). A stop by the
stop sequence needs up to ``remote_engine.STOP_GRACE_SECONDS`` (3 s: a hung engine process) + ``HTTP_FLUSH_SECONDS`` +
``HYPERCORN_GRACEFUL_SECONDS`` past the drain's timeout, plus the teardown: the watchdog must not race it."""
DUPLICATE_SIGNAL_SECONDS = 1.0
"""A signal this soon after the first is the same stop delivered twice (see ``_watch_signals``)."""
EXIT_OK, EXIT_FAILED = 0, 1
T = TypeVar("T")
FRONT_CHANNEL_CAPACITY = 8
"""Messages the front buffers from the engine process (each a batch of steps' updates; docs/ipc.md, decision 3)."""


def serve(settings: Settings) -> int:
    """Load the model named by ``settings`` and serve it over HTTP until a signal; the process exit status."""
    if engine_process_mode(settings) == "separate":
        from inference_server.core.faults import parse_faults
        from inference_server.fault_injection import with_tokenizer_faults
        from inference_server.models.loading.source import load_tokenizer

        # The child loads the model while this process loads the tokenizer the HTTP layer uses; that one
        # tokenizes the prompts, so it is the one a tokenizer fault goes on.
        return run_split_server(settings, tokenizer=lambda: with_tokenizer_faults(load_tokenizer(settings),
                                                                                  parse_faults(settings.faults)))
    from inference_server.engine_factory import build_engine_parts

    built = build_engine_parts(settings)
    return run_server(built.parts, settings)


def engine_process_mode(settings: Settings) -> str:
    """``in-process`` or ``separate``: ``ENGINE_PROCESS``, with ``auto`` separate where the model runs on CUDA
    (the engine loop then has a core of its own; docs/benchmarks.md) and in-process elsewhere, where the model's own
    compute dwarfs the serving stack's and a second process would only add start-up time and memory."""
    if settings.engine_process != "auto":
        return settings.engine_process
    from inference_server.runtime import resolve_device  # torch: only when auto must look at the device

    return "separate" if resolve_device(settings).type == "cuda" else "in-process"


class ThreadControls:
    """Stop and readiness for a server run outside the main thread (see the module docstring)."""

    def __init__(self) -> None:
        self.listening = threading.Event()
        self.urls: list[str] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._send: trio.MemorySendChannel[int] | None = None

    def stop(self) -> None:
        """Like SIGTERM (again: like a second one); from any thread, never blocks; ignored before start."""
        token, send = self._token, self._send
        if token is not None and send is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(send.send_nowait, int(signal.SIGTERM))

    def responsive(self, timeout: float) -> bool:
        """Whether the server's event loop runs a callback within ``timeout`` seconds (a health probe from
        another thread: False when the loop is wedged or gone)."""
        token, answered = self._token, threading.Event()
        if token is None:
            return False
        try:
            token.run_sync_soon(answered.set)
        except trio.RunFinishedError:
            return False
        return answered.wait(timeout)

    def _open(self) -> trio.MemoryReceiveChannel[int]:
        self._send, receive = trio.open_memory_channel[int](math.inf)
        self._token = trio.lowlevel.current_trio_token()
        return receive

    def _listening(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self.listening.set()


def run_server(parts: EngineParts, settings: Settings, *, coalesce: bool = True,
               controls: ThreadControls | None = None) -> int:
    """Serve an engine built from ``parts`` (see the module docstring); 0 after a signal, 1 after an engine
    failure or when the address cannot be bound. ``controls``: run without signal handlers (any thread)."""
    exit_code = EXIT_FAILED
    try:
        exit_code = trio.run(_serve, parts, settings, coalesce, controls)
    except* OSError as errors:  # the address is in use, the host does not resolve, ...
        for error in _leaves(errors):
            log.error("cannot serve on %s:%s: %s", settings.host, settings.port, error)
    return exit_code


def run_split_server(settings: Settings, *, tokenizer: Callable[[], PromptTokenizer | None],
                     engine_factory: str = DEFAULT_ENGINE_FACTORY, coalesce: bool = True) -> int:
    """Serve with the engine in a child process (see the module docstring): spawn it (it builds its parts with
    ``engine_factory``, a ``module:function`` taking the settings), load the front's ``tokenizer()`` meanwhile,
    serve until a signal or the child's death, then reap the child. 0 after a signal and a clean drain, 1
    otherwise."""
    child = spawn_engine(settings, engine_factory)
    exit_code = EXIT_FAILED
    served = False
    try:
        front_tokenizer = tokenizer()
        served = True
        exit_code = trio.run(_serve_split, child, front_tokenizer, settings, coalesce)
    except* OSError as errors:
        for error in _leaves(errors):
            log.error("cannot serve on %s:%s: %s", settings.host, settings.port, error)
    finally:
        child.socket.close()  # the engine sees the front gone (if the channel did not close it already)
        if not served:
            child.process.kill()  # the front failed before serving (its tokenizer): nothing to drain
        status = child.reap(HARD_EXIT_GRACE_SECONDS)
        if status != 0 and served:
            exit_code = EXIT_FAILED
    return exit_code


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [leaf for error in group.exceptions
            for leaf in (_leaves(error) if isinstance(error, BaseExceptionGroup) else [error])]


class Shutdown:
    """Why and when the server stops: ``requested`` by a signal or an engine failure; ``http_may_stop``
    once in-flight work has drained (Hypercorn's shutdown trigger)."""

    def __init__(self) -> None:
        self.exit_code = EXIT_OK
        self.requested = trio.Event()
        self.http_may_stop = trio.Event()
        self.drain_scope = trio.CancelScope()  # cancelled by a second signal: stop waiting for requests

    def request(self, exit_code: int = EXIT_OK) -> None:
        self.exit_code = max(self.exit_code, exit_code)
        self.requested.set()


async def _serve(parts: EngineParts, settings: Settings, coalesce: bool, controls: ThreadControls | None) -> int:
    engine = Engine(parts)
    # Telemetry sinks go on before the engine starts; the file sinks are closed (flushed, writer threads
    # joined) after it stopped, whichever way it stopped.
    observability = Observability.attach(engine.telemetry, parts.model_name, settings)

    async def start(nursery: trio.Nursery, shutdown: Shutdown) -> Observability:
        await nursery.start(supervise_engine, engine, shutdown.request)
        return observability

    try:
        return await _serve_with(engine, start, settings, coalesce, controls)
    finally:
        observability.close()


async def _serve_split(child: EngineChild, tokenizer: PromptTokenizer | None, settings: Settings,
                       coalesce: bool) -> int:
    observability: Observability | None = None
    async with open_socket_channel(child.socket, FRONT_CHANNEL_CAPACITY, receive_type=ENGINE_TO_FRONT) as channel:
        remote = RemoteEngine(channel, max_queue_size=settings.max_queue_size, tokenizer=tokenizer)

        async def start(nursery: trio.Nursery, shutdown: Shutdown) -> Observability:
            nonlocal observability
            await nursery.start(supervise_remote_engine, remote, child, shutdown.request)
            # Attached once the engine said Hello (its model name labels the metrics); no request ran before.
            observability = Observability.attach(remote.telemetry, remote.info.model_name, settings)
            return observability

        try:
            return await _serve_with(remote, start, settings, coalesce, None)
        finally:
            if observability is not None:
                observability.close()


async def _serve_with(engine: ServingEngine,
                      start_engine: Callable[[trio.Nursery, Shutdown], Awaitable[Observability]],
                      settings: Settings, coalesce: bool, controls: ThreadControls | None) -> int:
    shutdown = Shutdown()
    with contextlib.ExitStack() as stack:
        async with trio.open_nursery() as nursery:
            observability = await start_engine(nursery, shutdown)
            # Signals are taken from here on: until the engine has started (a separate engine process loads its
            # model meanwhile, minutes on a GPU) SIGTERM and SIGINT stop the process as they do while the
            # in-process engine's model loads before trio starts (the engine process then dies with it).
            signals: AsyncIterator[int] = (
                stack.enter_context(trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)) if controls is None
                else controls._open())
            binds = await _serve_engine(engine, observability, settings, coalesce, shutdown, signals, nursery)
            if controls is not None:
                controls._listening(binds)
    return shutdown.exit_code


async def _serve_engine(engine: ServingEngine, observability: Observability, settings: Settings, coalesce: bool,
                        shutdown: Shutdown, signals: AsyncIterator[int], nursery: trio.Nursery) -> list[str]:
    app = create_app(engine, settings, coalesce=coalesce, observability=observability)
    _freeze_startup_heap()
    connections = Connections()
    nursery.start_soon(_watch_signals, signals, shutdown)
    nursery.start_soon(_stop_sequence, engine, app_state(app), settings, shutdown, connections)
    binds = await nursery.start(_serve_http, app, _hypercorn_config(settings), shutdown, connections,
                                nursery.cancel_scope)
    if engine.info.tokenizer_folder:
        print(f"inference-server tokenizer (for aiperf, lm-eval, transformers): {engine.info.tokenizer_folder}",
              flush=True)
    for bind in binds:
        print(f"inference-server listening on {bind}", flush=True)
        log.info("serving %s on %s", engine.info.model_name, bind)
    return list(binds)


def _freeze_startup_heap() -> None:
    """Move everything start-up built (the model's modules and parameters, tokenizer, app) out of the garbage
    collector's view: a full collection then scans only what serving allocates, instead of pausing every
    thread (the executor's too, through the GIL) to traverse the whole model each time a burst of requests
    allocates enough to trigger one (vLLM does the same after start-up)."""
    gc.collect()
    gc.freeze()


async def supervise_engine(engine: Engine, on_failure: Callable[[int], None], *,
                           task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED) -> None:
    """Run ``engine``; once it is started, a failure is logged and reported to ``on_failure(EXIT_FAILED)``
    instead of propagating (the engine has already ended every in-flight request with an error, and the HTTP
    side must stay up long enough to send those errors). A failure during start-up propagates."""
    started = _StartedFlag(task_status)
    try:
        await engine.run(task_status=started)  # type: ignore[arg-type]
    except Exception as error:
        if not started.done:
            raise
        log.error("the engine failed; in-flight requests were ended with an error", exc_info=error)
        on_failure(EXIT_FAILED)


async def supervise_remote_engine(remote: RemoteEngine, child: EngineChild, on_failure: Callable[[int], None], *,
                                  task_status: trio.TaskStatus[RemoteEngine] = trio.TASK_STATUS_IGNORED) -> None:
    """``supervise_engine`` for the engine process: run ``remote`` until the engine stops; once it is started,
    its death (or a stop that was no drain, or a failed one) is logged and reported to ``on_failure`` (every
    open request has then had its terminal update). A death during start-up propagates."""
    started = _StartedFlag(task_status)
    try:
        await remote.run(task_status=started)  # type: ignore[arg-type]
    except Exception as error:
        if not started.done:
            raise
        log.error("the engine process (pid %d) died; in-flight requests were ended with an error (%s)",
                  child.process.pid, child.status(), exc_info=error)
        on_failure(EXIT_FAILED)
        return
    if remote.failed:
        message = remote.stopped.message if remote.stopped is not None else "closed without stopping"
        log.error("the engine process failed: %s", message)
        on_failure(EXIT_FAILED)


class _StartedFlag(Generic[T]):
    """A ``task_status`` that remembers whether ``started`` was called."""

    def __init__(self, inner: trio.TaskStatus[T]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: T) -> None:
        self.done = True
        self.inner.started(value)


async def _serve_http(app: object, config: Config, shutdown: Shutdown, connections: Connections,
                      server_scope: trio.CancelScope, *,
                      task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Hypercorn until ``shutdown.http_may_stop``; then end the server's remaining tasks."""
    await serve_http(app, config, connections, shutdown_trigger=shutdown.http_may_stop.wait,  # type: ignore[arg-type]
                     task_status=task_status)
    server_scope.cancel()


async def _watch_signals(signals: AsyncIterator[int], shutdown: Shutdown) -> None:
    """The first signal starts the drain; a later one ends in-flight requests at once. A signal that comes
    within ``DUPLICATE_SIGNAL_SECONDS`` of the first is the same stop delivered twice, not a second one: a
    signal sent to the process group (``kill -TERM -- -PGID``, systemd's ``KillMode=control-group``) reaches
    the server directly and again forwarded by a parent such as ``uv run`` a few milliseconds later."""
    first_at: float | None = None
    async for signum in signals:
        name = signal.Signals(signum).name
        now = trio.current_time()
        if first_at is None:
            first_at = now
            log.info("%s: draining (new requests get 503; in-flight ones may finish)", name)
            shutdown.request()
        elif now - first_at < DUPLICATE_SIGNAL_SECONDS:
            log.info("%s again %.3f s after the first: the same stop, still draining", name, now - first_at)
        else:
            log.warning("%s again: ending in-flight requests now", name)
            shutdown.drain_scope.cancel()


async def _stop_sequence(engine: ServingEngine, state: AppState, settings: Settings, shutdown: Shutdown,
                         connections: Connections) -> None:
    """Steps 1-3 of the module docstring, once shutdown is requested."""
    await shutdown.requested.wait()
    _start_watchdog(settings.shutdown_timeout + HARD_EXIT_GRACE_SECONDS, shutdown)
    state.begin_drain()
    with shutdown.drain_scope:
        await engine.drain(settings.shutdown_timeout)
    await engine.drain(0)  # returns at once if drained; else (second signal) ends what is left now
    with trio.move_on_after(HTTP_FLUSH_SECONDS):
        await state.tracker.wait_idle()
    if state.tracker.active:
        # Every request has had its terminal update: a response still open is blocked writing to a client that
        # does not read (its TCP window is full), and no cancellation reaches that write (hypercorn_serve.py).
        closed = connections.abort(state.tracker.open_peers())
        log.warning("%d responses still open %g s after the drain (their clients stopped reading): closed %d "
                    "connections", state.tracker.active, HTTP_FLUSH_SECONDS, closed)
    shutdown.http_may_stop.set()


def _start_watchdog(seconds: float, shutdown: Shutdown) -> None:
    def hard_exit() -> None:
        time.sleep(seconds)
        log.error("still running %.0f s after shutdown began (stuck in a call that never returns?): exiting now",
                  seconds)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(shutdown.exit_code)

    threading.Thread(target=hard_exit, name="hard-exit-watchdog", daemon=True).start()


def _hypercorn_config(settings: Settings) -> Config:
    config = Config()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.graceful_timeout = HYPERCORN_GRACEFUL_SECONDS
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


__all__ = ["ThreadControls", "run_server", "run_split_server", "serve", "supervise_engine"]
