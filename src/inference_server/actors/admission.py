"""Admission actor: validates and tokenises submitted requests, then queues them for the scheduler.

Its inbox is bounded (``MAX_QUEUE_SIZE``): ``Engine.submit`` puts requests in with ``send_nowait`` and a
full inbox rejects at once as overloaded. Requests that can never run (bad sampling values, prompt longer
than the context, more KV than the cache holds, ...) are refused here, before anything is queued. Sending
on to the scheduler awaits, so a scheduler that falls behind fills this inbox, which is where overload is
reported.

Nothing a request carries can crash this actor: validation errors are ``RequestError`` values, and any
other exception raised while preparing one request (tokenizer, template, detokenizer, stop checker) is
logged and becomes that request's ``internal`` rejection. A request whose caller already left is dropped
without being tokenised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from inference_server.actors.request_streams import RequestStreams
from inference_server.core.detokenizer import IncrementalDetokenizer
from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.core.request import Request
from inference_server.core.stop_checker import StopChecker
from inference_server.core.validation import KVLimits, PromptTokenizer, prepare
from inference_server.records.constraints import Constraint
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest, Rejected
from inference_server.telemetry.events import RequestRejected, TelemetryEvent

log = logging.getLogger(__name__)


@attrs.frozen
class Submission:
    request_id: int
    request: GenerationRequest
    arrival_time: float


class Admission:
    def __init__(self, inbox: trio.MemoryReceiveChannel[Submission],
                 to_scheduler: trio.MemorySendChannel[Request], streams: RequestStreams,
                 tokenizer: PromptTokenizer | None, *, max_model_len: int, vocab_size: int,
                 eos_token_ids: frozenset[int], admission_timeout: float, kv_limits: KVLimits | None,
                 emit: Callable[[TelemetryEvent], None], default_max_tokens: int | None = None,
                 grammar: GrammarCompiler | None = None, text_in_front: bool = False) -> None:
        self.inbox = inbox
        self.text_in_front = text_in_front
        """A separate engine process: requests get no detokenizer and no stop strings here (the front
        process detokenises and matches them; docs/ipc.md, decision 1)."""
        self.to_scheduler = to_scheduler
        self.streams = streams
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.admission_timeout = admission_timeout
        self.kv_limits = kv_limits
        self.default_max_tokens = default_max_tokens
        self.emit = emit
        self.grammar = grammar
        self._arrivals = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox, self.to_scheduler:
            async for submission in self.inbox:
                request = self.admit(submission)
                if request is not None:
                    await self.to_scheduler.send(request)

    def admit(self, submission: Submission) -> Request | None:
        """The core ``Request`` for a submission, or None (rejection delivered, or the caller gone)."""
        if not self.streams.is_live(submission.request_id):
            return None  # the caller left while the request waited in the inbox
        try:
            return self._prepare(submission)
        except RequestError as error:
            self._reject(submission, error)
        except Exception as error:  # a bug triggered by this request's input: fail it, not the engine
            log.exception("admission failed for request %d", submission.request_id)
            self._reject(submission, RequestError("internal", f"the request could not be prepared: {error!r}"))
        return None

    def _reject(self, submission: Submission, error: RequestError) -> None:
        self.streams.reject(submission.request_id, Rejected(error.code, error.message, error.param))
        self.emit(RequestRejected(trio.current_time(), error.code, error.message, submission.request.trace_id))

    def _check_constraint(self, constraint: Constraint) -> None:
        """A constraint the runner can use: compiled already (``Engine.compile_constraints``, the HTTP path)
        or compiled here (callers that submit directly; llguidance compiles in milliseconds)."""
        if self.grammar is None:
            raise RequestError("invalid_request", f"{constraint.field}: structured outputs are not available on "
                               "this server", constraint.field)
        self.grammar.compile(constraint)

    def _prepare(self, submission: Submission) -> Request:
        incoming = submission.request
        prompt_ids, params = prepare(incoming, self.tokenizer, max_model_len=self.max_model_len,
                                     vocab_size=self.vocab_size, kv=self.kv_limits,
                                     default_max_tokens=self.default_max_tokens)
        if params.constraint is not None:
            self._check_constraint(params.constraint)
        if params.min_tokens > 0:  # the sampler holds the model's EOS back until then
            params = attrs.evolve(params, eos_token_ids=tuple(sorted(self.eos_token_ids)))
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                             skip_special_tokens=params.skip_special_tokens) \
            if self.tokenizer is not None and not self.text_in_front else None
        self._arrivals += 1
        return Request(
            request_id=submission.request_id, prompt_ids=prompt_ids, params=params,
            arrival_time=submission.arrival_time, arrival_index=self._arrivals,
            deadline=submission.arrival_time + self.admission_timeout if self.admission_timeout else None,
            session_id=incoming.session_id, priority=incoming.priority,
            extra_key=incoming.cache_salt, detokenizer=detokenizer,
            stop_checker=StopChecker.from_params(params, self.eos_token_ids, stop_strings=not self.text_in_front),
            trace_id=incoming.trace_id,
        )
