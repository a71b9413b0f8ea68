"""Suite-wide set-up: Triton kernels run in the interpreter when no CUDA device is present.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it must be set before any test module
imports ``inference_server.kernels``; conftest.py is imported first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# bench/ holds helpers the tests share with the benchmark drivers (kit/server_process.py, serve_bench.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (the rest of each sweep), whatever -m selects")
    parser.addoption("--engine-process", choices=("in-process", "separate"), default="in-process",
                     help="separate: the HTTP tests' serve fixture puts the engine behind the process boundary's "
                          "RemoteEngine and serve_engine (a socketpair in the same trio run)")


WORKERS_AT_MOST = 4
"""The whole suite's test processes: one per core, at most this many (each holds torch and its tiny models)."""


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole default run (``pytest`` with no paths: the README's command, CI's) spreads its tests over one
    pytest-xdist worker per core: most tests run on one thread (the Triton interpreter, ``one_torch_thread``), so a
    2-core CI machine would otherwise leave one core idle. Not when paths are named (a developer's file or test runs
    in this process), ``-n`` is given (``-n 0``: no workers), tests are only collected or debugged, or CUDA is
    present (one GPU: the gpu tests and their timings stay in one process). A worker that runs a test of the
    session's ``embedded_server`` starts its own (xdist_group would keep them on one worker, but pytest-xdist 3.8
    does not group under pytest 9: its suffixed node ids are not seen), so the model loads at most once a worker."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is not None or config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return
    if config.option.collectonly or config.option.usepdb or _cuda_available():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores > 1:
        config.option.numprocesses = min(cores, WORKERS_AT_MOST)
        config.option.dist = "load"


SWEEP_DIRECTORIES = (Path(__file__).resolve().parent / "kernels",)
"""Every parametrized test under these is a ``sweep``: the kernels' tests run each kernel over shapes, dtypes and
configs (in the Triton interpreter without CUDA), and one case per test is what the default run needs."""


def _is_sweep_case(item: pytest.Item) -> bool:
    """A ``sweep`` test's case other than its first: some parameter is not the first of its list. Chosen by
    parameter index, not by collection order, so the representative case is the same in every run."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or not any(index != 0 for index in callspec.indices.values()):
        return False
    return item.get_closest_marker("sweep") is not None or any(
        directory in item.path.parents for directory in SWEEP_DIRECTORIES)


def _slow_selected(config: pytest.Config) -> bool:
    """Whether slow tests run: ``--run-slow``, or an ``-m`` expression that names ``slow`` without negating it
    (``-m slow``, ``-m "gpu and slow"``). Decided here rather than by an ``-m 'not slow'`` in addopts because
    the last ``-m`` wins in pytest: ``-m gpu`` on the command line would bring the slow sweeps back."""
    expression = config.option.markexpr or ""
    return bool(config.getoption("--run-slow")) or ("slow" in expression and "not slow" not in expression)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each sweep's cases but the first ``slow`` (before ``-m`` selects), deselect ``slow`` tests unless
    asked for, and skip ``gpu`` tests without CUDA."""
    for item in items:
        if _is_sweep_case(item):
            item.add_marker(pytest.mark.slow)
    if not _slow_selected(config):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_torch_thread():
    """Pin torch to one thread: reference logits (and MoE bits) depend on the thread count."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


EMBEDDED_SERVER_TIMEOUT = 300.0  # seconds to start and to load: the embedded model on a busy 2-core machine


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """One ``inference-server serve`` of the embedded model on the CPU for the whole session: ``(pid, base url)``.
    Shared by the tests that only ask it questions (structured outputs, tool calls, serve_bench), so that the
    model loads once; a test of start-up, shutdown or settings starts a server of its own."""
    from kit.server_process import launched

    log = tmp_path_factory.mktemp("embedded-server") / "server.log"
    env = {"MODEL": "", "DEVICE": "cpu", "MAX_BATCH_SIZE": "16", "LOG_LEVEL": "warning"}
    with launched(env, log, start_timeout=EMBEDDED_SERVER_TIMEOUT, ready_timeout=EMBEDDED_SERVER_TIMEOUT) as (
            process, url):
        yield process.pid, url
