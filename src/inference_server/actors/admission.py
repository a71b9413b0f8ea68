"""Admission actor: validates and tokenises submitted requests, then queues them for the scheduler.

Its inbox is bounded (``MAX_QUEUE_SIZE``): ``Engine.submit`` puts requests in with ``send_nowait`` and a
full inbox rejects at once as overloaded. Requests that can never run (bad sampling values, prompt longer
than the context, ...) are refused here, before anything is queued. Sending on to the scheduler awaits,
so a scheduler that falls behind fills this inbox, which is where overload is reported.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from inference_server.actors.request_streams import RequestStreams
from inference_server.core.detokenizer import IncrementalDetokenizer
from inference_server.core.request import Request
from inference_server.core.stop_checker import StopChecker
from inference_server.core.validation import PromptTokenizer, RequestError, prepare
from inference_server.messages import Abort, GenerationRequest, Rejected
from inference_server.telemetry.events import RequestRejected


@attrs.frozen
class Submission:
    request_id: int
    request: GenerationRequest
    arrival_time: float


class Admission:
    def __init__(self, inbox: trio.MemoryReceiveChannel[Submission],
                 to_scheduler: trio.MemorySendChannel[Request | Abort], streams: RequestStreams,
                 tokenizer: PromptTokenizer | None, *, max_model_len: int, vocab_size: int,
                 eos_token_ids: frozenset[int], admission_timeout: float, emit: Callable) -> None:
        self.inbox = inbox
        self.to_scheduler = to_scheduler
        self.streams = streams
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.admission_timeout = admission_timeout
        self.emit = emit
        self._arrivals = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox, self.to_scheduler:
            async for submission in self.inbox:
                request = self.admit(submission)
                if request is not None:
                    await self.to_scheduler.send(request)

    def admit(self, submission: Submission) -> Request | None:
        """The core ``Request`` for a submission, or None after delivering its rejection."""
        incoming = submission.request
        try:
            prompt_ids = prepare(incoming, self.tokenizer, max_model_len=self.max_model_len,
                                 vocab_size=self.vocab_size)
        except RequestError as error:
            self.streams.reject(submission.request_id, Rejected(error.code, error.message, error.param))
            self.emit(RequestRejected(trio.current_time(), error.code, error.message, incoming.trace_id))
            return None
        params = incoming.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None
        self._arrivals += 1
        return Request(
            request_id=submission.request_id, prompt_ids=prompt_ids, params=params,
            arrival_time=submission.arrival_time, arrival_index=self._arrivals,
            deadline=submission.arrival_time + self.admission_timeout if self.admission_timeout else None,
            session_id=incoming.session_id, priority=incoming.priority,
            extra_key=incoming.cache_salt, detokenizer=detokenizer,
            stop_checker=StopChecker.from_params(params, self.eos_token_ids),
            trace_id=incoming.trace_id,
        )
