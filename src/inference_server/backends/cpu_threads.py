"""How many torch intra-op threads a CPU step runs with, chosen by measuring the steps themselves.

A decode step of a small model is a chain of ~130 small matmuls and ~1,000 elementwise ops. On an idle machine
torch's default thread count splits each matmul across the cores and the step is faster; when the cores are busy
(the event loop and HTTP run on the same cores, a laptop runs other programs) each matmul's OpenMP barrier waits
for a descheduled thread and the same step becomes several times slower than on one thread. Neither count wins
everywhere (docs/quantization.md, "Threads"), and the load changes while a server runs, so the runner measures:
decode-sized steps (at most ``SMALL_STEP_TOKENS`` tokens, whose time hardly depends on the token count) run on
the count that has been faster lately, and every so often a few steps try the other count. A trial that loses
doubles the wait before the next one (up to ``MAX_TRIAL_INTERVAL`` steps), so a count that is much slower under
the current load costs little; one that wins takes over at once.

Prefill steps of many tokens are compute-bound matmuls that torch's default count speeds up at any load measured,
so they keep it.

torch's thread count is per calling thread under OpenMP, so the runner applies it in the thread that runs the
step (the executor's worker thread), and reports the step's duration back with ``record``.
"""

from __future__ import annotations

import collections
import statistics

import torch

SMALL_STEP_TOKENS = 16
"""Steps of at most this many tokens (decodes of up to 16 sequences, short prompt tails) are timed and run on
whichever count has been faster."""
TRIAL_STEPS = 3
"""Steps a trial of the other count runs; their median is compared with the current count's recent median."""
RECENT_STEPS = 16
"""How many of the current count's latest steps its median is taken over."""
FIRST_TRIAL_AFTER = 8
"""Small steps on the first count before the first trial of the other."""
MAX_TRIAL_INTERVAL = 1024
"""The longest wait, in small steps, between two trials: how soon a change of load is noticed."""
MARGIN = 0.95
"""A trial's median must be below this fraction of the current count's to take over (ignores noise)."""


class CpuThreads:
    """Sets torch's intra-op thread count for each step; for decode-sized steps, the count measured faster.

    Use: ``apply(tokens)`` just before a step runs (in the thread that runs it), then ``record(tokens, seconds)``
    with its duration. With one core (``default == 1``) every step runs on one thread and nothing is measured.
    """

    def __init__(self, default: int | None = None) -> None:
        self.default = default or torch.get_num_threads()
        self.current = 1  # the count decode-sized steps run on: one thread until a trial shows the default wins
        self._other = self.default
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._trial: list[float] = []
        self._until_trial = FIRST_TRIAL_AFTER
        self._interval = FIRST_TRIAL_AFTER

    @property
    def trying(self) -> bool:
        """Whether the next small steps are a trial of the other count."""
        return self.default > 1 and self._until_trial <= 0

    def for_tokens(self, tokens: int) -> int:
        """The thread count a step of ``tokens`` tokens runs with now."""
        if tokens > SMALL_STEP_TOKENS:
            return self.default
        return self._other if self.trying else self.current

    def apply(self, tokens: int) -> None:
        """Set the calling thread's torch thread count for a step of ``tokens`` tokens."""
        threads = self.for_tokens(tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def record(self, tokens: int, seconds: float) -> None:
        """The duration of the step ``apply(tokens)`` was last called for; decides trials and switches."""
        if tokens > SMALL_STEP_TOKENS or self.default == 1:
            return
        if not self.trying:
            self._recent.append(seconds)
            self._until_trial -= 1
            return
        self._trial.append(seconds)
        if len(self._trial) < TRIAL_STEPS:
            return
        trial, self._trial = statistics.median(self._trial), []
        if self._recent and trial < MARGIN * statistics.median(self._recent):
            self.current, self._other = self._other, self.current
            self._recent.clear()
            self._recent.append(trial)
            self._interval = FIRST_TRIAL_AFTER
        else:
            self._interval = min(2 * self._interval, MAX_TRIAL_INTERVAL)
        self._until_trial = self._interval
