"""A request's state inside the scheduler (the updates it emits are ``records.requests.RequestUpdate``)."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from inference_server.core.detokenizer import IncrementalDetokenizer
from inference_server.core.stop_checker import StopChecker
from inference_server.records.requests import PromptTokenLogprob
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import PENDING_TOKEN


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    ``num_computed`` counts tokens of ``all_token_ids`` whose KV has a slot (written by an issued step);
    a preempted request goes back to 0 and is recomputed. ``arrival_index`` is the admission order, kept
    across preemption so a preempted request keeps its place.

    Overlap (``docs/architecture.md``): ``num_in_flight`` counts tokens sampled by issued steps whose value
    the host has not received yet (0 or 1 when a step is planned, 2 between planning a step that feeds the
    pending token and receiving it). They count in ``num_tokens`` (so a decode can be planned for them), but
    not in ``all_token_ids``: a plan names such a token ``PENDING_TOKEN`` and the runner takes its value from
    the previous step's samples on the device. A preempted request forgets its in-flight tokens.
    """

    request_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    arrival_index: int
    deadline: float | None = None  # absolute time by which the request must have started, or None
    session_id: str | None = None
    priority: int = 0  # smaller runs first (vLLM's convention)
    extra_key: Any = None  # keeps prefix-cache entries of different salts / model revisions apart
    trace_id: str | None = None
    first_token_time: float | None = None
    detokenizer: IncrementalDetokenizer | None = None
    stop_checker: StopChecker | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = attrs.Factory(list)
    num_computed: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    started: bool = False
    needs_reset: bool = True  # the next chunk is the first after a (re)start
    prompt_logprobs: list[PromptTokenLogprob] = attrs.Factory(list)  # by position, assembled across chunks
    prompt_logprobs_sent: bool = False
    num_in_flight: int = 0

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.output_ids)

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """``all_token_ids[start:stop]`` (0 <= start <= stop) without building the whole sequence: a decode
        step's one token costs O(1), not a copy of prompt plus output."""
        prompt_len = len(self.prompt_ids)
        if start >= prompt_len:
            return tuple(self.output_ids[start - prompt_len:stop - prompt_len])
        if stop <= prompt_len:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + tuple(self.output_ids[:stop - prompt_len])

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those sampled by issued steps and not yet received."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_in_flight

    def planned_token_ids(self, start: int, count: int) -> tuple[int, ...]:
        """Tokens ``start .. start + count - 1`` as a plan names them (``PENDING_TOKEN`` for in-flight ones)."""
        known = self.token_slice(start, start + count)
        return known + (PENDING_TOKEN,) * (count - len(known))

    @property
    def num_outputs_planned(self) -> int:
        """Output tokens received or in flight (what ``max_tokens`` is checked against when planning)."""
        return len(self.output_ids) + self.num_in_flight

    @property
    def max_length(self) -> int:
        """The most tokens this request can hold in the KV cache (prompt plus ``max_tokens``)."""
        return len(self.prompt_ids) + self.params.resolved_max_tokens()

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and not yet all computed (such a request skips the prefix
        cache: a cached position has no logits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed
