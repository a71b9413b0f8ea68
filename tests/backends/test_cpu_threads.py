"""The CPU runner's per-step torch thread count: decode-sized steps run on the count measured faster lately, with
trials of the other count that back off while they lose; big steps run on torch's default."""

from __future__ import annotations

import threading

import torch

from inference_server.backends.cpu_threads import (
    FIRST_TRIAL_AFTER,
    MAX_TRIAL_INTERVAL,
    SMALL_STEP_TOKENS,
    TRIAL_STEPS,
    CpuThreads,
)


def run_small_steps(threads: CpuThreads, count: int, seconds_on: dict[int, float]) -> list[int]:
    """Run ``count`` decode-sized steps whose duration depends only on the thread count; the counts used."""
    used = []
    for _ in range(count):
        chosen = threads.for_tokens(1)
        used.append(chosen)
        threads.record(1, seconds_on[chosen])
    return used


def test_large_steps_run_on_the_default_and_are_not_measured() -> None:
    threads = CpuThreads(default=2)
    assert threads.for_tokens(SMALL_STEP_TOKENS + 1) == 2
    for _ in range(10 * FIRST_TRIAL_AFTER):
        threads.record(SMALL_STEP_TOKENS + 1, 1.0)
    assert threads.for_tokens(1) == 1 and not threads.trying
    assert CpuThreads().default == torch.get_num_threads()


def test_the_default_takes_over_when_its_trial_is_faster() -> None:
    threads = CpuThreads(default=2)
    used = run_small_steps(threads, FIRST_TRIAL_AFTER + TRIAL_STEPS + 4, {1: 0.060, 2: 0.045})
    assert used[:FIRST_TRIAL_AFTER] == [1] * FIRST_TRIAL_AFTER  # one thread first
    assert used[FIRST_TRIAL_AFTER:] == [2] * (TRIAL_STEPS + 4)  # the trial, then the winner
    assert threads.current == 2


def test_a_losing_trial_backs_off_and_the_loser_costs_few_steps() -> None:
    threads = CpuThreads(default=2)
    used = run_small_steps(threads, 20_000, {1: 0.100, 2: 0.550})  # a loaded machine: two threads 5x slower
    assert threads.current == 1
    trials = used.count(2)
    # trials after 8, 16, 32, ... steps, then every MAX_TRIAL_INTERVAL: a small share of all steps
    assert TRIAL_STEPS <= trials <= TRIAL_STEPS * (8 + 20_000 // MAX_TRIAL_INTERVAL)
    assert trials / len(used) < 0.01


def test_a_change_of_load_is_followed_both_ways() -> None:
    threads = CpuThreads(default=2)
    run_small_steps(threads, 200, {1: 0.060, 2: 0.045})  # quiet: two threads win
    assert threads.current == 2
    run_small_steps(threads, 3 * MAX_TRIAL_INTERVAL, {1: 0.100, 2: 0.550})  # then the cores get busy
    assert threads.current == 1
    run_small_steps(threads, 3 * MAX_TRIAL_INTERVAL, {1: 0.060, 2: 0.045})  # and quiet again
    assert threads.current == 2


def test_noise_within_the_margin_does_not_switch() -> None:
    threads = CpuThreads(default=2)
    run_small_steps(threads, 500, {1: 0.050, 2: 0.049})
    assert threads.current == 1


def test_one_core_never_tries_another_count() -> None:
    threads = CpuThreads(default=1)
    assert set(run_small_steps(threads, 100, {1: 0.05})) == {1}
    assert not threads.trying


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
