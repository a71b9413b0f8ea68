"""Fault injection for real runs: the ``FAULTS`` setting's grammar and the seeded decisions it drives.

Grammar: a comma-separated list of ``name=value`` items, each name at most once; empty means no faults.

=====================  ===========================================================================
``step_error=P``       the executor raises on a fraction P of steps (a device fault: the engine fails)
``step_delay=P:S``     a fraction P of steps take S extra seconds (a slow device)
``alloc_refuse=P``     on a fraction P of steps the KV allocator behaves as if the pool were full:
                       no block that was free when the step began may be taken (KV pressure)
``tokenizer_error=P``  the tokenizer raises for a fraction P of requests (a per-request fault)
``seed=N``             seed of the decisions (default 0)
=====================  ===========================================================================

P is a probability in [0, 1]; S a finite number of seconds >= 0; N an integer >= 0. For example
``FAULTS="step_error=0.01,step_delay=0.2:0.05,alloc_refuse=0.1,tokenizer_error=0.02,seed=7"``.

Decisions are deterministic given the seed: each fault kind draws from its own ``random.Random`` seeded
with ``(seed, kind)``, so the n-th step (or request) gets the same answer in every run, whichever other
faults are on. The policy each fault exercises is documented in ``docs/reliability.md``. Nothing here runs
when ``FAULTS`` is empty: the wrappers are only installed for the faults that are configured.
"""

from __future__ import annotations

import math
import random
from typing import Literal

import attrs

FaultKind = Literal["step_error", "step_delay", "alloc_refuse", "tokenizer_error"]
FAULT_KINDS: tuple[FaultKind, ...] = ("step_error", "step_delay", "alloc_refuse", "tokenizer_error")
GRAMMAR = "name=value items separated by commas: step_error=P, step_delay=P:SECONDS, alloc_refuse=P, " \
          "tokenizer_error=P, seed=N (P a probability in [0, 1])"


class FaultSpecError(ValueError):
    """A ``FAULTS`` value that does not follow the grammar (the message says which item and why)."""


class InjectedFault(RuntimeError):
    """Raised by an injected fault; the message names the fault kind and the step or request."""


@attrs.frozen
class FaultSpec:
    """Which faults to inject and how often (all zero: none)."""

    step_error: float = 0.0
    step_delay: float = 0.0  # fraction of steps that are slow
    step_delay_seconds: float = 0.0  # by how much
    alloc_refuse: float = 0.0
    tokenizer_error: float = 0.0
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return any(self.probability(kind) > 0 for kind in FAULT_KINDS)

    def probability(self, kind: FaultKind) -> float:
        if kind == "step_delay":
            return self.step_delay if self.step_delay_seconds > 0 else 0.0
        return float(getattr(self, kind))

    def describe(self) -> str:
        """The spec in the grammar (only the faults that are on), for logs and reports."""
        items = []
        for kind in FAULT_KINDS:
            p = self.probability(kind)
            if p > 0:
                items.append(f"{kind}={p:g}:{self.step_delay_seconds:g}" if kind == "step_delay" else f"{kind}={p:g}")
        return ",".join([*items, f"seed={self.seed}"]) if items else ""


def parse_faults(text: str) -> FaultSpec:
    """The ``FaultSpec`` written in ``text`` (see the module docstring); raises ``FaultSpecError``."""
    values: dict[str, float | int] = {}
    seen: set[str] = set()
    for raw_item in text.split(","):
        item = raw_item.strip()
        if not item:
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not value:
            raise FaultSpecError(f"item {item!r} is not name=value; expected {GRAMMAR}")
        if name in seen:
            raise FaultSpecError(f"{name!r} is given twice")
        seen.add(name)
        if name == "seed":
            values["seed"] = _integer(name, value)
        elif name == "step_delay":
            fraction, colon, seconds = value.partition(":")
            if not colon:
                raise FaultSpecError(f"step_delay={value!r} needs a fraction and seconds, e.g. step_delay=0.2:0.05")
            values["step_delay"] = _probability(name, fraction)
            values["step_delay_seconds"] = _seconds(name, seconds)
        elif name in FAULT_KINDS:
            values[name] = _probability(name, value)
        else:
            raise FaultSpecError(f"unknown fault {name!r}; expected {GRAMMAR}")
    return FaultSpec(**values)  # type: ignore[arg-type]


def _number(name: str, text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise FaultSpecError(f"{name}: {text.strip()!r} is not a number") from None
    if not math.isfinite(number):
        raise FaultSpecError(f"{name}: {text.strip()!r} is not a finite number")
    return number


def _probability(name: str, text: str) -> float:
    p = _number(name, text)
    if not 0.0 <= p <= 1.0:
        raise FaultSpecError(f"{name}: {text.strip()!r} is not a probability in [0, 1]")
    return p


def _seconds(name: str, text: str) -> float:
    seconds = _number(name, text)
    if seconds < 0:
        raise FaultSpecError(f"{name}: {text.strip()!r} seconds must be >= 0")
    return seconds


def _integer(name: str, text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise FaultSpecError(f"{name}: {text!r} is not an integer") from None
    if number < 0:
        raise FaultSpecError(f"{name}: {text!r} must be >= 0")
    return number


class FaultDecisions:
    """Seeded yes/no answers, one independent stream per fault kind (see the module docstring)."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self._streams = {kind: random.Random(f"{spec.seed}:{kind}") for kind in FAULT_KINDS}
        self.counts: dict[FaultKind, int] = dict.fromkeys(FAULT_KINDS, 0)  # faults injected so far, per kind

    def fires(self, kind: FaultKind) -> bool:
        """Whether the next step (or request) gets fault ``kind``; each call consumes one draw of its stream."""
        if self._streams[kind].random() < self.spec.probability(kind):
            self.counts[kind] += 1
            return True
        return False
