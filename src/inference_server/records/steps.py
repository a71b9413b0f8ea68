"""Step records: what the scheduler asks the executor to compute, and what comes back."""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol, cast

import attrs

from inference_server.records.hot_record import hot_record
from inference_server.records.sampling_params import SamplingParams

PENDING_TOKEN = -1
"""A plan's stand-in for a token the previous step sampled and the host has not received yet (overlap): it is
only ever the last of a sequence's ``token_ids``, and the runner substitutes the previous step's sample for
that request (on the device, without a host sync)."""


@hot_record
class ScheduledSequence:
    """One sequence's work in a step: compute ``token_ids`` at positions ``cached_len ..``.

    ``block_tables[g]`` lists the sequence's blocks of KV block group g, covering every position up to
    ``cached_len + len(token_ids)`` that the group's layers can still read. ``sample`` is true when the chunk
    ends at the sequence's newest token, so the step samples its next token. ``reset`` marks the first chunk
    of a (re)started sequence: the runner forgets any state it had for the request. The last of ``token_ids``
    may be ``PENDING_TOKEN`` (see ``pending``).
    """

    request_id: int
    token_ids: tuple[int, ...]
    cached_len: int
    block_tables: tuple[tuple[int, ...], ...]
    sample: bool
    sampling: SamplingParams
    reset: bool = False
    prompt_len: int = 0  # tokens of the request's prompt (penalties treat prompt and output apart)
    prompt_logprob_targets: tuple[int, ...] = ()
    """Prompt tokens whose logprobs this chunk scores: the chunk's row i (position ``cached_len + i``)
    predicts ``prompt_logprob_targets[i]`` (the token at ``cached_len + i + 1``). Empty: keep no row's logits."""
    prompt_logprobs_top: int = 0
    """How many of the best tokens to return beside each target's own logprob."""
    history: tuple[int, ...] = ()
    """On a ``reset`` chunk of a request that uses penalties or a constraint (``needs_token_history``): its
    tokens before ``cached_len`` (a prefix-cache hit's), so the runner's history (and the constraint's matcher)
    holds the whole sequence. Empty otherwise."""

    @property
    def num_tokens(self) -> int:
        """Tokens this chunk computes (``len(token_ids)``): what telemetry reads of them."""
        return len(self.token_ids)

    @property
    def pending(self) -> bool:
        """Whether the last token is the one the previous step sampled for this request (``PENDING_TOKEN``)."""
        return bool(self.token_ids) and self.token_ids[-1] == PENDING_TOKEN


@attrs.frozen
class StepPlan:
    """Everything the executor needs for one forward step."""

    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    finished_request_ids: tuple[int, ...] = ()  # the runner drops per-request state for these

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


class PlannedSequence(Protocol):
    """What telemetry reads of a step's sequence: a ``ScheduledSequence`` in process, a ``SequenceDigest`` after
    the engine process forwarded its step."""

    @property
    def request_id(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def cached_len(self) -> int: ...

    @property
    def prompt_len(self) -> int: ...

    @property
    def reset(self) -> bool: ...

    @property
    def sample(self) -> bool: ...


class PlanView(Protocol):
    """What telemetry reads of a step's plan (``StepPlan`` or ``PlanDigest``)."""

    @property
    def step_id(self) -> int: ...

    @property
    def sequences(self) -> Sequence[PlannedSequence]: ...


class SequenceDigest(NamedTuple):
    """A ``ScheduledSequence`` as telemetry reads it (``PlannedSequence``), without its tokens, block tables and
    sampling parameters."""

    request_id: int
    num_tokens: int
    cached_len: int
    prompt_len: int
    reset: bool
    sample: bool


def _digests(rows: Iterable[tuple[int, int, int, int, bool, bool]]) -> tuple[SequenceDigest, ...]:
    """``SequenceDigest``s of ``rows`` by ``tuple.__new__``: the namedtuple's own constructor adds a Python call
    per sequence."""
    return tuple(map(tuple.__new__, itertools.repeat(SequenceDigest), rows))


DigestColumns = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[bool, ...],
                      tuple[bool, ...]]
"""A plan's sequences as one column per ``SequenceDigest`` field, in the fields' order."""

_FIELD_GETTERS = tuple(map(operator.attrgetter, SequenceDigest._fields))


@attrs.frozen
class PlanDigest:
    """A ``StepPlan`` as telemetry reads it (``PlanView``): what the engine process forwards of each step to the
    front's telemetry. It holds and pickles one column per ``SequenceDigest`` field, not an object per sequence:
    the engine process builds them with one ``map`` per field over the plan, and only the front, where telemetry
    reads them, spells out the rows (``sequences``, built once, on first use)."""

    step_id: int
    columns: DigestColumns

    @classmethod
    def of(cls, plan: PlanView) -> PlanDigest:
        sequences = plan.sequences
        return cls(plan.step_id, cast(DigestColumns, tuple(
            tuple(map(getter, sequences)) for getter in _FIELD_GETTERS)))

    @functools.cached_property
    def sequences(self) -> tuple[SequenceDigest, ...]:
        """The plan's sequences as telemetry reads them (``PlannedSequence``)."""
        return _digests(zip(*self.columns, strict=True))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return PlanDigest, (self.step_id, self.columns)  # the columns only, never rows a front spelled out


@hot_record
class SampledToken:
    request_id: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class PromptLogprobsChunk:
    """Logprobs of consecutive prompt tokens of one request, from one step: ``token_logprobs[i]`` is the
    logprob of the prompt token at position ``first_position + i`` given the tokens before it."""

    request_id: int
    first_position: int
    token_logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]  # per token: the best (token id, logprob) pairs


@attrs.frozen
class StepResult:
    step_id: int
    tokens: tuple[SampledToken, ...]
    num_computed_tokens: int
    seconds: float
    prompt_logprobs: tuple[PromptLogprobsChunk, ...] = ()
