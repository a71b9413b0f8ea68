"""The CPU runner's per-step torch thread count: one thread for decode-sized steps, torch's default for big ones."""

from __future__ import annotations

import threading

import torch

from inference_server.backends.cpu_threads import SMALL_STEP_TOKENS, CpuThreads


def test_small_steps_run_on_one_thread_and_large_ones_on_the_default() -> None:
    threads = CpuThreads(default=2)
    assert threads.for_tokens(1) == 1
    assert threads.for_tokens(SMALL_STEP_TOKENS) == 1
    assert threads.for_tokens(SMALL_STEP_TOKENS + 1) == 2
    assert CpuThreads().default == torch.get_num_threads()


def test_apply_sets_the_calling_threads_count() -> None:
    seen: list[int] = []

    def step_thread() -> None:  # as the executor's worker thread runs steps
        threads = CpuThreads(default=2)
        threads.apply(1)
        seen.append(torch.get_num_threads())
        threads.apply(SMALL_STEP_TOKENS + 1)
        seen.append(torch.get_num_threads())
        threads.apply(3)
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    worker = threading.Thread(target=step_thread)
    worker.start()
    worker.join(timeout=60)
    torch.set_num_threads(before)  # the count can be process-wide under some OpenMP runtimes
    assert seen == [1, 2, 1]
