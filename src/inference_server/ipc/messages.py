"""The messages between the front process and the engine process (docs/ipc.md, "The engine split").

Pure msgspec Structs (no trio): the records they carry (``GenerationRequest``, ``SamplingParams``,
``RequestUpdate``, ``Rejected``) are the attrs classes of ``records/``, which msgspec encodes and decodes as
they are, so a field added to one of them crosses without a change here.

Front to engine: :class:`ToEngine` (the submits and aborts queued since the forwarder last woke), :class:`Call`
(a question the HTTP layer awaits: counts, the prefix cache's snapshot, compiling constraints) and
:class:`Drain`. Engine to front: :class:`Hello` first, then :class:`StepOutput` (everything that became ready
since the last one: admissions, request updates and the engine's telemetry events) and :class:`Reply` (one per
``Call``), and :class:`Stopped` last. Decode each direction with its union (``FRONT_TO_ENGINE``,
``ENGINE_TO_FRONT``) as the channel's ``receive_type``.

Telemetry events cross pickled (``StepOutput.events``): they are attrs classes of several shapes, and msgspec
decodes a union of such object types only when they are tagged Structs; both ends run the same code.

The front tokenises text and chat prompts (``RemoteEngine.submit``), so a :class:`Submit` carries a
``GenerationRequest`` with ``prompt_ids`` (and ``tokenized_from``); the engine process's admission does the rest
(validation, truncation, the context and KV checks). Detokenisation and stop strings run in the front too: a
step's updates carry token ids and logprobs with empty text and end only for the engine's reasons (EOS, stop
token ids, length, abort, error, timeout); a request's first update carries its ``cached_prompt_tokens``.
"""

from __future__ import annotations

import itertools
from typing import Literal

import msgspec

from inference_server.records.requests import (
    FinishReason,
    GenerationRequest,
    PromptTokenLogprob,
    Rejected,
    RequestUpdate,
    TokenOutput,
)


class Submit(msgspec.Struct, array_like=True):
    """One request to run. ``request_id`` is the front's (it names the request in every later message)."""

    request_id: int
    request: GenerationRequest
    arrival: float
    """``time.monotonic()`` when the front took the request."""


class Abort(msgspec.Struct, array_like=True):
    """End a request now: its client left (``abort``) or the front matched a stop string (``stop``)."""

    request_id: int
    reason: Literal["abort", "stop"] = "abort"
    stop_reason: str | None = None
    num_tokens: int = 0
    """Output tokens the client got (``stop`` only)."""


class ToEngine(msgspec.Struct, tag=True):
    """Whatever the front queued since its forwarder last sent; the engine applies the submits, then the aborts
    (which may name a request submitted in the same message)."""

    submits: list[Submit] = []
    aborts: list[Abort] = []


class Drain(msgspec.Struct, tag=True):
    """Stop admitting; let in-flight requests finish for ``timeout`` seconds (0: end them now)."""

    timeout: float


class Hello(msgspec.Struct, tag=True):
    """The engine's first message, once it is ready: what the front's ``info`` serves."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    default_max_tokens: int | None
    model_root: str
    tokenizer_folder: str
    pid: int
    clock_offset: float
    """``trio.current_time() - time.monotonic()`` in the engine, to map its telemetry times."""


CallKind = Literal["counts", "kv_cache_snapshot", "compile_constraints"]


class Call(msgspec.Struct, tag=True):
    """A question the front awaits an answer to (a :class:`Reply` with the same ``call_id``): ``counts``
    (what the engine holds), ``kv_cache_snapshot`` (the prefix cache's block hashes) or ``compile_constraints``
    (compile ``requests``' structured-output constraints, so their admission finds them compiled)."""

    call_id: int
    kind: CallKind
    requests: list[GenerationRequest] = []


class CacheSnapshot(msgspec.Struct, array_like=True):
    """``supervisor.KVCacheSnapshot`` on the wire (this module imports nothing of trio)."""

    seq: int
    block_size: int
    hashes: list[int]


class Reply(msgspec.Struct, tag=True):
    """The answer to the :class:`Call` with ``call_id``: ``counts`` (``supervisor.EngineCounts``' fields),
    ``snapshot``, or nothing (compiled); ``error`` when the call failed (an invalid constraint: its code,
    message and field)."""

    call_id: int
    counts: dict[str, int] | None = None
    snapshot: CacheSnapshot | None = None
    error: Rejected | None = None


class Admission(msgspec.Struct, array_like=True):
    """A request's admission outcome: queued (its prompt as the model sees it) or ``rejected``."""

    request_id: int
    prompt_token_ids: tuple[int, ...] = ()
    rejected: Rejected | None = None


class Tokens(msgspec.Struct, array_like=True):
    """One ``RequestUpdate`` of the engine on the wire (decision 2): its tokens as columns of ids and logprobs,
    without text (the front makes it), and the update's other fields as they are. ``top_logprobs`` is None when
    no token has any."""

    request_id: int
    token_ids: list[int] = []
    logprobs: list[float] = []
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    prompt_logprobs: tuple[PromptTokenLogprob, ...] | None = None

    @classmethod
    def of(cls, update: RequestUpdate, request_id: int, cached_prompt_tokens: int | None = None) -> Tokens:
        """``update`` named ``request_id`` (and with ``cached_prompt_tokens``, when given); its tokens' text is
        dropped (the engine's is empty)."""
        tokens = update.tokens
        ids: list[int] = []
        logprobs: list[float] = []
        any_top = False
        for token in tokens:  # one loop of appends: a third of what comprehensions or maps cost on a few tokens
            ids.append(token.token_id)
            logprobs.append(token.logprob)
            if token.top_logprobs:
                any_top = True
        tops = [token.top_logprobs for token in tokens] if any_top else None
        return cls(request_id, ids, logprobs, tops, update.finish_reason, update.stop_reason, update.error,
                   update.prompt_tokens, update.completion_tokens,
                   update.cached_prompt_tokens if cached_prompt_tokens is None else cached_prompt_tokens,
                   update.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, tokens: tuple[TokenOutput, ...] | None = None,
               cached_prompt_tokens: int | None = None) -> RequestUpdate:
        """The ``RequestUpdate`` this carries, with ``tokens`` (default: its own, with empty text) and
        ``cached_prompt_tokens`` (default: its own)."""
        if tokens is None:
            tops = self.top_logprobs or ((),) * len(self.token_ids)
            tokens = tuple(map(TokenOutput, self.token_ids, itertools.repeat(""), self.logprobs, tops))
        return RequestUpdate(self.request_id, tokens, self.finish_reason, self.stop_reason, self.error,
                             self.prompt_tokens, self.completion_tokens,
                             self.cached_prompt_tokens if cached_prompt_tokens is None else cached_prompt_tokens,
                             self.prompt_logprobs)


class StepOutput(msgspec.Struct, tag=True):
    """Everything ready since the last message: admissions first, then each request's updates in order
    (several updates of one request may be in one message; its terminal one ends its stream)."""

    admissions: list[Admission] = []
    updates: list[Tokens] = []
    state: str | None = None
    """The engine's state when it changed (``draining``, ``stopped``, ``failed``)."""
    events: bytes = b""
    """The engine's telemetry events since the last message, pickled as one list (empty: none)."""
    events_dropped: int = 0
    """Events the engine dropped since the last message because too many were unsent (a lagging front)."""


class Stopped(msgspec.Struct, tag=True):
    """The engine's last message before it closes its end: every request it admitted has ended."""

    failed: bool
    message: str


FRONT_TO_ENGINE = ToEngine | Call | Drain
"""What the engine process receives."""

ENGINE_TO_FRONT = Hello | StepOutput | Reply | Stopped
"""What the front receives."""
