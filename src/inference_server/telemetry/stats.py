"""Streaming percentiles over sliding windows (pure Python: no trio, no numpy on the add path).

``LogSketch`` is a DDSketch-style quantile sketch: a value ``v`` lands in the bucket
``ceil(log(v) / log(gamma))`` with ``gamma = (1 + a) / (1 - a)``, and a quantile is answered with the
bucket's midpoint ``2 gamma^i / (gamma + 1)``. Guarantee (tested against exact percentiles): for ``q`` in
[0, 1] the answer is within relative error ``a`` of the exact order statistic ``x[floor(q (n - 1))]`` of the
values added (the "lower" percentile), for every value in ``[MIN_VALUE, inf)``; values below ``MIN_VALUE``
(including zero) are answered as 0. Adding a value is one ``log`` and one dict increment.

``SlidingSketch`` keeps a ring of ``slots`` sub-sketches keyed by an integer epoch (a time slot, or a count
of finished requests divided by a slot size). A query merges the sub-sketches of the last ``slots`` epochs,
so a 60 x 1 s ring answers "the last 59 to 60 seconds", and a 10 x 100-request ring "the values observed
while the last 900 to 1,000 requests finished". The ring never grows: memory is bounded by
``slots x buckets``.
"""

from __future__ import annotations

import math

DEFAULT_RELATIVE_ACCURACY = 0.01
MIN_VALUE = 1e-9  # below this (one nanosecond) a latency is reported as 0


class LogSketch:
    """A mergeable quantile sketch with relative accuracy ``relative_accuracy`` (see the module docstring)."""

    __slots__ = ("_inv_log_gamma", "buckets", "count", "gamma", "relative_accuracy", "sum", "zeros")

    def __init__(self, relative_accuracy: float = DEFAULT_RELATIVE_ACCURACY) -> None:
        if not 0 < relative_accuracy < 1:
            raise ValueError("relative_accuracy must be in (0, 1)")
        self.relative_accuracy = relative_accuracy
        self.gamma = (1 + relative_accuracy) / (1 - relative_accuracy)
        self._inv_log_gamma = 1.0 / math.log(self.gamma)
        self.buckets: dict[int, int] = {}
        self.zeros = 0
        self.count = 0
        self.sum = 0.0

    def add(self, value: float, count: int = 1) -> None:
        self.count += count
        self.sum += value * count
        if value < MIN_VALUE:
            self.zeros += count
            return
        index = math.ceil(math.log(value) * self._inv_log_gamma)
        self.buckets[index] = self.buckets.get(index, 0) + count

    def merge(self, other: LogSketch) -> None:
        if other.gamma != self.gamma:
            raise ValueError("cannot merge sketches of different accuracy")
        self.count += other.count
        self.sum += other.sum
        self.zeros += other.zeros
        for index, count in other.buckets.items():
            self.buckets[index] = self.buckets.get(index, 0) + count

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 <= q <= 1) of the values added; None when empty."""
        if self.count == 0:
            return None
        rank = math.floor(q * (self.count - 1))  # 0-based rank of the exact "lower" percentile
        seen = self.zeros
        if rank < seen:
            return 0.0
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if rank < seen:
                return 2 * self.gamma**index / (self.gamma + 1)
        raise AssertionError("bucket counts do not add up to count")  # unreachable while counts are consistent


class SlidingSketch:
    """A ring of ``slots`` ``LogSketch``es keyed by an integer epoch (see the module docstring)."""

    def __init__(self, slots: int, relative_accuracy: float = DEFAULT_RELATIVE_ACCURACY) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.slots = slots
        self.relative_accuracy = relative_accuracy
        self._epochs: list[int | None] = [None] * slots
        self._sketches = [LogSketch(relative_accuracy) for _ in range(slots)]

    def add(self, epoch: int, value: float, count: int = 1) -> None:
        self._slot(epoch).add(value, count)

    def _slot(self, epoch: int) -> LogSketch:
        position = epoch % self.slots
        if self._epochs[position] != epoch:  # a newer epoch reuses the slot of the one `slots` before it
            self._epochs[position] = epoch
            self._sketches[position] = LogSketch(self.relative_accuracy)
        return self._sketches[position]

    def window(self, current_epoch: int) -> LogSketch:
        """The merge of the sub-sketches of epochs ``current_epoch - slots + 1 .. current_epoch``."""
        merged = LogSketch(self.relative_accuracy)
        for epoch, sketch in zip(self._epochs, self._sketches, strict=True):
            if epoch is not None and current_epoch - self.slots < epoch <= current_epoch:
                merged.merge(sketch)
        return merged


class SlidingSum:
    """Per-epoch sums over the same ring as ``SlidingSketch`` (token counts for throughput)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._epochs: list[int | None] = [None] * slots
        self._sums = [0.0] * slots

    def add(self, epoch: int, amount: float) -> None:
        position = epoch % self.slots
        if self._epochs[position] != epoch:
            self._epochs[position] = epoch
            self._sums[position] = 0.0
        self._sums[position] += amount

    def window(self, current_epoch: int) -> float:
        return sum(s for e, s in zip(self._epochs, self._sums, strict=True)
                   if e is not None and current_epoch - self.slots < e <= current_epoch)
