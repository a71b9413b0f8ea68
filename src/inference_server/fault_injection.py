"""``with_faults``: install the wrappers that ``FAULTS`` asks for on an engine's parts (and nothing else).

The one place the fault wrappers are wired in (``engine_factory`` for real runs, tests for fake engines):
each wrapper goes on only when its fault has a non-zero probability, so an engine without faults runs the
exact same step function, allocator and tokenizer it always did. See ``docs/reliability.md``.
"""

from __future__ import annotations

import logging

import attrs

from inference_server.actors.fault_step import faulty_step
from inference_server.core.fault_wrappers import FaultyTokenizer, refusing_allocator
from inference_server.core.faults import FaultDecisions, FaultSpec
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
