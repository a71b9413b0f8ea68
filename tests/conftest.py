"""Suite-wide set-up: Triton kernels run in the interpreter when no CUDA device is present.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it must be set before any test module
imports ``inference_server.kernels``; conftest.py is imported first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# bench/ holds helpers the tests share with the benchmark drivers (server_process.py, serve_bench.py).
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
