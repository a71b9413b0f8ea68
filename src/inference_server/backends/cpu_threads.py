"""How many torch intra-op threads a CPU step runs with.

A decode step of a small model is a chain of ~130 small matmuls and ~1,000 elementwise ops of a few µs each:
splitting each across OpenMP threads costs a barrier per op, and when any of those threads is descheduled (the
event loop and HTTP run on the same cores, and a laptop runs other programs) every barrier waits for it. One
thread was faster than two at every load measured on the 2-core machine (docs/quantization.md, "Threads").
Prefill steps of many tokens are compute-bound matmuls that two threads do speed up, so steps of more than
``SMALL_STEP_TOKENS`` tokens keep torch's default thread count.

torch's thread count is per calling thread under OpenMP, so the runner applies it in the thread that runs the
step (the executor's worker thread).
"""

from __future__ import annotations

import torch

SMALL_STEP_TOKENS = 16
"""Steps of at most this many tokens (decodes of up to 16 sequences, short prompt tails) run on one thread."""


class CpuThreads:
    """Sets torch's intra-op thread count for each step from its token count; changes it only when needed."""

    def __init__(self, default: int | None = None) -> None:
        self.default = default or torch.get_num_threads()

    def for_tokens(self, tokens: int) -> int:
        """The thread count a step of ``tokens`` tokens runs with."""
        return 1 if tokens <= SMALL_STEP_TOKENS else self.default

    def apply(self, tokens: int) -> None:
        """Set the calling thread's torch thread count for a step of ``tokens`` tokens."""
        threads = self.for_tokens(tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
