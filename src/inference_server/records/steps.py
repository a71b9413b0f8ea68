"""Step records: what the scheduler asks the executor to compute, and what comes back."""

from __future__ import annotations

import attrs

from inference_server.records.sampling_params import SamplingParams


@attrs.frozen
class ScheduledSequence:
    """One sequence's work in a step: compute ``token_ids`` at positions ``cached_len ..``.

    ``block_tables[g]`` lists the sequence's blocks of KV block group g, covering every position up to
    ``cached_len + len(token_ids)`` that the group's layers can still read. ``sample`` is true when the chunk
    ends at the sequence's newest token, so the step samples its next token. ``reset`` marks the first chunk
    of a (re)started sequence: the runner forgets any state it had for the request.
    """

    request_id: int
    token_ids: tuple[int, ...]
    cached_len: int
    block_tables: tuple[tuple[int, ...], ...]
    sample: bool
    sampling: SamplingParams
    reset: bool = False
    prompt_len: int = 0  # tokens of the request's prompt (penalties treat prompt and output apart)


@attrs.frozen
class StepPlan:
    """Everything the executor needs for one forward step."""

    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    finished_request_ids: tuple[int, ...] = ()  # the runner drops per-request state for these

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@attrs.frozen
class SampledToken:
    request_id: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class StepResult:
    step_id: int
    tokens: tuple[SampledToken, ...]
    num_computed_tokens: int
    seconds: float
