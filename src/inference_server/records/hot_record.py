"""``hot_record``: ``attrs.frozen``'s contract for the records built once per token, at a third of the cost.

attrs' frozen ``__init__`` sets each field through ``object.__setattr__`` (frozen classes forbid plain
assignment), about three times the cost of an unfrozen one, and six records are built for every token of every
running request (a scheduled sequence, a sampled token, a stop update, a token output, a request update, a KV
grant): figures in docs/benchmarks.md (retired experiments, ``hot_record``).

The type checker sees ``attrs.frozen`` itself (assigning a field is a type error, ``attrs.evolve`` and
``attrs.fields`` accept the class); at run time the class is an ordinary slotted attrs class with value
equality and a hash, like a frozen one. The contract is the frozen one: never assign a field; build a changed
copy with ``attrs.evolve``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import attrs

__all__ = ["hot_record"]

if TYPE_CHECKING:
    from attrs import frozen as hot_record
else:
    RecordT = TypeVar("RecordT", bound=type)

    def hot_record(cls: RecordT) -> RecordT:
        """A slotted attrs class with value equality and hash, treated as frozen (see the module docstring)."""
        return attrs.define(cls, unsafe_hash=True)
