"""The supervisor: the only place that opens the engine nursery and creates the actors' channels.

Start order is dependency order (telemetry, executor, KV allocator, scheduler, admission); each actor is
started with ``nursery.start`` so the engine reports ready only once every actor runs, and only once the grammar
compiler's tokenizer is built (``GrammarCompiler.ensure_tokenizer``: no request ever pays for it). Shutdown is by
closing: ``close`` closes the admission inbox, each actor finishes its work and closes the channels it
sends on, and the chain winds down. ``drain`` bounds that with a timeout, after which what is left is
cancelled and ended with a terminal event.

Failure policy: if any actor raises, the nursery cancels the rest; every in-flight request then receives a
terminal error event, the state turns ``FAILED`` (readiness 503), and the error propagates out of ``run`` as
an ``ExceptionGroup`` for the entry point to handle.

The client boundary: ``submit`` returns a ``RequestHandle`` (``actors/request_handle.py``); callers read
``info`` and ``failed`` and never reach into the actors. ``check_integrity`` asserts that an idle engine holds
no requests, no stream entries and no KV blocks beyond the prefix cache (tests call it after every run).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from inference_server.actors.admission import Admission, Submission
from inference_server.actors.executor import Drain, Executor, StepFunction, StepPipeline, as_pipeline
from inference_server.actors.kv_allocator import KVAllocator
from inference_server.actors.request_handle import RequestHandle
from inference_server.actors.request_streams import RequestStreams
from inference_server.actors.scheduler import SchedulerActor
from inference_server.actors.telemetry import Telemetry
from inference_server.core.block_pool import BlockPool
from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.core.kv_grants import StepDemand, StepGrant, allocate_step
from inference_server.core.kv_manager import KVManager
from inference_server.core.policies import make_policy
from inference_server.core.request import Request
from inference_server.core.scheduler import Scheduler, SchedulerConfig
from inference_server.core.validation import KVLimits, PromptTokenizer
from inference_server.records.errors import RequestError
from inference_server.records.requests import Abort, GenerationRequest, Rejected
from inference_server.records.steps import StepPlan, StepResult
from inference_server.telemetry.events import RequestRejected

COMPILE_TIMEOUT = 10.0
"""Seconds a request's constraint may take to compile before it is refused (400)."""


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


@attrs.frozen
class EngineInfo:
    """What callers may know about the served model (read-only)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: PromptTokenizer | None
    eos_token_ids: frozenset[int]
    default_max_tokens: int | None = None
    """Output cap of a request that sets no ``max_tokens`` (``None``: the rest of the context)."""
    model_root: str = ""
    """Where the model came from (a checkpoint folder, a .gguf file or a preset name)."""
    tokenizer_folder: str = ""
    """The served tokenizer exported as a Hugging Face folder (empty: none)."""


@attrs.frozen
class EngineCounts:
    """What the engine holds right now (all zero when idle, except the prefix cache's blocks)."""

    requests: int  # waiting or running in the scheduler
    stream_entries: int  # callers with a live stream
    kv_sequences: int  # sequences holding KV blocks
    kv_blocks_in_use: int  # blocks referenced by sequences (both groups)
    kv_blocks_cached: int  # blocks kept only by the prefix cache (reusable, evictable)


@attrs.frozen
class KVCacheSnapshot:
    """Every block hash in the prefix cache now, and the last ``KVBlocksChanged`` batch already reflected:
    applying the batches numbered after ``seq`` in order keeps a copy exact (``core/kv_events.py``)."""

    seq: int
    block_size: int
    hashes: tuple[int, ...]


@attrs.frozen
class EngineParts:
    """Everything the actors own, built (model loaded, KV sized) before the nursery opens."""

    step: StepFunction | StepPipeline
    """The model: a ``RunnerPipeline`` over a model runner, or an in-loop step function (tests, fakes)."""
    kv: KVManager
    tokenizer: PromptTokenizer | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    scheduler_config: SchedulerConfig
    scheduling_policy: str = "fcfs"
    max_queue_size: int = 1024
    max_queued_tokens: int = 1_000_000
    admission_timeout: float = 60.0
    model_name: str = "model"
    default_max_tokens: int | None = None
    """``DEFAULT_MAX_TOKENS``: admission caps a request without ``max_tokens`` at this many tokens (never more
    than the rest of the context); ``None``: the rest of the context."""
    model_root: str = ""
    tokenizer_folder: str = ""
    allocate: Callable[[KVManager, StepDemand], StepGrant] = allocate_step  # FAULTS may wrap it
    overlap: bool = True
    """``OVERLAP``: launch step N+1 before collecting step N (``actors/executor.py``)."""
    stream_interval: int = 1
    """``STREAM_INTERVAL``: tokens per stream update after the first (see ``actors/request_streams.py``)."""
    stream_interval_ms: float = 100.0
    """``STREAM_INTERVAL_MS``: the longest a token is held back by the stream interval."""
    grammar: GrammarCompiler | None = None
    """Compiles structured-output constraints (None: the engine refuses them, e.g. without a tokenizer)."""


def kv_limits(parts: EngineParts) -> KVLimits:
    """What one request alone can hold in ``parts.kv`` (admission refuses what could never fit)."""
    kv, config = parts.kv, parts.scheduler_config
    chunked = config.prefill_mode == "chunked"
    return KVLimits(block_size=kv.block_size, full_blocks=kv.full_pool.num_blocks,
                    sliding_blocks=kv.sliding_pool.num_blocks if kv.sliding_pool is not None else 0,
                    sliding_window=kv.sliding_window,
                    max_step_tokens=config.prefill_step_tokens if chunked else None)


def _referenced_cached(pool: BlockPool) -> int:
    return sum(1 for b in range(pool.num_blocks) if pool.is_cached(b) and pool.refcount(b) > 0)


class Engine:
    """The running engine: ``submit`` requests, read their streams, ``close``/``drain`` to stop."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.state = EngineState.STARTING
        self.streams = RequestStreams(interval_tokens=parts.stream_interval,
                                      max_hold=parts.stream_interval_ms / 1000)
        self.telemetry = Telemetry()
        self.scheduler = Scheduler(parts.scheduler_config, make_policy(parts.scheduling_policy))
        self.failure: BaseException | None = None
        self._ids = itertools.count(1)
        self._admission_send: trio.MemorySendChannel[Submission] | None = None
        self._abort_send: trio.MemorySendChannel[Abort] | None = None
        self._pipeline_scope: trio.CancelScope | None = None
        self._stopped = trio.Event()
        self._shutdown_message: str | None = None
        self.scheduler_actor: SchedulerActor | None = None
        self.executor: Executor | None = None
        self.text_in_front = False
        """Set before ``run`` by the engine process (``ipc/engine_server.py``): its front detokenises and
        matches stop strings, so admission gives requests neither (updates carry empty text)."""
        self.before_plan: Callable[[], Awaitable[None]] | None = None
        """Set before ``run`` by the engine process: the scheduler awaits it before each plan (``SchedulerActor``'s
        output backpressure); None in process (the streams coalesce for a slow reader instead)."""

    # -- client API ----------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request and return its handle (see ``RequestHandle``); a refusal (overloaded,
        unavailable, invalid) is raised by the handle's ``admission()``. Never blocks."""
        request_id = next(self._ids)
        handle = RequestHandle(request_id, self.streams.open(request_id), self._client_left)
        if self.state is not EngineState.READY or self._admission_send is None:
            self.streams.reject(request_id, Rejected("unavailable", f"the engine is {self.state.value}"))
            return handle
        try:
            self._admission_send.send_nowait(Submission(request_id, request, trio.current_time()))
        except trio.WouldBlock:
            self.streams.reject(request_id, Rejected("overloaded", "the admission queue is full; retry later",
                                                     retry_after=1.0))
            self.telemetry.emit(RequestRejected(trio.current_time(), "overloaded", "admission queue full",
                                                request.trace_id))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self.streams.reject(request_id, Rejected("unavailable", "the engine is shutting down"))
        return handle

    async def compile_constraints(self, requests: Sequence[GenerationRequest]) -> None:
        """Compile the requests' structured-output constraints in a worker thread (each distinct one once,
        cached), within ``COMPILE_TIMEOUT`` seconds; raises ``RequestError`` naming the field of an invalid
        or too slow one. Call it before ``submit``: admission then finds them compiled."""
        grammar = self.parts.grammar
        pending = {r.params.constraint for r in requests if r.params.constraint is not None}
        for constraint in pending:
            if grammar is None:
                raise RequestError("invalid_request", f"{constraint.field}: structured outputs are not available "
                                   "on this server", constraint.field)
            if grammar.cached(constraint):
                continue
            with trio.move_on_after(COMPILE_TIMEOUT) as scope:
                await trio.to_thread.run_sync(grammar.compile, constraint, abandon_on_cancel=True)
            if scope.cancelled_caught:
                raise RequestError("invalid_request", f"{constraint.field}: the constraint did not compile within "
                                   f"{COMPILE_TIMEOUT:g} s", constraint.field)

    def cached_prompt_tokens(self, request_id: int) -> int:
        """Prompt tokens of a running request that its prefix cache hit covered (0 once it ended)."""
        request = self.scheduler.requests.get(request_id)
        return 0 if request is None else request.num_cached_prompt_tokens

    def end_on_stop(self, request_id: int) -> None:
        """A separate front matched a stop string (docs/ipc.md, decision 1): end the request with the
        scheduler's next look at its aborts, finished by ``stop`` (what its telemetry counts). Its stream stays
        open until then, so the steps before still deliver (the front drops them) and the terminal update
        goes out as for any finish. Never blocks; a request that already ended is left alone."""
        if self.streams.is_live(request_id) and self._abort_send is not None:
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                self._abort_send.send_nowait(Abort(request_id, "stop"))

    def _client_left(self, request_id: int) -> None:
        """A handle was closed before its terminal update: drop the stream entry and abort at once."""
        if self.streams.client_left(request_id) and self._abort_send is not None:
            # Unbounded on purpose: at most one abort per request ever exists, and closing must never block.
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                self._abort_send.send_nowait(Abort(request_id))

    @property
    def info(self) -> EngineInfo:
        parts = self.parts
        return EngineInfo(parts.model_name, parts.max_model_len, parts.vocab_size, parts.tokenizer,
                          parts.eos_token_ids, parts.default_max_tokens, parts.model_root, parts.tokenizer_folder)

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def failed(self) -> bool:
        """Whether an actor crashed (every in-flight request was then ended with an error)."""
        return self.state is EngineState.FAILED

    def counts(self) -> EngineCounts:
        """What the engine holds now (cheap; for tests, the debug route and leak checks)."""
        kv = self.parts.kv
        pools = [kv.full_pool] + ([kv.sliding_pool] if kv.sliding_pool is not None else [])
        return EngineCounts(
            requests=len(self.scheduler.requests), stream_entries=len(self.streams),
            kv_sequences=kv.num_sequences, kv_blocks_in_use=sum(p.num_referenced for p in pools),
            kv_blocks_cached=sum(p.num_cached - _referenced_cached(p) for p in pools))

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """The prefix cache's block hashes (for ``GET /kv/events``; call it where no checkpoint separates
        it from subscribing to telemetry, so no batch falls between the two)."""
        kv = self.parts.kv
        hashes = () if kv.prefix_cache is None else tuple(kv.prefix_cache.block_hashes())
        return KVCacheSnapshot(kv.events.last_seq, kv.block_size, hashes)

    async def read_counts(self) -> EngineCounts:
        """``counts()`` for the ``ServingEngine`` surface (no checkpoint)."""
        return self.counts()

    async def read_kv_cache_snapshot(self) -> KVCacheSnapshot:
        """``kv_cache_snapshot()`` for the ``ServingEngine`` surface (no checkpoint)."""
        return self.kv_cache_snapshot()

    def check_integrity(self) -> None:
        """Assert the engine is consistent and, when idle, holds nothing but prefix-cache blocks: no
        requests, no stream entries, no KV sequences, no referenced blocks. Raises ``AssertionError``."""
        self.parts.kv.check_integrity()
        self.streams.check_integrity()
        self.scheduler.check_integrity()
        if self.scheduler.has_work or self.scheduler.has_pending_releases:
            return
        counts = self.counts()
        assert counts.requests == 0 and counts.stream_entries == 0, counts
        assert counts.kv_sequences == 0 and counts.kv_blocks_in_use == 0, counts

    def seconds_since_progress(self) -> float | None:
        """How long work has been pending without a completed step (None when idle): measured from the last
        step's end or, if later, the arrival of the oldest request in the scheduler (so the first step after
        an idle spell is not counted as a stall, and a first step that never ends is)."""
        actor = self.scheduler_actor
        if actor is None or not self.scheduler.has_work:
            return None
        oldest_arrival = min(r.arrival_time for r in self.scheduler.requests.values())
        last = actor.last_step_end
        since = oldest_arrival if last is None else max(last, oldest_arrival)
        return trio.current_time() - since

    # -- lifecycle -----------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every actor until shutdown; raises (after failing in-flight requests) if an actor crashes."""
        try:
            async with trio.open_nursery() as outer:
                await outer.start(self.telemetry.run)
                try:
                    await self._run_pipeline(task_status)
                finally:
                    self.telemetry.close()
        except BaseException as error:
            self._end_in_flight(error)
            raise
        else:
            self._end_in_flight(None)
        finally:
            self._stopped.set()

    async def _run_pipeline(self, task_status: trio.TaskStatus[Engine]) -> None:
        parts = self.parts
        emit = self.telemetry.emit
        # The admission inbox: a full queue rejects at once (Engine.submit uses send_nowait).
        admission_send, admission_receive = trio.open_memory_channel[Submission](parts.max_queue_size)
        # Admission -> scheduler: one step's worth of new requests; beyond that admission waits, and the
        # admission inbox fills up instead (which is where overload is reported).
        to_scheduler_send, to_scheduler_receive = trio.open_memory_channel[Request](
            parts.scheduler_config.max_batch_size)
        # Callers -> scheduler aborts: unbounded, because closing a handle must never block or fail, and
        # there is at most one abort per request (``RequestStreams.client_left`` is true once).
        abort_send, abort_receive = trio.open_memory_channel[Abort](math.inf)
        self._abort_send = abort_send
        # Scheduler <-> KV allocator and scheduler <-> executor are rendezvous channels: exactly one demand,
        # one grant, one plan and one result per step; with overlap the executor holds one launched step more
        # (actors/executor.py), so at most two steps are between plan and result.
        demand_send, demand_receive = trio.open_memory_channel[StepDemand](0)
        grant_send, grant_receive = trio.open_memory_channel[StepGrant](0)
        plan_send, plan_receive = trio.open_memory_channel[StepPlan | Drain](0)
        result_send, result_receive = trio.open_memory_channel[StepResult](0)

        depth = 1 if parts.overlap else 0
        self.executor = Executor(as_pipeline(parts.step), plan_receive, result_send, depth=depth)
        kv_allocator = KVAllocator(parts.kv, demand_receive, grant_send, parts.allocate, emit)
        kv = parts.kv
        self.scheduler_actor = SchedulerActor(
            self.scheduler, to_scheduler_receive, abort_receive, demand_send, grant_receive, plan_send,
            result_receive, self.streams, emit, max_queued_tokens=parts.max_queued_tokens,
            kv_capacity_tokens=kv.full_pool.num_blocks * kv.block_size, admission_timeout=parts.admission_timeout,
            depth=depth, before_plan=self.before_plan)
        admission = Admission(
            admission_receive, to_scheduler_send, self.streams, parts.tokenizer, max_model_len=parts.max_model_len,
            vocab_size=parts.vocab_size, eos_token_ids=parts.eos_token_ids,
            admission_timeout=parts.admission_timeout, kv_limits=kv_limits(parts), emit=emit,
            default_max_tokens=parts.default_max_tokens, grammar=parts.grammar, text_in_front=self.text_in_front)
        if parts.grammar is not None and not parts.grammar.ready:
            # parts built elsewhere than engine_factory (which builds it as a start-up phase): llguidance's tokenizer
            # is built before READY, never by a request (it holds the GIL for seconds; core/grammar_compiler.py)
            await trio.to_thread.run_sync(parts.grammar.ensure_tokenizer)
        async with trio.open_nursery() as pipeline:
            self._pipeline_scope = pipeline.cancel_scope
            await pipeline.start(self.executor.run)
            await pipeline.start(kv_allocator.run)
            await pipeline.start(self.scheduler_actor.run)
            await pipeline.start(admission.run)
            self._admission_send = admission_send
            self.state = EngineState.READY
            task_status.started(self)

    def close(self) -> None:
        """Stop accepting requests; the engine stops once the admitted ones finish."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING
        if self._admission_send is not None:
            self._admission_send.close()

    async def drain(self, timeout: float) -> None:
        """``close``, wait up to ``timeout`` seconds for in-flight requests, then cancel what is left
        (each remaining request ends with a terminal error event)."""
        self.close()
        with trio.move_on_after(timeout):
            await self._stopped.wait()
        if not self._stopped.is_set():
            self._shutdown_message = f"the server shut down before the request finished ({timeout:g} s drain)"
            if self._pipeline_scope is not None:
                self._pipeline_scope.cancel()
            await self._stopped.wait()

    def _end_in_flight(self, error: BaseException | None) -> None:
        """Exactly one terminal event for every request still in the engine."""
        if error is not None and self._shutdown_message is None:
            self.failure = error
            self.state = EngineState.FAILED
            message = f"engine failure: {error!r}"
        else:
            self.state = EngineState.STOPPED
            message = self._shutdown_message or "the engine stopped"
        if self.scheduler_actor is not None:
            self.scheduler_actor.flush_deliveries()  # tokens already computed go out before the terminal event
        for update in self.scheduler.fail_all(message):
            self.streams.deliver(update)
        self.streams.fail_all(message)
