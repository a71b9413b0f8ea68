"""``with_faults``: install the wrappers that ``FAULTS`` asks for on an engine's parts (and nothing else).

The one place the fault wrappers are wired in (``engine_factory`` for real runs, tests for fake engines):
each wrapper goes on only when its fault has a non-zero probability, so an engine without faults runs the
exact same step function, allocator and tokenizer it always did. See ``docs/reliability.md``.

With ``ENGINE_PROCESS=separate`` the front, not the engine process, tokenizes the prompts, so ``serve`` also
puts the tokenizer fault on the front's tokenizer (``with_tokenizer_faults``); the engine process's wrapper
then never fires (it sees token ids only), and the n-th request still gets the same decision in either mode.
"""

from __future__ import annotations

import logging

import attrs

from inference_server.actors.fault_step import faulty_step
from inference_server.core.fault_wrappers import FaultyTokenizer, refusing_allocator
from inference_server.core.faults import FaultDecisions, FaultSpec
from inference_server.core.validation import PromptTokenizer
from inference_server.supervisor import EngineParts

log = logging.getLogger(__name__)


def with_faults(parts: EngineParts, spec: FaultSpec) -> EngineParts:
    """``parts`` with the configured faults injected; ``parts`` itself when none is."""
    if not spec.enabled:
        return parts
    decisions = FaultDecisions(spec)
    changes: dict[str, object] = {}
    if spec.probability("step_error") > 0 or spec.probability("step_delay") > 0:
        changes["step"] = faulty_step(parts.step, decisions)
    if spec.probability("alloc_refuse") > 0:
        changes["allocate"] = refusing_allocator(parts.allocate, decisions)
    if spec.probability("tokenizer_error") > 0:
        if parts.tokenizer is None:
            log.warning("FAULTS tokenizer_error has no effect: this model has no tokenizer (token-id prompts)")
        else:
            changes["tokenizer"] = FaultyTokenizer(parts.tokenizer, decisions)
    log.warning("fault injection is on: FAULTS=%s", spec.describe())
    return attrs.evolve(parts, **changes)  # type: ignore[arg-type]


def with_tokenizer_faults(tokenizer: PromptTokenizer | None, spec: FaultSpec) -> PromptTokenizer | None:
    """``tokenizer`` failing as ``tokenizer_error`` asks (a front's tokenizer, see the module docstring);
    ``tokenizer`` itself when that fault is off or there is no tokenizer."""
    if tokenizer is None or spec.probability("tokenizer_error") <= 0:
        return tokenizer
    log.warning("fault injection is on in the front's tokenizer: FAULTS=%s", spec.describe())
    return FaultyTokenizer(tokenizer, FaultDecisions(spec))
